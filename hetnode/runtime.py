"""Process-level plumbing shared by the daemons: logging, signals, readiness lines, link emulation setup."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

from hetnode.errors import ConfigError
from hetnode.protocol.transport import Transport

log = logging.getLogger(__name__)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # Importing py-libp2p turns off its loggers' propagation; route them through ours again.
    import libp2p  # noqa: F401

    logging.getLogger("libp2p").propagate = True
    # py-libp2p logs every stream hiccup at INFO or WARNING (and a peer asking for a protocol we do not serve at
    # ERROR); our own logs say what matters.
    for noisy in ("libp2p", "multiaddr", "hypercorn.error", "async_service"):
        logging.getLogger(noisy).setLevel(max(logging.CRITICAL if noisy == "libp2p" else logging.ERROR,
                                              logging.getLogger().level))


def announce_ready(ready_fd: int | None, **fields: Any) -> None:
    """Tell whoever started us that we are serving: one JSON line on the readiness fd (the testnet reads it),
    and a human line on stdout."""
    line = json.dumps({"event": "ready", **fields})
    if ready_fd is not None:
        try:
            with os.fdopen(ready_fd, "w", closefd=True) as f:
                f.write(line + "\n")
        except OSError as exc:
            log.warning("could not write the readiness line to fd %d: %s", ready_fd, exc)
    print(f"READY {line}", flush=True)


async def shutdown_on_signal(scope: trio.CancelScope, before_cancel: Callable[[], Any] | None = None,
                             *, lifeline_fd: int | None = None, grace_s: float = 3.0) -> None:
    """SIGINT, SIGTERM, or the end of the lifeline pipe: run the graceful step (bounded), then cancel the
    daemon's root scope. The testnet holds the lifeline's write end: when the launcher dies, however it dies,
    the kernel closes it and its children see EOF here (PR_SET_PDEATHSIG would follow the spawning thread,
    which for trio is a worker thread that exits when idle)."""
    async with trio.open_nursery() as nursery:

        async def stop(why: str) -> None:
            log.info("%s; shutting down", why)
            if before_cancel is not None:
                with trio.move_on_after(grace_s):
                    await before_cancel()
            scope.cancel()
            nursery.cancel_scope.cancel()

        async def signals() -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
                async for signum in received:
                    await stop(f"received {signal.Signals(signum).name}")
                    return

        async def lifeline(fd: int) -> None:
            await trio.lowlevel.wait_readable(fd)
            await stop("the testnet launcher is gone")

        nursery.start_soon(signals)
        if lifeline_fd is not None:
            nursery.start_soon(lifeline, lifeline_fd)


@asynccontextmanager
async def maybe_shaped(transport: Transport, emulate_links: str | None) -> AsyncIterator[Transport]:
    """Wrap the transport in link emulation when the testnet asked for it."""
    if not emulate_links:
        yield transport
        return
    from hetnode.protocol.shaping import shaped_transport
    from hetnode.testnet.emulation import load_link_emulation

    link_for = load_link_emulation(emulate_links)
    async with shaped_transport(transport, link_for) as shaped:
        yield shaped


def parse_hostport(value: str, flag: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"expected HOST:PORT, got {value!r}", key=flag)
    return host.strip("[]") or "127.0.0.1", int(port)
