"""The coordinator's OpenAPI 3.1 document, generated from the app's own routes.

Each route carries its description (`DocumentedRoute`), written beside the code that serves it and built from
the same bounds its validator checks (see `openai_spec.py`, `admin_spec.py`), so the document cannot name a
route that does not exist, and a route added without a description shows up in `undocumented_routes` (a test
fails on it) instead of silently missing from the document. Path parameters come from the route's own
template, so their names always match what the router extracts.

Every 4xx and 5xx answer of every route is OpenAI's error shape (`ERROR_SCHEMA`), which is what lets a fuzzer
check that property against the document alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.routing import BaseRoute, Route

log = logging.getLogger(__name__)

Schema = dict[str, Any]

ERROR_SCHEMA: Schema = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "null"]},
        },
    }},
}
_ERROR_REF = {"$ref": "#/components/schemas/Error"}
_ERROR_RESPONSE = {"description": "OpenAI's error shape", "content": {"application/json": {"schema": _ERROR_REF}}}
# Starlette's path converters, as JSON Schema (the router refuses other values with a 404 before any endpoint).
_CONVERTER_SCHEMAS: dict[str, Schema] = {
    "StringConvertor": {"type": "string", "pattern": "^[^/]+$"},
    "PathConvertor": {"type": "string"},
    "IntegerConvertor": {"type": "integer", "minimum": 0},
    "FloatConvertor": {"type": "number", "minimum": 0},
    "UUIDConvertor": {"type": "string", "format": "uuid"},
}


@dataclass(frozen=True)
class QueryParam:
    name: str
    schema: Schema
    description: str = ""


@dataclass(frozen=True)
class Operation:
    """What one method of one route takes and answers (the error answers are implied: OpenAI's shape)."""

    summary: str
    ok: Mapping[str, Schema]  # media type -> schema of the 200 answer
    body: Schema | None = None  # the JSON request body's schema; None: the route reads no body
    body_required: bool = True
    query: Sequence[QueryParam] = ()
    statuses: Mapping[int, str] = field(default_factory=dict)  # the 4xx/5xx it answers on purpose, and why
    open: bool = False  # served without the API key (health checks)


class DocumentedRoute(Route):
    """A Route that carries its OpenAPI operation."""

    def __init__(self, path: str, endpoint: Callable[..., Any], *, method: str, operation: Operation) -> None:
        super().__init__(path, endpoint, methods=[method])
        self.method = method.upper()
        self.operation = operation


def undocumented_routes(routes: Sequence[BaseRoute]) -> list[str]:
    """The routes the document cannot describe: every route must be a DocumentedRoute."""
    return [f"{', '.join(sorted(getattr(r, 'methods', None) or ['?']))} {getattr(r, 'path', r)}"
            for r in routes if not isinstance(r, DocumentedRoute)]


def openapi_document(routes: Sequence[BaseRoute], *, title: str, version: str, secured: bool) -> Schema:
    """The OpenAPI 3.1 document of `routes`; `secured`: every route but the open ones needs the bearer key."""
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        if not isinstance(route, DocumentedRoute):
            log.warning("route %s has no OpenAPI description", getattr(route, "path", route))
            continue
        op = route.operation
        parameters = [{"name": name, "in": "path", "required": True,
                       "schema": _CONVERTER_SCHEMAS.get(type(conv).__name__, {"type": "string"})}
                      for name, conv in route.param_convertors.items()]
        parameters += [{"name": q.name, "in": "query", "required": False, "schema": q.schema,
                        "description": q.description} for q in op.query]
        responses: dict[str, Any] = {"200": {"description": op.summary,
                                             "content": {t: {"schema": s} for t, s in op.ok.items()}}}
        for status, why in sorted(op.statuses.items()):
            responses[str(status)] = {**_ERROR_RESPONSE, "description": why}
        if secured and not op.open:
            responses["401"] = {**_ERROR_RESPONSE, "description": "missing or invalid API key"}
        # Anything the server refuses or fails on, beyond the statuses named above, is still in this shape.
        responses["4XX"] = _ERROR_RESPONSE
        responses["5XX"] = _ERROR_RESPONSE
        operation: dict[str, Any] = {"summary": op.summary, "operationId": f"{route.method.lower()}_{route.name}",
                                     "responses": responses}
        if parameters:
            operation["parameters"] = parameters
        if op.body is not None:
            operation["requestBody"] = {"required": op.body_required,
                                        "content": {"application/json": {"schema": op.body}}}
        if secured:
            operation["security"] = [] if op.open else [{"bearer": []}]
        paths.setdefault(route.path_format, {})[route.method.lower()] = operation
    doc: Schema = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": {"Error": ERROR_SCHEMA}},
    }
    if secured:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc
