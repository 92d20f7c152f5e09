"""The node's /metrics listener (`hetnode join --metrics HOST:PORT`): a few lines of HTTP/1.1 over trio, not a
web framework, since it answers one GET.

It runs as a task of the node's nursery and must never take the node down: every connection is handled inside a
catch-all, a request head is bounded in size and in time, connections beyond a small number at once are answered
503 and closed, and a listener that fails stops serving metrics with an error in the log while the node goes on.
Every connection is closed after its answer (`Connection: close`): Prometheus scrapes once per interval.
"""

from __future__ import annotations

import logging

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 8192  # a request line and headers; anything longer is refused (431)
HEAD_TIMEOUT_S = 5.0  # a client that sends its head slower than this is dropped (408)
MAX_CONNECTIONS = 16  # at once; the rest are answered 503


async def serve_metrics(registry: CollectorRegistry, host: str, port: int, *,
                        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve GET /metrics (and GET /healthz) until cancelled; `task_status.started(url)` once bound (port 0 picks
    a free one). A bind that fails raises (the operator asked for this address); later failures only log."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    limiter = trio.CapacityLimiter(MAX_CONNECTIONS)

    async def handler(stream: trio.SocketStream) -> None:
        try:
            if limiter.available_tokens < 1:
                # Read what the client sent first (briefly): closing with unread bytes resets the connection,
                # which can throw the answer away before the client reads it.
                with trio.move_on_after(0.5):
                    await stream.receive_some(MAX_HEAD_BYTES)
                await _answer(stream, 503, b"too many connections\n")
                return
            async with limiter:
                await _serve_one(stream, registry)
        except Exception as exc:  # a client's fault or a broken socket: never the node's end
            log.debug("metrics connection failed: %r", exc)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await stream.aclose()

    bound = listeners[0].socket.getsockname()
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    url = f"http://{shown}:{bound[1]}"
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, handler, listeners)
            task_status.started(url)
    except OSError as exc:
        log.error("the metrics listener at %s failed; no metrics from now on: %s", url, exc)


async def _serve_one(stream: trio.SocketStream, registry: CollectorRegistry) -> None:
    head = b""
    with trio.move_on_after(HEAD_TIMEOUT_S) as scope:
        while b"\r\n\r\n" not in head and len(head) <= MAX_HEAD_BYTES:
            chunk = await stream.receive_some(4096)
            if not chunk:
                return  # the client went away
            head += chunk
    if scope.cancelled_caught:
        await _answer(stream, 408, b"request head not received in time\n")
        return
    if b"\r\n\r\n" not in head[:MAX_HEAD_BYTES + 4]:
        await _answer(stream, 431, b"request head too large\n")
        return
    parts = head.split(b"\r\n", 1)[0].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        await _answer(stream, 400, b"malformed request line\n")
        return
    method, target = parts[0], parts[1].split(b"?", 1)[0]
    if target not in (b"/metrics", b"/healthz"):
        await _answer(stream, 404, b"not found: this listener serves GET /metrics\n")
        return
    if method not in (b"GET", b"HEAD"):
        await _answer(stream, 405, b"only GET\n", extra=b"Allow: GET, HEAD\r\n")
        return
    if target == b"/healthz":
        await _answer(stream, 200, b"ok\n", head_only=method == b"HEAD")
        return
    try:
        body = generate_latest(registry)
    except Exception:
        log.exception("collecting the node's metrics failed")
        await _answer(stream, 500, b"collecting the metrics failed; see the node's log\n")
        return
    await _answer(stream, 200, body, content_type=CONTENT_TYPE_LATEST.encode(), head_only=method == b"HEAD")


_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed", 408: b"Request Timeout",
            431: b"Request Header Fields Too Large", 500: b"Internal Server Error", 503: b"Service Unavailable"}


async def _answer(stream: trio.SocketStream, status: int, body: bytes, *,
                  content_type: bytes = b"text/plain; charset=utf-8", extra: bytes = b"",
                  head_only: bool = False) -> None:
    head = (b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n%s\r\n"
            % (status, _REASONS[status], content_type, len(body), extra))
    with trio.move_on_after(HEAD_TIMEOUT_S):
        await stream.send_all(head if head_only else head + body)
