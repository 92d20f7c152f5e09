"""GET /dashboard: the cluster drawn live in a browser, from the coordinator's own JSON routes.

The page is three static files shipped in the package (static/dashboard.*: plain HTML, JS and SVG, no build
step, nothing fetched from elsewhere; its Content-Security-Policy forbids any other origin). It polls
GET /v1/cluster (nodes, loads, measured links), GET /v1/plan (layer ranges, roles, flows, history) and
GET /v1/stats (this module: request rate, outcomes, TTFT/TPOT from `LiveStats`, KV use summed over the nodes).

Authentication. A browser cannot put an `Authorization` header on a page it navigates to, so the page itself
is served without the API key: the three static files hold no data about the cluster, only the code that
draws it. Every byte of data comes from the JSON routes, which stay behind the key like every other route.
The operator opens `/dashboard#key=KEY`: the fragment never leaves the browser (it is not sent in the request,
so it is in no access log and no Referer), the page moves it to sessionStorage (this tab only, gone when it
closes), removes it from the address bar, and sends it as `Authorization: Bearer KEY` on each poll. Without
a key, or with a wrong one, the JSON routes answer 401 and the page asks for the key.
"""

from __future__ import annotations

import time
from importlib import resources

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hetnode.coordinator.daemon import Coordinator
from hetnode.coordinator.live_stats import LiveStats
from hetnode.coordinator.openai_api import OUTCOMES
from hetnode.coordinator.openapi import DocumentedRoute, Operation, Schema

# What the page may load: itself, its two files, and the JSON routes on the same origin. No inline script.
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_ASSETS = {
    "/dashboard": ("dashboard.html", "text/html; charset=utf-8"),
    "/dashboard/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}


def _read_asset(name: str) -> bytes:
    return resources.files("hetnode.coordinator").joinpath("static", name).read_bytes()


def stats_view(coordinator: Coordinator, stats: LiveStats) -> dict[str, object]:
    """GET /v1/stats: what the dashboard shows beside the graph, from what the coordinator already tracks."""
    members = coordinator.registry.members()
    used = sum(r.load.kv_blocks_used for r in members)
    free = sum(r.load.kv_blocks_free for r in members)
    deployment, generator = coordinator.deployment, coordinator.generator
    plan = deployment.plan if deployment is not None else None  # the newest, perhaps still loading
    serving = deployment.serving if deployment is not None else None  # the one requests queue at
    return {
        "at": time.time(),
        "serving": deployment is not None,
        "requests": stats.summary(),
        "kv": {"blocks_used": used, "blocks_free": free,
               "used_share": used / (used + free) if used + free else 0.0},
        "sessions": {
            "active": generator.active_sessions if generator is not None else 0,
            "queued": serving.scheduler.queue_len if serving is not None else 0,
        },
        "nodes": {"up": len(members), "known": len(coordinator.registry.nodes)},
        "plan_version": plan.version if plan is not None else None,
    }


def dashboard_routes(coordinator: Coordinator, stats: LiveStats) -> list[Route]:
    """The page's routes and GET /v1/stats, to pass to `build_app(extra_routes=...)`; `stats` must be the
    object the OpenAI routes report to (`openai_routes(..., metrics=[..., stats])`)."""
    # Read once: a packaging mistake fails at start-up, not on the first visit.
    bodies = {path: (_read_asset(name), media) for path, (name, media) in _ASSETS.items()}

    async def asset(request: Request) -> Response:
        body, media = bodies[request.url.path]
        return Response(body, media_type=media, headers={
            "Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"})

    async def live(request: Request) -> Response:
        return JSONResponse(stats_view(coordinator, stats), headers={"Cache-Control": "no-store"})

    return [*(DocumentedRoute(path, asset, method="GET", operation=_asset_operation(name, media))
              for path, (name, media) in _ASSETS.items()),
            DocumentedRoute("/v1/stats", live, method="GET", operation=STATS)]


def _asset_operation(name: str, media: str) -> Operation:
    # Open: a browser cannot send the key on navigation, and the file holds no data (the module's docstring).
    return Operation(summary=f"the dashboard's {name} (static; served without the API key)",
                     ok={media.split(";")[0]: {"type": "string"}}, open=True)


_NUMBER_OR_NULL: Schema = {"type": ["number", "null"]}
_QUANTILES: Schema = {"type": "object", "required": ["p50", "p95"],
                      "properties": {"p50": _NUMBER_OR_NULL, "p95": _NUMBER_OR_NULL}}
_COUNTS: Schema = {"type": "object", "required": list(OUTCOMES),
                   "properties": {o: {"type": "integer", "minimum": 0} for o in OUTCOMES}}
STATS = Operation(
    summary="what the dashboard shows beside the graph: requests over a sliding window (rate, outcomes, "
            "TTFT/TPOT, per bucket), sessions, KV blocks in use, nodes up",
    ok={"application/json": {"type": "object",
                             "required": ["at", "serving", "requests", "kv", "sessions", "nodes", "plan_version"],
                             "properties": {
        "at": {"type": "number"}, "serving": {"type": "boolean"},
        "requests": {"type": "object", "required": ["window_s", "requests", "rate", "outcomes", "totals", "ttft_s",
                                                    "tpot_s", "series"],
                     "properties": {"outcomes": _COUNTS, "totals": _COUNTS, "ttft_s": _QUANTILES,
                                    "tpot_s": _QUANTILES, "series": {"type": "array", "items": {"type": "object"}}}},
        "kv": {"type": "object", "required": ["blocks_used", "blocks_free", "used_share"]},
        "sessions": {"type": "object", "required": ["active", "queued"]},
        "nodes": {"type": "object", "required": ["up", "known"]},
        "plan_version": {"type": ["integer", "null"]}}}},
)
