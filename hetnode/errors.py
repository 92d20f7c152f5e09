"""The small vocabulary of errors that hetnode raises across module boundaries."""


class HetnodeError(Exception):
    """Base of every error hetnode raises on purpose."""


class ConfigError(HetnodeError):
    """A bad flag, config file or cluster file. The CLI maps it to exit code 2."""

    def __init__(self, problem: str, *, file: str | None = None, key: str | None = None) -> None:
        self.problem = problem
        self.file = file
        self.key = key
        where = ": ".join(part for part in (file, key) if part)
        super().__init__(f"{where}: {problem}" if where else problem)


class ProtocolError(HetnodeError):
    """A peer sent something that does not follow the wire protocol (bad frame, bad message, wrong order)."""


class FrameTooLarge(ProtocolError):
    """A frame's length prefix is over the configured limit."""


class StreamClosed(HetnodeError):
    """The stream ended (cleanly or by reset) before the expected data arrived."""


class StreamReset(StreamClosed):
    """The remote side (or the transport) reset the stream."""


class PeerUnreachable(HetnodeError):
    """A dial or stream open to a peer failed."""


class Refused(HetnodeError):
    """The coordinator refused a join; the reason is the message."""
