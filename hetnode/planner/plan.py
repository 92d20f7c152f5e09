"""A placement plan: which layers each node holds, the flow on every edge, and how the solver got there.

Edges use node names, with SOURCE and SINK for the coordinator's two sides (Helix §4.3): (SOURCE, n) carries
token ids to a node holding layer 0, (n, SINK) carries tokens back from a node holding the last layer, and
(a, b) carries activations from a to b. Flows are tokens per second. Layer ranges are half-open
[first_layer, last_layer); a node that holds nothing is not in `placements`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SOURCE = "source"
SINK = "sink"


@dataclass(frozen=True)
class NodePlacement:
    node: str
    first_layer: int
    last_layer: int  # exclusive

    @property
    def layers(self) -> int:
        return self.last_layer - self.first_layer


@dataclass(frozen=True)
class Replica:
    """A pipeline of a phase-split plan and the phase it serves: its nodes in layer order."""

    role: str  # "prefill" or "decode"; Cronus's pairs: "ppi" (partial prefill) then "cpi" (the rest and decode)
    nodes: tuple[str, ...]
    # Tensor parallel degree: consecutive runs of `tp` nodes share a stage's layers (ThunderServe's groups).
    tp: int = 1


@dataclass(frozen=True)
class Orchestration:
    """How requests move between a phase-split plan's replicas (ThunderServe §3.3): prefill_share[i] (X_i) of
    all requests prefill on the plan's i-th prefill replica, and decode_share[i][j] (Y_ij) of those decode on
    its j-th decode replica (replicas counted in plan order, each role on its own)."""

    prefill_share: tuple[float, ...]
    decode_share: tuple[tuple[float, ...], ...]
    slo_attainment: float = 0.0  # the planner's estimate of the share of requests within their SLOs


@dataclass(frozen=True)
class PlacementPlan:
    cluster: str
    model: str
    num_layers: int
    method: str  # "helix", "petals", "swarm", "sp", "given"
    placements: tuple[NodePlacement, ...]
    flows: Mapping[tuple[str, str], float] = field(default_factory=dict, hash=False)
    max_flow: float = 0.0  # tokens/s, from the max-flow of the placement's graph
    upper_bound: float = math.inf  # the best bound known (the MILP's, or sum of compute / layers)
    status: str = ""  # "optimal", "time_limit", "heuristic", ...
    solve_time_s: float = 0.0
    partial_inference: bool = True
    notes: tuple[str, ...] = ()
    # The node-to-node connections the plan's flow may use; None: every one its placement makes valid.
    # Separate pipelines (sp, sp+) keep each request inside one pipeline, so their max flow is over these.
    connections: tuple[tuple[str, str], ...] | None = None
    # A phase-split plan's replicas (method "split"); empty: every request prefills and decodes on one pipeline.
    replicas: tuple[Replica, ...] = ()
    # Where requests go among the replicas; None: the scheduler decides (split's JSQ).
    orchestration: Orchestration | None = None

    @property
    def gap(self) -> float:
        """Relative distance from the upper bound: 0 is proven optimal."""
        if not math.isfinite(self.upper_bound) or self.upper_bound <= 0:
            return math.inf if self.max_flow <= 0 else 0.0
        return max(0.0, (self.upper_bound - self.max_flow) / self.upper_bound)

    @property
    def size(self) -> str:
        """What the plan offers, in words: its max flow, or for a plan of replicas (phase-split, Cronus, EcoServe),
        which have no max flow, how many replicas of each role."""
        if not self.replicas:
            return f"max flow {self.max_flow:.1f} tokens/s"
        roles: dict[str, int] = {}
        for r in self.replicas:
            roles[r.role] = roles.get(r.role, 0) + 1
        return ", ".join(f"{n} {role}" for role, n in roles.items())

    def ranges(self) -> dict[str, tuple[int, int]]:
        return {p.node: (p.first_layer, p.last_layer) for p in self.placements}

    def to_json(self) -> dict[str, Any]:
        return {
            "cluster": self.cluster, "model": self.model, "num_layers": self.num_layers, "method": self.method,
            "max_flow": self.max_flow, "upper_bound": self.upper_bound if math.isfinite(self.upper_bound) else None,
            "gap": self.gap if math.isfinite(self.gap) else None, "status": self.status,
            "solve_time_s": self.solve_time_s, "partial_inference": self.partial_inference,
            "placements": [{"node": p.node, "first_layer": p.first_layer, "last_layer": p.last_layer}
                           for p in self.placements],
            "flows": [{"from": a, "to": b, "flow": f} for (a, b), f in sorted(self.flows.items()) if f > 0],
            "notes": list(self.notes),
            **({} if self.connections is None else
               {"connections": [{"from": a, "to": b} for a, b in self.connections]}),
            **({"replicas": [{"role": r.role, "nodes": list(r.nodes), **({"tp": r.tp} if r.tp != 1 else {})}
                             for r in self.replicas]}
               if self.replicas else {}),
            **({} if self.orchestration is None else {"orchestration": {
                "prefill_share": list(self.orchestration.prefill_share),
                "decode_share": [list(row) for row in self.orchestration.decode_share],
                "slo_attainment": self.orchestration.slo_attainment}}),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PlacementPlan:
        bound = data.get("upper_bound")
        return cls(
            cluster=data["cluster"], model=data["model"], num_layers=int(data["num_layers"]),
            method=data["method"],
            placements=tuple(NodePlacement(p["node"], int(p["first_layer"]), int(p["last_layer"]))
                             for p in data["placements"]),
            flows={(f["from"], f["to"]): float(f["flow"]) for f in data.get("flows", [])},
            max_flow=float(data.get("max_flow", 0.0)), upper_bound=math.inf if bound is None else float(bound),
            status=data.get("status", ""), solve_time_s=float(data.get("solve_time_s", 0.0)),
            partial_inference=bool(data.get("partial_inference", True)), notes=tuple(data.get("notes", ())),
            connections=None if data.get("connections") is None else
            tuple((c["from"], c["to"]) for c in data["connections"]),
            replicas=tuple(Replica(str(r["role"]), tuple(str(n) for n in r["nodes"]), int(r.get("tp", 1)))
                           for r in data.get("replicas", ())),
            orchestration=None if data.get("orchestration") is None else Orchestration(
                prefill_share=tuple(float(x) for x in data["orchestration"]["prefill_share"]),
                decode_share=tuple(tuple(float(y) for y in row) for row in data["orchestration"]["decode_share"]),
                slo_attainment=float(data["orchestration"].get("slo_attainment", 0.0))),
        )
