"""The operator's routes for watching a running coordinator: `GET /metrics` (Prometheus text format) and
`GET /v1/requests/{id}` (one request's trace), to pass to `build_app(extra_routes=...)`.

/metrics sits behind the API key like every route but /healthz: it names every node, its peer id and the
traffic, which is not for anyone who can reach the port. Prometheus sends the key with `authorization:
{credentials: KEY}` (or `bearer_token`) in its scrape config. The nodes' own /metrics listeners are separate
(`hetnode join --metrics`).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hetnode.coordinator.metrics import CoordinatorMetrics
from hetnode.coordinator.openai_schema import ApiError
from hetnode.coordinator.openapi import DocumentedRoute, Operation
from hetnode.coordinator.request_ids import valid_request_id
from hetnode.coordinator.sessions import PipelineGenerator


def observe_routes(metrics: CoordinatorMetrics, generator: PipelineGenerator | None) -> list[Route]:
    async def scrape(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def request_trace(request: Request) -> Response:
        rid = request.path_params["id"]
        if not valid_request_id(rid):
            return ApiError("a request id is 1 to 128 characters of A-Z, a-z, 0-9, '.', '_', ':', '-'",
                            param="id", code="invalid_request_id").response()
        if generator is None:
            return ApiError("this coordinator serves no model, so it traces no requests", status=404,
                            code="request_not_found").response()
        trace = generator.traces.get(rid)
        if trace is None:
            return ApiError(f"no request {rid} is remembered here: unknown, or older than the last "
                            f"{generator.traces.capacity} requests", status=404, code="request_not_found").response()
        return JSONResponse(trace.to_json())

    return [
        DocumentedRoute("/metrics", scrape, method="GET", operation=METRICS),
        DocumentedRoute("/v1/requests/{id}", request_trace, method="GET", operation=REQUEST_TRACE),
    ]


METRICS = Operation(summary="Prometheus metrics in the text exposition format (docs/observability.md)",
                    ok={"text/plain": {"type": "string"}})
REQUEST_TRACE = Operation(
    summary="one request's trace by its X-Request-Id: status, phases, routes, hops, KV codecs, moves",
    ok={"application/json": {"type": "object", "required": ["id", "status"],
                             "properties": {"id": {"type": "string"}, "status": {"type": "string"}}}},
    statuses={400: "the id is not 1 to 128 characters of A-Z, a-z, 0-9, '.', '_', ':', '-'",
              404: "no such request is remembered here"},
)
