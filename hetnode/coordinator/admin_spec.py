"""OpenAPI descriptions of the coordinator's own routes (health, cluster view, plan), for `api.build_app`."""

from __future__ import annotations

from hetnode.coordinator.deployment import METHODS
from hetnode.coordinator.openapi import Operation, QueryParam, Schema

# POST /v1/plan's reason, at most this long.
MAX_REASON_CHARS = 200
# GET /v1/cluster waits at most this long for the view to match (a long-poll; the client may ask less).
MAX_CLUSTER_WAIT_S = 60.0

_OBJECT: Schema = {"type": "object"}

HEALTHZ = Operation(
    summary="liveness: the coordinator's peer id and how many nodes are up",
    ok={"application/json": {"type": "object", "required": ["status", "peer_id", "up_nodes"], "properties": {
        "status": {"const": "ok"}, "peer_id": {"type": "string"}, "up_nodes": {"type": "integer", "minimum": 0}}}},
    open=True,
)

OPENAPI = Operation(summary="this document", ok={"application/json": _OBJECT})


def cluster(max_wait_s: float) -> Operation:
    count: Schema = {"type": "integer"}
    return Operation(
        summary="the members, their profiles and load, and the measured links; optionally waits until they match",
        ok={"application/json": {"type": "object", "required": ["nodes", "links", "coordinator", "satisfied"],
                                 "properties": {"nodes": {"type": "array", "items": _OBJECT},
                                                "links": {"type": "array", "items": _OBJECT},
                                                "coordinator": _OBJECT, "satisfied": {"type": "boolean"}}}},
        query=[
            QueryParam("min_up", count, "wait until at least this many nodes are up"),
            QueryParam("max_up", count, "wait until at most this many nodes are up"),
            QueryParam("min_links", count, "wait until at least this many links are measured"),
            QueryParam("timeout", {"type": "number", "minimum": 0, "maximum": max_wait_s},
                       "seconds to wait at most (default 10, or the maximum where lower)"),
        ],
        statuses={400: "a query parameter is not a number, or the timeout is out of range"},
    )


_PLAN: Schema = {"type": "object", "required": ["model", "num_layers", "plan", "problem", "history"], "properties": {
    "model": {"type": "string"}, "num_layers": {"type": "integer"}, "plan": {"type": ["object", "null"]},
    "problem": {"type": ["string", "null"]}, "history": {"type": "array"}}}

def plan(max_wait_s: float) -> Operation:
    count: Schema = {"type": "integer"}
    return Operation(
        summary="the current placement plan, its history and the latest KV hand-offs; optionally waits until the "
                "newest plan matches",
        ok={"application/json": {**_PLAN, "required": [*_PLAN["required"], "satisfied"], "properties": {
            **_PLAN["properties"], "satisfied": {"type": "boolean"}}}},
        query=[
            QueryParam("ready", {"type": "boolean"}, "wait until the newest plan is (true) or is not (false) ready"),
            QueryParam("min_nodes", count, "wait until the newest plan places at least this many nodes"),
            QueryParam("min_version", count, "wait until the newest plan's version is at least this"),
            QueryParam("kv_reported", {"type": "boolean"},
                       "wait until every node of the newest plan has (true) or has not (false) reported its real KV "
                       "pool, which the scheduler then counts instead of the planner's estimate"),
            QueryParam("timeout", {"type": "number", "minimum": 0, "maximum": max_wait_s},
                       "seconds to wait at most (default 10, or the maximum where lower)"),
        ],
        statuses={400: "a query parameter is malformed or unknown, or the timeout is out of range",
                  404: "this coordinator serves no model"},
    )

REPLAN = Operation(
    summary="re-plan now, optionally with another placement method",
    ok={"application/json": _PLAN},
    body={"type": "object", "additionalProperties": False, "properties": {
        "method": {"enum": [*METHODS, None]},  # null: the current method
        "reason": {"type": "string", "maxLength": MAX_REASON_CHARS}}},
    body_required=False,
    statuses={400: "the body is not JSON, or not an object of 'method' and 'reason'",
              404: "this coordinator serves no model", 409: "no plan can be made (the reason says why)"},
)
