"""Request ids: every REST request gets one, returned in `X-Request-Id`, and a generation carries it to every hop
of its route as its trace id (Install.trace) and keys its trace (`GET /v1/requests/{id}`).

A client may bring its own: an `X-Request-Id` of 1 to 128 characters from [A-Za-z0-9._:-], or a W3C
`traceparent` (version 00), whose 32-hex trace id is then used. Anything else is ignored and a fresh id given,
so that a hostile header never reaches a log line, a wire message or a trace key unchecked.
"""

from __future__ import annotations

import re
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"
_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")


def new_request_id() -> str:
    return uuid.uuid4().hex


def valid_request_id(value: str) -> bool:
    return _ID.fullmatch(value) is not None


def request_id_from(headers: dict[bytes, bytes]) -> str:
    """The client's id when it is well-formed, else a fresh one."""
    given = headers.get(HEADER)
    if given is not None:
        text = given.decode("latin-1").strip()
        if valid_request_id(text):
            return text
    parent = headers.get(b"traceparent")
    if parent is not None:
        m = _TRACEPARENT.fullmatch(parent.decode("latin-1").strip())
        if m is not None and m.group(1) != "0" * 32 and m.group(2) != "0" * 16:  # all-zero ids are invalid
            return m.group(1)
    return new_request_id()


class RequestIdMiddleware:
    """Gives every HTTP request its id (`request.state.request_id`) and every answer the `X-Request-Id` header,
    errors included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id_from(dict(scope["headers"]))
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, rid.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)
