"""Request traces: what the coordinator remembers of each request for `GET /v1/requests/{id}`.

A trace is keyed by the request id the REST API gives each request (`X-Request-Id`, or the client's own). It
records the request's sessions in order (a moved request has several), each with its route (phases, hops, layers,
the codec of every KV hand-off link), when it got its route, its first token and its end, the moves between them
and why, and, as the hops' heartbeats bring them (HopReport), each hop's steps, step time, waits and KV bytes.

Times are seconds since the request arrived, on the coordinator's clock; a hop's own numbers are durations on
its clock. The store is bounded (`capacity` requests, the oldest forgotten first), so a busy coordinator's memory
does not grow with its uptime.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

from hetnode.protocol.messages import HopReport, Route

Status = Literal["running", "completed", "failed", "cancelled"]
MAX_SESSIONS_PER_TRACE = 16  # moves are bounded by the lifecycle policy; this bounds a trace whatever happens


@dataclass
class SessionTrace:
    session: str
    started_s: float  # when its route was installed
    route: dict[str, Any]
    first_token_s: float | None = None
    handed_over_s: float | None = None  # when every hop of its earlier phases had handed its KV on
    ended_s: float | None = None
    end: str = ""  # "finished", "moved", or why it failed
    hops: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"session": self.session, "started_s": self.started_s, "first_token_s": self.first_token_s,
                "handed_over_s": self.handed_over_s,
                "ended_s": self.ended_s, "end": self.end, "route": self.route, "hops": self.hops}


@dataclass
class RequestTrace:
    id: str
    created_at: float  # unix time
    start: float  # trio time at arrival
    prompt_tokens: int
    max_tokens: int
    status: Status = "running"
    error: str = ""
    routed_s: float | None = None  # when its first route was found (the wait before it is the queue phase)
    first_token_s: float | None = None
    finished_s: float | None = None
    completion_tokens: int = 0
    sessions: list[SessionTrace] = field(default_factory=list)
    moves: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        end = self.finished_s
        phases = {
            "queue_s": self.routed_s,
            "prefill_s": None if self.first_token_s is None or self.routed_s is None
            else self.first_token_s - self.routed_s,
            "decode_s": None if end is None or self.first_token_s is None else end - self.first_token_s,
        }
        return {"id": self.id, "object": "request.trace", "created": self.created_at, "status": self.status,
                "error": self.error or None, "prompt_tokens": self.prompt_tokens, "max_tokens": self.max_tokens,
                "completion_tokens": self.completion_tokens, "time_to_first_token_s": self.first_token_s,
                "duration_s": end, "phases": phases, "sessions": [s.to_json() for s in self.sessions],
                "moves": self.moves}


def route_json(route: Route, names: dict[str, str]) -> dict[str, Any]:
    """A route as a trace shows it: phases of hops by node name and peer id, layers, tokens and codecs."""
    return {"phases": [{
        "kind": p.kind,
        "tokens": [p.first_token, p.last_token],
        "hops": [{"node": names.get(h.peer, h.peer), "peer": h.peer, "layers": [h.first_layer, h.last_layer]}
                 for h in p.hops],
        "kv_links": [{"from": names.get(k.src, k.src), "to": names.get(k.dst, k.dst), "codec": k.codec}
                     for k in p.kv_links],
    } for p in route.phases]}


class TraceStore:
    def __init__(self, capacity: int = 1024) -> None:
        if capacity < 1:
            raise ValueError("the trace history must hold at least one request")
        self.capacity = capacity
        self._traces: OrderedDict[str, RequestTrace] = OrderedDict()
        self._sessions: dict[str, tuple[RequestTrace, SessionTrace]] = {}

    def __len__(self) -> int:
        return len(self._traces)

    def get(self, trace_id: str) -> RequestTrace | None:
        return self._traces.get(trace_id)

    def open(self, trace_id: str, prompt_tokens: int, max_tokens: int, now: float) -> RequestTrace:
        """A new request's trace; a client that reuses an id replaces the older request's trace."""
        self._forget(trace_id)
        trace = RequestTrace(trace_id, time.time(), now, prompt_tokens, max_tokens)
        self._traces[trace_id] = trace
        while len(self._traces) > self.capacity:
            self._forget(next(iter(self._traces)))
        return trace

    def _forget(self, trace_id: str) -> None:
        old = self._traces.pop(trace_id, None)
        if old is not None:
            for s in old.sessions:
                self._sessions.pop(s.session, None)

    def session(self, trace: RequestTrace, session: str, route: dict[str, Any], now: float) -> None:
        """The request runs on `session` along `route` from now on."""
        if trace.routed_s is None:
            trace.routed_s = now - trace.start
        if len(trace.sessions) >= MAX_SESSIONS_PER_TRACE or self._traces.get(trace.id) is not trace:
            return
        entry = SessionTrace(session, now - trace.start, route)
        trace.sessions.append(entry)
        self._sessions[session] = (trace, entry)

    def session_ended(self, session: str, end: str, now: float) -> None:
        found = self._sessions.get(session)
        if found is not None and found[1].ended_s is None:
            found[1].ended_s, found[1].end = now - found[0].start, end

    def first_token(self, trace: RequestTrace, session: str, now: float) -> None:
        if trace.first_token_s is None:
            trace.first_token_s = now - trace.start
        found = self._sessions.get(session)
        if found is not None and found[1].first_token_s is None:
            found[1].first_token_s = now - trace.start

    def handed_over(self, session: str, now: float) -> None:
        found = self._sessions.get(session)
        if found is not None and found[1].handed_over_s is None:
            found[1].handed_over_s = now - found[0].start

    def moved(self, trace: RequestTrace, kind: str, reason: str, old: str, new: str, recomputed: int,
              now: float) -> None:
        if len(trace.moves) < MAX_SESSIONS_PER_TRACE:
            trace.moves.append({"at_s": now - trace.start, "kind": kind, "reason": reason, "from_session": old,
                                "to_session": new, "recomputed_tokens": recomputed})

    def finished(self, trace: RequestTrace, status: Status, completion_tokens: int, error: str, now: float) -> None:
        trace.status, trace.completion_tokens, trace.error = status, completion_tokens, error
        trace.finished_s = now - trace.start

    def hop_report(self, report: HopReport, peer: str, names: dict[str, str]) -> bool:
        """Attach a hop's report to its session's trace; False when the request is not remembered (any more), or
        `peer` is not the hop of the session's route that the report says it is, or that hop reported already."""
        found = self._sessions.get(report.session)
        if found is None:
            return False
        phases = found[1].route["phases"]
        if (report.phase >= len(phases) or report.hop >= len(phases[report.phase]["hops"])
                or phases[report.phase]["hops"][report.hop]["peer"] != peer):
            return False
        hops = found[1].hops
        if any((h["phase"], h["hop"]) == (report.phase, report.hop) for h in hops):
            return False
        hops.append({
            "node": names.get(peer, peer), "phase": report.phase, "hop": report.hop, "steps": report.steps,
            "tokens": report.tokens,
            "step_s": report.step_s, "wait_s": report.wait_s, "active_s": report.active_s,
            "kv_wait_s": report.kv_wait_s, "kv_received_bytes": report.kv_received_bytes,
            "kv_sent": [{"to": names.get(k.dst, k.dst), "codec": k.codec, "bytes": k.bytes, "frames": k.frames}
                        for k in report.kv_sent],
            "end": report.end,
        })
        hops.sort(key=lambda h: (h["phase"], h["hop"]))
        return True
