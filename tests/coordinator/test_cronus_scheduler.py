"""Cronus's routing: at most two requests at a pair's PPI, the split from the CPI's state at dispatch, the route
[prefill [0, k) on the PPI] -> [mixed from k on the CPI], the CPI alone when the PPI is down; and the mirror test:
the simulator's Cronus design and a scheduler built as the coordinator builds it decide the same."""

from __future__ import annotations

from typing import Any

import pytest

from hetnode.coordinator.cronus_scheduler import CronusScheduler
from hetnode.coordinator.scheduler import Decision
from hetnode.errors import ConfigError
from hetnode.planner.cronus_fit import fit_chunked_iteration, fit_partial_prefill
from hetnode.planner.cronus_plan import cronus_placement
from hetnode.planner.devices import parse_device
from hetnode.planner.model import model_spec
from hetnode.planner.plan import PlacementPlan
from hetnode.policy.cronus import ChunkedIteration, CpiState, CronusBalancer, LinearPrefill, WholePrompt
from hetnode.protocol.routes import route_problem
from hetnode.testnet.sim.pair_designs import Loop, PairSetup, build
from hetnode.testnet.sim.pair_engine import PairRequest

BALANCER = CronusBalancer(LinearPrefill(k=2e-4, b=0.01), ChunkedIteration(k_ctxp=2e-6, k_ctxd=1e-7, b=0.03))
MODEL = model_spec("llama3-8b")
A100, A10 = parse_device("a100-80g"), parse_device("a10")


def plan(nodes: dict[str, str]) -> Any:
    devices = {n: parse_device(d) for n, d in nodes.items()}
    return cronus_placement("test", MODEL, {n: d.fp16_tflops for n, d in devices.items()},
                            {n: d.memory_bytes for n, d in devices.items()})


def state(decodes: int = 0, free: int = 10_000) -> CpiState:
    return CpiState(decodes=decodes, decode_context=decodes * 1000, free_blocks=free, block_size=16,
                    max_batch_tokens=512)


def scheduler(**kw: Any) -> CronusScheduler:
    return CronusScheduler(plan({"big": "a100-80g", "small": "a10"}), splitters=[BALANCER], **kw)


def test_the_plan_pairs_the_weakest_with_the_strongest() -> None:
    p = plan({"a": "a10", "b": "a100-80g", "c": "a30", "d": "h100", "e": "l4"})
    # FP16 TFLOP/s: a10 125 < a30 165 < l4 242 < a100 312 < h100 1979; the odd one out holds nothing.
    assert [(r.role, r.nodes[0]) for r in p.replicas] == [("ppi", "a"), ("cpi", "d"), ("ppi", "c"), ("cpi", "b")]
    assert all((n.first_layer, n.last_layer) == (0, 32) for n in p.placements) and p.notes == ("not paired: e",)
    with pytest.raises(ConfigError, match="two nodes"):
        cronus_placement("c", model_spec("llama-70b"), {"a": 312.0, "b": 125.0},
                         {"a": A100.memory_bytes, "b": A10.memory_bytes})


def test_two_requests_at_most_at_the_ppi_and_the_rest_queue_in_order() -> None:
    s = scheduler()
    decisions = [s.submit(f"r{i}", 2000, 0.0) for i in range(4)]
    assert [d.assigned for d in decisions] == [True, True, False, False]
    assert decisions[2].queued and "two at most" in decisions[2].reason
    assert [d.request_id for d in s.partial_done("r0", 1.0)] == ["r2"]
    assert [d.request_id for d in s.prefilled("r1", 1.5)] == ["r3"]  # the first token frees it at the latest
    assert s.partial_done("r0", 2.0) == []  # already counted


def test_the_route_is_a_partial_prefill_then_a_mixed_phase_on_the_cpi() -> None:
    d = scheduler().submit("r", 4096, 0.0)
    assert d.split == BALANCER.split(4096, scheduler().cpi_estimate(0)).tokens and 0 < d.split < 4096
    route = d.route
    assert route is not None and route_problem(route, 32) == ""
    prefill, mixed = route.phases
    assert (prefill.kind, prefill.hops[0].peer, prefill.last_token) == ("prefill", "small", d.split)
    assert (mixed.kind, mixed.hops[0].peer, mixed.first_token) == ("mixed", "big", d.split)


def test_the_split_reads_the_cpi_state_at_dispatch() -> None:
    states = iter([state(), state(), state(decodes=64)])
    s = scheduler(cpi_state=lambda node: next(states))
    s.submit("a", 4096, 0.0)
    s.submit("b", 4096, 0.0)
    s.submit("c", 4096, 0.0)  # waits: its split is not decided yet
    (d,) = s.partial_done("a", 1.0)
    assert d.split == BALANCER.split(4096, state(decodes=64)).tokens != BALANCER.split(4096, state()).tokens


def test_whole_prompts_are_a_prefill_then_a_decode_phase() -> None:
    s = CronusScheduler(plan({"big": "a100-80g", "small": "a10"}), splitters=[WholePrompt()])
    route = s.submit("r", 100, 0.0).route
    assert route is not None and [p.kind for p in route.phases] == ["prefill", "decode"]
    assert route.phases[0].last_token is None


def test_a_dead_ppi_leaves_its_requests_to_the_cpi_alone() -> None:
    s = scheduler()
    s.submit("r0", 3000, 0.0)
    s.submit("r1", 3000, 0.0)
    s.prefilled("r1", 0.5)  # r1 decodes on the CPI: the PPI is nothing to it any more
    down = s.node_down("small", 1.0)
    assert down.affected == ("r0",)
    s.cancel("r0", 1.0)
    d = s.submit("r0", 3000, 1.0)  # the coordinator moves it: the CPI prefills it whole, one mixed phase
    assert d.route is not None and [(p.kind, p.hops[0].peer) for p in d.route.phases] == [("mixed", "big")]
    assert s.node_down("big", 2.0).affected == ("r1", "r0")
    assert s.submit("r2", 10, 2.0).reason.startswith("every pair's CPI is down")


def test_the_cpi_kv_room_masks_and_bad_plans_are_refused() -> None:
    s = scheduler(kv_capacity={"big": 10_000}, avg_output_len=100)
    assert s.submit("a", 4500, 0.0).assigned
    assert s.submit("b", 4500, 0.0).queued  # 4500 + 4500 + 2 x 100 > 0.9 x 10,000
    assert s.submit("huge", 20_000, 0.0).too_large
    assert [d.request_id for d in s.finish("a", 100, 1.0)] == ["b"]
    with pytest.raises(ConfigError, match="not a Cronus plan"):
        CronusScheduler(PlacementPlan(cluster="c", model="m", num_layers=32, method="cronus", placements=()),
                        splitters=[])
    with pytest.raises(ConfigError, match="splitters"):
        CronusScheduler(plan({"x": "a100-80g", "y": "a10"}), splitters=[])
    with pytest.raises(ValueError, match="partial prefill"):
        Decision("r", split=3)


class Recorder:
    """The simulator's scheduler, every call and what it returned, in order (states included)."""

    def __init__(self, inner: CronusScheduler) -> None:
        self.inner = inner
        self.calls: list[tuple[str, tuple[Any, ...], list[Decision]]] = []
        self.states: list[CpiState] = []
        wrapped = inner._cpi_state
        assert wrapped is not None

        def seen(node: str) -> CpiState:
            st = wrapped(node)
            self.states.append(st)
            return st

        inner._cpi_state = seen

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)
        if name not in ("submit", "partial_done", "prefilled", "finish"):
            return method

        def call(*args: Any) -> Any:
            out = method(*args)
            self.calls.append((name, args, [out] if isinstance(out, Decision) else list(out)))
            return out

        return call


def test_mirror_the_simulator_and_the_coordinator_decide_the_same() -> None:
    """The simulator's Cronus design drives the scheduler; a scheduler built as the coordinator builds one (its
    plan from `cronus_placement` over the two devices, its balancer fitted on them) is given the same calls and
    the same CPI states, and must return the same decisions: requests, splits, queueing, in the same order."""
    setup = PairSetup(A100, A10, MODEL)
    loop = Loop()
    design = build("cronus", setup, loop, queue_limit=100)
    recorder = Recorder(design.scheduler)  # type: ignore[attr-defined]
    design.scheduler = recorder  # type: ignore[attr-defined]
    for i, (p, o) in enumerate([(1800, 20), (40, 5), (3000, 9), (700, 30), (5, 3), (2500, 12), (1200, 7)]):
        r = PairRequest(f"r{i}", 0.05 * i, p, o)
        loop.at(r.arrival, design.arrive, r)
    loop.run()
    assert recorder.calls and len(recorder.states) == 7
    states = iter(recorder.states)
    runtime_plan = plan({"small": "a10", "big": "a100-80g"})
    balancer = CronusBalancer(fit_partial_prefill(A10, MODEL), fit_chunked_iteration(A100, MODEL, 512))
    runtime = CronusScheduler(runtime_plan, splitters=[balancer], cpi_state=lambda node: next(states),
                              queue_limit=100)
    for name, args, decided in recorder.calls:
        again = getattr(runtime, name)(*args)
        again = [again] if isinstance(again, Decision) else list(again)
        assert [(d.request_id, d.split, d.queued, d.assigned) for d in again] == [
            (d.request_id, d.split, d.queued, d.assigned) for d in decided], (name, args)
    assert any(d.split for _, _, ds in recorder.calls for d in ds)


def test_the_coordinator_routes_a_cronus_plan_by_cronus_with_balancers_fitted_on_the_nodes() -> None:
    from hetnode.coordinator.routing import make_scheduler, scheduler_for
    from hetnode.planner.cronus_plan import cronus_splitters
    from hetnode.protocol.messages import HardwareProfile

    p = plan({"big": "a100-80g", "small": "a10"})
    reported = {name: HardwareProfile(device=d.name, device_type=d.name, memory_bytes=d.memory_bytes,
                                      matmul_tflops=d.fp16_tflops, mem_bandwidth_gbps=d.mem_bandwidth_gbps,
                                      dtype="float16", emulated=True)
                for name, d in (("big", A100), ("small", A10))}
    splitters = cronus_splitters(p, MODEL, reported)
    want = CronusBalancer(fit_partial_prefill(A10, MODEL), fit_chunked_iteration(A100, MODEL, 512))
    (fitted,) = splitters  # fitted on the numbers the nodes report: the data-sheet ones, for emulated GPUs
    assert (fitted.ppi, fitted.cpi) == (want.ppi, want.cpi)
    assert scheduler_for(p, "iwrr") == "cronus"
    s = make_scheduler(scheduler_for(p, "splitwise"), p, splitters=splitters, seed=1, high_water=0.9,
                       queue_limit=8, kv_capacity={"big": 400_000, "small": 50_000})
    assert isinstance(s, CronusScheduler) and s.submit("r", 3000, 0.0).split == want.split(3000, state()).tokens
    with pytest.raises(ConfigError, match="Cronus plan"):
        make_scheduler("iwrr", p)
    with pytest.raises(ConfigError, match="no profile"):
        cronus_splitters(p, MODEL, {"big": reported["big"]})
