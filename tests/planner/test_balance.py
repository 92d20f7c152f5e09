"""Balanced max flows (planner/balance.py): the same value, every usable node carrying some of it."""

from __future__ import annotations

from importlib.resources import files

import networkx as nx
import pytest

from hetnode.planner.balance import balance
from hetnode.planner.cluster import load_cluster
from hetnode.planner.flowgraph import evaluate
from hetnode.planner.model import model_spec
from hetnode.planner.placement import PlannerOptions, plan_placement
from hetnode.planner.plan import SINK, SOURCE
from hetnode.planner.profile_sources import helix_profile_table
from hetnode.planner.validate import validate_plan


def node(g: nx.DiGraph, name: str, cap: float) -> None:
    g.add_edge(f"{name}:in", f"{name}:out", capacity=cap)


def test_two_parallel_nodes_before_a_bottleneck_share_it_in_proportion() -> None:
    # source -> a (cap 10) and b (cap 30) -> c (cap 20) -> sink: the max flow is 20; Edmonds-Karp may send
    # it all through one of a, b. Balanced, the least utilization is as high as it can be: 20 / 40 each.
    g = nx.DiGraph()
    for name, cap in (("a", 10.0), ("b", 30.0), ("c", 20.0)):
        node(g, name, cap)
    g.add_edge(SOURCE, "a:in")
    g.add_edge(SOURCE, "b:in")
    g.add_edge("a:out", "c:in", capacity=100.0)
    g.add_edge("b:out", "c:in", capacity=100.0)
    g.add_edge("c:out", SINK)
    flows = balance(g, 20.0)
    assert flows is not None
    assert flows[("a:in", "a:out")] == pytest.approx(5.0, rel=1e-6)
    assert flows[("b:in", "b:out")] == pytest.approx(15.0, rel=1e-6)
    assert flows[("c:in", "c:out")] == pytest.approx(20.0, rel=1e-6)
    assert balance(g, 20.0) == flows  # deterministic


def test_a_node_on_no_path_does_not_hold_the_others_back() -> None:
    g = nx.DiGraph()
    node(g, "a", 10.0)
    node(g, "stray", 10.0)  # holds layers nothing connects to
    g.add_edge(SOURCE, "a:in")
    g.add_edge("a:out", SINK)
    flows = balance(g, 10.0)
    assert flows is not None and flows[("a:in", "a:out")] == pytest.approx(10.0)
    assert flows[("stray:in", "stray:out")] == pytest.approx(0.0, abs=1e-9)
    assert balance(g, 0.0) is None


def test_the_idle_t4s_of_helix_single_carry_flow_once_balanced() -> None:
    cluster = load_cluster(str(files("hetnode.testnet") / "clusters" / "helix-single.toml"))
    model = model_spec("llama-70b")
    table = helix_profile_table(model)
    ek = plan_placement(cluster, model, table, method="petals", options=PlannerOptions(balance_flows=False))
    spread = plan_placement(cluster, model, table, method="petals")
    assert spread.ranges() == ek.ranges() and spread.max_flow == ek.max_flow

    def through(flows: dict[tuple[str, str], float]) -> dict[str, float]:
        out: dict[str, float] = {}
        for (_, b), f in flows.items():
            out[b] = out.get(b, 0.0) + f
        return out

    idle_before = [n for n in ek.ranges() if through(dict(ek.flows)).get(n, 0.0) <= 0]
    assert idle_before  # what the balancing is for: Edmonds-Karp leaves some parallel T4s idle
    after = through(dict(spread.flows))
    assert all(after.get(n, 0.0) > 1.0 for n in spread.ranges())
    assert validate_plan(spread, cluster, model, table) == []
    same = evaluate(cluster, model, table, spread.ranges(), balanced=True)
    assert same.value == pytest.approx(spread.max_flow) and dict(same.flows) == dict(spread.flows)
