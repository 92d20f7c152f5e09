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
    through all layers once, in order, with no peer twice in a phase; token ranges must be ordered."""
    for p, phase in enumerate(route.phases):
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
    return ""


def route_peers(route: Route) -> set[str]:
    return {hop.peer for phase in route.phases for hop in phase.hops}


def describe(route: Route, name: dict[str, str] | None = None) -> str:
    """`a [0,10) -> b [10,30)` per phase, phases joined by ' | '."""
    def one(hop: Hop) -> str:
        return f"{(name or {}).get(hop.peer, hop.peer)} [{hop.first_layer},{hop.last_layer})"

    return " | ".join(f"{phase.kind}: " + " -> ".join(one(h) for h in phase.hops) for phase in route.phases)
