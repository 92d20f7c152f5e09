"""The coordinator's REST API: an ASGI app (Starlette) served by hypercorn's trio worker in the daemon's nursery.

Errors use OpenAI's error JSON shape, `{"error": {"message", "type", "code"}}`, everywhere, so that OpenAI
clients show our reasons. With an API key configured every route but /healthz needs `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from hetnode import __version__
from hetnode.coordinator import admin_spec
from hetnode.coordinator.daemon import Coordinator
from hetnode.coordinator.deployment import METHODS
from hetnode.coordinator.openapi import DocumentedRoute, openapi_document
from hetnode.coordinator.request_ids import RequestIdMiddleware

log = logging.getLogger(__name__)

# Request bodies above this are refused before they are read whole (prompts are text; 8 MiB is generous).
MAX_BODY_BYTES = 8 << 20


def error_response(status: int, message: str, *, type_: str = "invalid_request_error",
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "code": code, "param": None}},
                        status_code=status, headers=headers)


class ApiKeyMiddleware:
    """Bearer-token check in front of every route except the open ones."""

    def __init__(self, app: ASGIApp, api_key: str | None, open_paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.open_paths = open_paths  # the routes whose OpenAPI operation says `open`

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.api_key is None or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization", b"")
        scheme, _, key = auth.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.api_key):
            reason = "missing API key" if not auth else "invalid API key"
            response = error_response(401, f"{reason}: send 'Authorization: Bearer <key>'",
                                      type_="authentication_error", code="invalid_api_key",
                                      headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for bodies over the limit, judged by Content-Length and by the bytes actually received."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await error_response(413, f"request body over {self.limit} bytes")(scope, receive, send)
            return
        seen = 0

        async def limited_receive() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise HTTPException(413, f"request body over {self.limit} bytes")
            return message

        await self.app(scope, limited_receive, send)


def build_app(coordinator: Coordinator, *, api_key: str | None = None,
              extra_routes: list[Route] | None = None, max_wait_s: float = admin_spec.MAX_CLUSTER_WAIT_S,
              ) -> Starlette:
    """The app; `max_wait_s` bounds GET /v1/cluster's long-poll (tests that fuzz the API keep it short)."""

    async def healthz(request: Request) -> Response:
        view = coordinator.registry
        return JSONResponse({"status": "ok", "peer_id": coordinator.transport.peer_id,
                             "up_nodes": len(view.up_members())})

    async def cluster(request: Request) -> Response:
        """With min_up / max_up / min_links and timeout (seconds, at most 60), wait until the view matches."""
        asked = _long_poll(request, {"min_up": int, "max_up": int, "min_links": int}, max_wait_s)
        if isinstance(asked, Response):
            return asked
        conditions, timeout = asked
        min_up, max_up, min_links = (conditions.get(k) for k in ("min_up", "max_up", "min_links"))
        reg = coordinator.registry

        def matches() -> bool:
            up = len(reg.up_members())
            return ((min_up is None or up >= min_up) and (max_up is None or up <= max_up)
                    and (min_links is None or len(reg.links) >= min_links))

        satisfied = await coordinator.wait_until(matches, timeout) if conditions else True
        view = coordinator.cluster_view()
        view["satisfied"] = satisfied
        return JSONResponse(view)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(exc.status_code, str(exc.detail),
                              type_="not_found_error" if exc.status_code == 404 else "invalid_request_error")

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}", type_="server_error")

    async def plan(request: Request) -> Response:
        """With ready / min_nodes / min_version / kv_reported and timeout (seconds, at most 60), wait until the
        newest plan matches: a client waiting for a ready plan (or for a re-plan, or for the scheduler to count
        the nodes' real KV pools) needs no polling loop."""
        deployment = coordinator.deployment
        if deployment is None:
            return error_response(404, "this coordinator serves no model", type_="not_found_error")
        asked = _long_poll(request, {"ready": _flag, "min_nodes": int, "min_version": int, "kv_reported": _flag},
                           max_wait_s)
        if isinstance(asked, Response):
            return asked
        conditions, timeout = asked
        ready, min_nodes, min_version, kv_reported = (conditions.get(k) for k in (
            "ready", "min_nodes", "min_version", "kv_reported"))

        def matches() -> bool:
            newest = deployment.plan
            if newest is None:
                return ready is False and min_nodes is None and min_version is None and kv_reported is None
            return ((ready is None or newest.is_ready == ready)
                    and (min_nodes is None or len(newest.peers()) >= min_nodes)
                    and (min_version is None or newest.version >= min_version)
                    and (kv_reported is None or (newest.peers() <= newest.kv_reported) == kv_reported))

        satisfied = await deployment.wait_until(matches, timeout) if conditions else True
        view = deployment.to_json()
        view["satisfied"] = satisfied
        if coordinator.generator is not None:
            view["handoffs"] = list(coordinator.generator.handoffs)  # the latest KV hand-offs, oldest first
        return JSONResponse(view)

    async def replan(request: Request) -> Response:
        """Re-plan now, optionally with another method: {"method": "helix"|"petals"|..., "reason": "..."}."""
        deployment = coordinator.deployment
        if deployment is None:
            return error_response(404, "this coordinator serves no model", type_="not_found_error")
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError as exc:
            return error_response(400, f"the body is not JSON: {exc}")
        if not isinstance(body, dict) or set(body) - {"method", "reason"}:
            return error_response(400, "the body must be an object with optional 'method' and 'reason'")
        method, reason = body.get("method"), body.get("reason", "requested through POST /v1/plan")
        if method is not None and method not in METHODS:
            return error_response(400, f"unknown method {method!r}; known: {', '.join(METHODS)}")
        if not isinstance(reason, str) or len(reason) > admin_spec.MAX_REASON_CHARS:
            return error_response(400, f"reason must be a string of at most {admin_spec.MAX_REASON_CHARS} characters")
        plan = await deployment.replan(reason, method=method)
        if plan is None:
            return error_response(409, f"no plan: {deployment.problem}", type_="conflict_error")
        return JSONResponse(deployment.to_json())

    async def openapi(request: Request) -> Response:
        return JSONResponse(document)

    routes: list[Route] = [
        DocumentedRoute("/healthz", healthz, method="GET", operation=admin_spec.HEALTHZ),
        DocumentedRoute("/openapi.json", openapi, method="GET", operation=admin_spec.OPENAPI),
        DocumentedRoute("/v1/cluster", cluster, method="GET", operation=admin_spec.cluster(max_wait_s)),
        DocumentedRoute("/v1/plan", plan, method="GET", operation=admin_spec.plan(max_wait_s)),
        DocumentedRoute("/v1/plan", replan, method="POST", operation=admin_spec.REPLAN),
        *(extra_routes or []),
    ]
    document = openapi_document(routes, title="hetnode coordinator", version=__version__,
                                secured=api_key is not None)
    return Starlette(
        routes=routes,
        # Outermost first: every answer, a refusal for size or key included, carries its X-Request-Id.
        middleware=[Middleware(RequestIdMiddleware), Middleware(BodyLimitMiddleware),
                    Middleware(ApiKeyMiddleware, api_key=api_key, open_paths=frozenset(
                        r.path for r in routes if isinstance(r, DocumentedRoute) and r.operation.open))],
        exception_handlers={HTTPException: http_error, Exception: server_error},
    )


def _long_poll(request: Request, parsers: Mapping[str, Callable[[str], Any]], max_wait_s: float,
               ) -> tuple[dict[str, Any], float] | Response:
    """The conditions a long-polling GET asks for (parsed, by name) and its timeout, or a 400 that says what is
    wrong: a misspelt condition would otherwise answer at once as if it held."""
    q = request.query_params
    known = [*parsers, "timeout"]
    unknown = set(q) - set(known)
    if unknown:
        return error_response(400, f"unknown query parameter(s): {', '.join(sorted(unknown))}; known: "
                                   f"{', '.join(known)}")
    try:
        conditions = {name: parse(q[name]) for name, parse in parsers.items() if name in q}
        timeout = float(q["timeout"]) if "timeout" in q else min(10.0, max_wait_s)
    except ValueError as exc:
        return error_response(400, f"bad query parameter: {exc}")
    if not 0 <= timeout <= max_wait_s:
        return error_response(400, f"timeout must be between 0 and {max_wait_s:g} seconds")
    return conditions, timeout


def _flag(value: str) -> bool:
    if value.lower() in ("true", "1"):
        return True
    if value.lower() in ("false", "0"):
        return False
    raise ValueError(f"ready must be true or false, not {value!r}")


async def serve_api(app: Starlette, host: str, port: int, *,
                    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve until cancelled; `task_status.started(url)` reports the bound URL (port 0 picks a free one)."""
    config = HypercornConfig()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hetnode.api")
    config.graceful_timeout = 2.0

    async def run(*, task_status: trio.TaskStatus[list[str]]) -> None:
        await serve(app, config, task_status=task_status)  # type: ignore[arg-type]

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(run)
        task_status.started(binds[0] if binds else f"http://{host}:{port}")
