"""The baseline policies of Helix §6.7 (random, shortest-queue, SWARM) and the policy factory.

What all policies share (valid pipelines, KV mask, queue, node_down, seeds) is tested against each of them in
test_scheduler.py; this file checks what makes each baseline itself.
"""

from __future__ import annotations

from collections import Counter

import pytest

from hetnode.coordinator.routing import (
    RandomScheduler,
    ShortestQueueScheduler,
    SwarmScheduler,
    make_scheduler,
    scheduler_names,
)
from hetnode.coordinator.scheduler import Decision, IwrrScheduler
from hetnode.errors import ConfigError
from hetnode.planner.plan import SINK, SOURCE, NodePlacement, PlacementPlan


def replicas(flows: dict[str, float]) -> PlacementPlan:
    """Full replicas a, b, c... each SOURCE -> node -> SINK with the given flows (0: valid but unused)."""
    edges: dict[tuple[str, str], float] = {}
    for node, f in flows.items():
        edges[(SOURCE, node)] = f
        edges[(node, SINK)] = f
    return PlacementPlan("t", "m", 4, "given", tuple(NodePlacement(n, 0, 4) for n in flows), flows=edges)


def first(decision: Decision) -> str:
    assert decision.pipeline is not None, decision
    return decision.pipeline[0].node


def draw(sched: RandomScheduler | ShortestQueueScheduler | SwarmScheduler, n: int) -> Counter[str]:
    counts: Counter[str] = Counter()
    for _ in range(n):
        counts[first(sched.submit("r", 10, now=0.0))] += 1
        sched.finish("r", 10, now=0.0)
    return counts


def test_make_scheduler_by_name() -> None:
    plan = replicas({"a": 1.0})
    assert scheduler_names() == ["iwrr", "random", "shortest-queue", "swarm"]
    assert type(make_scheduler("iwrr", plan)) is IwrrScheduler
    assert type(make_scheduler("random", plan)) is RandomScheduler
    assert type(make_scheduler(" Shortest-Queue ", plan, queue_len=lambda n: 0.0)) is ShortestQueueScheduler
    assert type(make_scheduler("swarm", plan, throughput=lambda n: 1.0, queue_limit=3)) is SwarmScheduler
    with pytest.raises(ConfigError, match=r"'helixx'; choose one of: iwrr, random, shortest-queue, swarm"):
        make_scheduler("helixx", plan)
    with pytest.raises(TypeError):
        make_scheduler("iwrr", plan, throughput=lambda n: 1.0)


def test_random_is_uniform_over_every_valid_connection() -> None:
    plan = replicas({"a": 10.0, "b": 1.0, "c": 0.0})  # c carries no flow but is a valid connection
    counts = draw(RandomScheduler(plan, seed=5), 6000)
    assert set(counts) == {"a", "b", "c"}
    for node in "abc":
        assert counts[node] / 6000 == pytest.approx(1 / 3, abs=0.03)
    counts = draw(RandomScheduler(plan, seed=5, edges="flows"), 600)
    assert set(counts) == {"a", "b"}


def test_random_depends_on_the_seed() -> None:
    plan = replicas({"a": 1.0, "b": 1.0, "c": 1.0})
    seqs = []
    for seed in (1, 1, 2):
        sched = RandomScheduler(plan, seed=seed)
        seqs.append([first(sched.submit(f"r{i}", 1, now=0.0)) for i in range(30)])
    assert seqs[0] == seqs[1] != seqs[2]


def test_shortest_queue_picks_the_shorter_queue() -> None:
    queues = {"a": 5.0, "b": 2.0, "c": 9.0}
    sched = ShortestQueueScheduler(replicas({"a": 1.0, "b": 1.0, "c": 1.0}), queue_len=queues.__getitem__)
    assert first(sched.submit("r0", 1, now=0.0)) == "b"
    queues["b"] = 7.0
    assert first(sched.submit("r1", 1, now=0.0)) == "a"
    queues["a"] = 7.0
    ties = Counter(first(sched.submit(f"t{i}", 1, now=0.0)) for i in range(200))
    assert set(ties) == {"a", "b"}  # ties broken at random, never the longer queue


def test_shortest_queue_without_a_probe_counts_its_own_running_requests() -> None:
    sched = ShortestQueueScheduler(replicas({"a": 1.0, "b": 1.0, "c": 1.0}))
    got = [first(sched.submit(f"r{i}", 1, now=0.0)) for i in range(9)]
    assert Counter(got) == {"a": 3, "b": 3, "c": 3}
    for i, node in enumerate(got):
        if node == "b":
            sched.finish(f"r{i}", 1, now=1.0)
    assert [first(sched.submit(f"x{i}", 1, now=1.0)) for i in range(3)] == ["b", "b", "b"]


def test_shortest_queue_still_respects_the_kv_mask() -> None:
    sched = ShortestQueueScheduler(replicas({"a": 1.0, "b": 1.0}), queue_len={"a": 0.0, "b": 100.0}.__getitem__,
                                   kv_capacity={"a": 10}, high_water=1.0, avg_output_len=0)
    assert first(sched.submit("r0", 10, now=0.0)) == "a"
    assert first(sched.submit("r1", 10, now=0.0)) == "b"  # a is full, however short its queue


def test_swarm_draws_in_proportion_to_measured_throughput() -> None:
    rates = {"a": 600.0, "b": 300.0, "c": 100.0}
    counts = draw(SwarmScheduler(replicas({"a": 1.0, "b": 1.0, "c": 1.0}), throughput=rates.__getitem__, seed=2),
                  20_000)
    for node, rate in rates.items():
        assert counts[node] / 20_000 == pytest.approx(rate / 1000, abs=0.015)


def test_swarm_falls_back_to_uniform_and_fills_in_unmeasured_nodes() -> None:
    plan = replicas({"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0})
    counts = draw(SwarmScheduler(plan, throughput=lambda n: 0.0, seed=4), 8000)
    assert all(counts[n] / 8000 == pytest.approx(0.25, abs=0.03) for n in "abcd")
    counts = draw(SwarmScheduler(plan, seed=4), 8000)  # no probe at all
    assert all(counts[n] / 8000 == pytest.approx(0.25, abs=0.03) for n in "abcd")
    # c and d unmeasured (0, nan): they count as the mean of a and b, 200, out of 800.
    rates = {"a": 300.0, "b": 100.0, "c": 0.0, "d": float("nan")}
    counts = draw(SwarmScheduler(plan, throughput=rates.__getitem__, seed=4), 20_000)
    expected = {"a": 300 / 800, "b": 100 / 800, "c": 200 / 800, "d": 200 / 800}
    for node, share in expected.items():
        assert counts[node] / 20_000 == pytest.approx(share, abs=0.015)


def test_swarm_given_link_delays_draws_each_hop_inversely_to_the_delay_from_where_it_is() -> None:
    # Two stages: SOURCE -> {a1, a2} -> {b1, b2}. From a1, b1 is near (10 ms) and b2 far (90 ms); from a2 the other
    # way round. The nodes' rates are equal, so only the links (SWARM's per-peer delays) can tell them apart.
    plan = PlacementPlan("t", "m", 4, "given", tuple(NodePlacement(n, *r) for n, r in (
        ("a1", (0, 2)), ("a2", (0, 2)), ("b1", (2, 4)), ("b2", (2, 4)))), flows={})
    near = {("a1", "b1"), ("a2", "b2")}
    calls: list[tuple[str, str]] = []

    def delay(a: str, b: str) -> float:
        calls.append((a, b))
        return 0.05 if a == SOURCE else (0.01 if (a, b) in near else 0.09)

    sched = SwarmScheduler(plan, throughput=lambda n: 100.0, delay=delay, seed=3)
    pairs: Counter[tuple[str, str]] = Counter()
    for i in range(20_000):
        d = sched.submit(f"r{i}", 10, now=0.0)
        assert d.pipeline is not None
        pairs[(d.pipeline[0].node, d.pipeline[1].node)] += 1
        sched.finish(f"r{i}", 10, now=0.0)
    assert {a for a, _ in calls} == {SOURCE, "a1", "a2"}
    for (a, b), n in pairs.items():  # each first hop half the time, then the near one 9 times in 10
        assert n / 20_000 == pytest.approx(0.5 * (0.9 if (a, b) in near else 0.1), abs=0.015)
    # By the nodes' equal rates alone, the second hop is a coin toss whatever the link.
    plain = SwarmScheduler(plan, throughput=lambda n: 100.0, seed=3)
    decisions = [plain.submit(f"r{i}", 10, now=0.0) for i in range(4000)]
    share = sum(1 for d in decisions if d.pipeline is not None and (d.pipeline[0].node, d.pipeline[1].node) in near)
    assert share / 4000 == pytest.approx(0.5, abs=0.03)


def test_baselines_see_the_whole_placement_not_just_the_flows() -> None:
    # Helix routes everything over a1 -> a2; the cross connection a1 -> b2 is valid but carries no flow.
    plan = PlacementPlan("t", "m", 6, "given", (NodePlacement("a1", 0, 3), NodePlacement("a2", 3, 6),
                                                NodePlacement("b2", 3, 6)),
                         flows={(SOURCE, "a1"): 1.0, ("a1", "a2"): 1.0, ("a2", SINK): 1.0})
    helix = {tuple(s.node for s in make_scheduler("iwrr", plan).submit(f"r{i}", 1, now=0.0).pipeline or ())
             for i in range(20)}
    assert helix == {("a1", "a2")}
    for name in ("random", "shortest-queue", "swarm"):
        sched = make_scheduler(name, plan, seed=9)
        got = {tuple(s.node for s in sched.submit(f"r{i}", 1, now=0.0).pipeline or ()) for i in range(40)}
        assert got == {("a1", "a2"), ("a1", "b2")}, name
        restricted = make_scheduler(name, plan, seed=9, edges="flows")
        got = {tuple(s.node for s in restricted.submit(f"r{i}", 1, now=0.0).pipeline or ()) for i in range(20)}
        assert got == {("a1", "a2")}, name
