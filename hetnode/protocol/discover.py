"""/hetnode/discover/1: any peer tells anyone where the coordinator is (public: it is what a joiner needs first).
"""

from __future__ import annotations

from collections.abc import Callable

from hetnode.errors import ProtocolError
from hetnode.protocol.framing import FramedStream
from hetnode.protocol.messages import DiscoverReply, DiscoverRequest, discover_decoder
from hetnode.protocol.transport import Stream


async def serve_discover(stream: Stream, answer: Callable[[], DiscoverReply | None]) -> None:
    """Answer one DiscoverRequest with answer(), or an error when it returns None (coordinator unknown)."""
    framed = FramedStream(stream)
    try:
        msg = await framed.expect_msg(discover_decoder)
    except ProtocolError as exc:
        await framed.reject("bad_message", str(exc))
        return
    if not isinstance(msg, DiscoverRequest):
        await framed.reject("bad_message", f"unexpected {type(msg).__name__}")
        return
    reply = answer()
    if reply is None:
        await framed.reject("unknown", "this peer has not found the coordinator yet")
        return
    await framed.send_msg(reply)
    await framed.aclose()
