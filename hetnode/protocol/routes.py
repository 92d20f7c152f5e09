"""What a route means, as pure functions over the wire types: where a peer stands in it, and whether it is whole.

A route is a list of phases, each a pipeline of hops (`protocol/messages.py`). Every hop of a session checks its
Install against these rules before it accepts anything for the session, and the coordinator builds routes that
pass them, so the two cannot disagree on who may send what.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hetnode.protocol.messages import Hop, Phase, Route


def pipeline_route(hops: Sequence[Hop]) -> Route:
    """Helix's route: one mixed phase that prefills and decodes on the same pipeline."""
    return Route(phases=[Phase(kind="mixed", hops=list(hops))])


@dataclass(frozen=True, slots=True)
class Place:
    """Where one peer stands in a route: phase `phase`, hop `hop` of that phase's pipeline."""

    phase: int
    hop: int


def places_of(route: Route, peer: str) -> list[Place]:
    return [Place(p, h) for p, phase in enumerate(route.phases) for h, hop in enumerate(phase.hops) if hop.peer == peer]


def route_problem(route: Route, num_layers: int) -> str:
    """Why `route` cannot serve a model of `num_layers` layers ('' when it can): every phase's hops must chain
    through all layers once, in order, with no peer twice in a phase; every phase but the last prefills (a
    token range, the last of them to the end of the context when a decode phase follows) and hands its KV on;
    the last phase decodes; hand-off codecs name links between hops of consecutive phases that share layers."""
    phases = route.phases
    for p, phase in enumerate(phases):
        layer = 0
        seen: set[str] = set()
        for hop in phase.hops:
            if hop.peer in seen:
                return f"phase {p} visits {hop.peer} twice"
            seen.add(hop.peer)
            if hop.first_layer != layer or hop.last_layer <= hop.first_layer:
                return (f"phase {p}: hop {hop.peer} runs layers [{hop.first_layer}, {hop.last_layer}), "
                        f"expected to start at {layer}")
            layer = hop.last_layer
        if layer != num_layers:
            return f"phase {p} covers layers [0, {layer}) of {num_layers}"
        if phase.last_token is not None and phase.last_token <= phase.first_token:
            return f"phase {p} has an empty token range [{phase.first_token}, {phase.last_token})"
        before = phases[p - 1].last_token if p > 0 else 0
        if before is not None and phase.first_token != before:
            return f"phase {p} starts at token {phase.first_token}, not where the phase before it ends ({before})"
    for p, phase in enumerate(phases[:-1]):
        if phase.kind != "prefill":
            return f"phase {p} is {phase.kind}: only the last phase decodes, every earlier one prefills"
    if len(phases) > 1 and phases[-1].kind == "prefill":
        return "the last phase prefills: nothing decodes"
    if len(phases) > 1 and phases[-1].kind == "decode" and phases[-2].last_token is not None:
        return "a decode phase follows a partial prefill: the rest of the context has nowhere to run"
    if len(phases) == 1 and phases[0].kind != "mixed":
        return f"a route of one phase prefills and decodes (mixed), not {phases[0].kind}"
    for p, phase in enumerate(phases):
        if phase.kv_links and p == len(phases) - 1:
            return f"phase {p} hands no KV on, but names codecs for it"
        for link in phase.kv_links:
            src = [h for h in phase.hops if h.peer == link.src]
            dst = [h for h in phases[p + 1].hops if h.peer == link.dst] if p + 1 < len(phases) else []
            if not src or not dst or not _overlap(src[0], dst[0]):
                return f"phase {p}: no hand-off from {link.src} to {link.dst} to name a codec for"
    return ""


def queues_kv(route: Route) -> bool:
    """Whether a session on `route` may keep its KV on the prefill hops until its decode side has room
    (Install.kv_queued, ThunderServe's KV queues): a prefill of the whole context, then a decode phase. A partial
    prefill (Cronus) or a move that adopts KV hands over as it goes."""
    phases = route.phases
    return (len(phases) == 2 and phases[0].kind == "prefill" and phases[0].last_token is None
            and phases[1].kind == "decode")


def _overlap(a: Hop, b: Hop) -> tuple[int, int] | None:
    lo, hi = max(a.first_layer, b.first_layer), min(a.last_layer, b.last_layer)
    return (lo, hi) if lo < hi else None


def phase_span(route: Route, p: int, prefill_end: int) -> tuple[int, int | None]:
    """Positions phase `p` runs, [start, end): a prefill phase ends at its last_token (or the context's end);
    the last phase decodes, so it has no end. A later phase starts where the one before it ended."""
    start = 0
    for i, phase in enumerate(route.phases):
        end = None if i == len(route.phases) - 1 else min(phase.last_token or prefill_end, prefill_end)
        if i == p:
            return start, end
        assert end is not None
        start = end
    raise IndexError(f"the route has no phase {p}")


@dataclass(frozen=True, slots=True)
class KVPeer:
    """A hop on the other side of a hand-off, and the layers [first_layer, last_layer) that go between."""

    peer: str
    first_layer: int
    last_layer: int
    codec: str


def kv_sources(route: Route, p: int, hop: Hop) -> list[KVPeer]:
    """Who sends `hop` (of phase `p`) its layers' KV: the hops of the phase before that share layers with it."""
    if p == 0:
        return []
    prev = route.phases[p - 1]
    return [KVPeer(h.peer, *span, _codec(prev, h.peer, hop.peer)) for h in prev.hops
            if (span := _overlap(h, hop)) is not None]


def kv_targets(route: Route, p: int, hop: Hop) -> list[KVPeer]:
    """Whom `hop` (of phase `p`) sends its layers' KV: the hops of the next phase that share layers with it."""
    if p + 1 >= len(route.phases):
        return []
    phase = route.phases[p]
    return [KVPeer(h.peer, *span, _codec(phase, hop.peer, h.peer)) for h in route.phases[p + 1].hops
            if (span := _overlap(hop, h)) is not None]


def _codec(phase: Phase, src: str, dst: str) -> str:
    return next((link.codec for link in phase.kv_links if (link.src, link.dst) == (src, dst)), "fp16")


def route_peers(route: Route) -> set[str]:
    return {hop.peer for phase in route.phases for hop in phase.hops}


def describe(route: Route, name: dict[str, str] | None = None) -> str:
    """`a [0,10) -> b [10,30)` per phase, phases joined by ' | '."""
    def one(hop: Hop) -> str:
        return f"{(name or {}).get(hop.peer, hop.peer)} [{hop.first_layer},{hop.last_layer})"

    return " | ".join(f"{phase.kind}: " + " -> ".join(one(h) for h in phase.hops) for phase in route.phases)
