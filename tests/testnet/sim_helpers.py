"""Small clusters, models and profiles whose simulated timings a test can work out by hand."""

from __future__ import annotations

from typing import Any

import pytest

from hetnode.planner.cluster import ClusterSpec, parse_cluster
from hetnode.planner.model import ModelSpec
from hetnode.planner.plan import SINK, SOURCE, NodePlacement, PlacementPlan
from hetnode.planner.profile import DeviceProfile, ProfileTable
from hetnode.testnet.sim import runner
from hetnode.testnet.sim.node import SimNode

# 4 layers; an activation is 64 x 2 = 128 bytes per token; KV 2 x 4 x 16 x 2 = 256 bytes per token and layer.
TOY = ModelSpec("toy", num_layers=4, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=4,
                vocab_size=100)

# Seconds per layer: prompts 1 ms per 100 tokens above a 2 ms floor; decode 10 ms at batch 1, 20 ms at 100.
PROFILE = DeviceProfile(name="a100", memory_bytes=1 << 30, max_layers=4,
                        prompt_curve=((1.0, 0.002), (1000.0, 0.012)), decode_curve=((1.0, 0.010), (100.0, 0.020)),
                        decode_context_s=1e-6, throughput=(1000.0, 500.0, 333.0, 250.0))
PROFILES = ProfileTable(model="toy", profiles={"a100": PROFILE}, source="test")


def two_node_cluster(*, coord_bw_mbps: float = 8.0, coord_ms: float = 5.0, mid_bw_mbps: float = 80.0,
                     mid_ms: float = 20.0) -> ClusterSpec:
    """a and b in one region; coordinator<->a, a<->b and b<->coordinator links as given."""
    return parse_cluster({
        "name": "two", "coordinator": {"region": "r"},
        "nodes": [{"name": "a", "device": "a100", "region": "r"}, {"name": "b", "device": "a100", "region": "r"}],
        "links": {"pairs": [
            {"a": "coordinator", "b": "a", "bandwidth_mbps": coord_bw_mbps, "latency_ms": coord_ms},
            {"a": "a", "b": "b", "bandwidth_mbps": mid_bw_mbps, "latency_ms": mid_ms},
            {"a": "b", "b": "coordinator", "bandwidth_mbps": coord_bw_mbps, "latency_ms": coord_ms},
        ]},
    }, "test")


def two_node_plan(split: int = 2) -> PlacementPlan:
    return PlacementPlan(cluster="two", model="toy", num_layers=4, method="given",
                         placements=(NodePlacement("a", 0, split), NodePlacement("b", split, 4)),
                         flows={(SOURCE, "a"): 100.0, ("a", "b"): 100.0, ("b", SINK): 100.0}, max_flow=100.0)


class Item:
    """A stand-in for SimRequest in node-level tests: the fields a node reads."""

    __slots__ = ("kv_since", "kv_wait", "num_tokens", "nxt", "origin", "pf", "prefill_end", "seg", "session",
                 "start")

    def __init__(self, session: str, num_tokens: int, *, pf: bool, start: int = 0, prefill_end: int = 0,
                 seg: dict[int, int] | None = None) -> None:
        self.session = session
        self.num_tokens = num_tokens
        self.pf = pf
        self.start = start
        self.prefill_end = prefill_end or start + num_tokens
        self.kv_since = -1.0
        self.kv_wait = 0.0
        self.seg = seg or {}
        self.nxt: dict[int, int] = {}
        self.origin = self

    def piece(self, k: int) -> Item:
        clone = Item(self.session, k, pf=self.pf, start=self.start, prefill_end=self.prefill_end, seg=self.seg)
        clone.origin = self.origin
        self.start += k
        self.num_tokens -= k
        return clone

    def __repr__(self) -> str:
        return f"Item({self.session}, {self.start}+{self.num_tokens})"


def sessions(batch: Any) -> list[str]:
    return [item.session for item in batch]


def keep_nodes(monkeypatch: pytest.MonkeyPatch) -> list[SimNode]:
    """The simulator's nodes of the runs that follow, kept for inspection after the run (their ledgers)."""
    nodes: list[SimNode] = []

    class Kept(SimNode):
        __slots__ = ()

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            nodes.append(self)

    monkeypatch.setattr(runner, "SimNode", Kept)
    return nodes
