"""EcoServe's mitosis scaling on the coordinator (§3.5): spare instances added on an SLO miss, the last removed
after sustained under-use, a split that moves a running instance to a new macro-instance with its requests;
and the mirror test: the simulator's way of judging a window (`padg.Request.meets`, `attainment`) and the
coordinator's scheduler, fed the same request lifecycles, make the same scaling changes."""

from __future__ import annotations

import math
import random

import pytest

from hetnode.coordinator.ecoserve_scheduler import EcoServeScheduler
from hetnode.planner.devices import parse_device
from hetnode.planner.ecoserve_plan import ecoserve_placement
from hetnode.planner.model import model_spec
from hetnode.policy.ecoserve import InstanceState, Slos
from hetnode.policy.ecoserve_overall import Move, Overall, Scaler, ScalingTrigger, attainment
from hetnode.policy.macro_scheduler import MacroScheduler
from hetnode.policy.prefill_predictor import PrefillPredictor
from hetnode.testnet.sim.padg import Request

MODEL = model_spec("llama3-8b")
A100 = parse_device("a100-80g")
PREFILL = PrefillPredictor.fit([(100, 0.1), (1000, 1.0)])  # 1 ms a token
SLOS = Slos(ttft_s=0.5, tpot_s=0.05)


def scaled(n: int, active: list[str], *, lower: int = 4, upper: int = 16, idle: int = 2) -> EcoServeScheduler:
    p = ecoserve_placement("test", MODEL, {f"n{i:02d}": A100.memory_bytes for i in range(n)}, lower=lower,
                           upper=upper)
    return EcoServeScheduler(p, predictors={r.nodes[0]: PREFILL for r in p.replicas}, slos=SLOS, lower=lower,
                             upper=upper, learn_output=False, avg_output_len=0.0,
                             trigger=ScalingTrigger(0.9, 0.3, idle), active=active, since=0.0)


def test_only_the_active_instances_serve_and_an_slo_miss_adds_the_first_spare() -> None:
    s = scaled(3, ["n00"])
    assert s.macros() == [["n00"]] and s.spare() == ["n01", "n02"]
    assert s.submit("a", 100, 0.0).pipeline[0].node == "n00"  # type: ignore[index]
    # No first token 0.5 s after arrival: a miss before its decode phase, so the window adds an instance.
    change, _ = s.scale(1.0)
    assert change is not None and change.action == "add" and change.instance == "n01"
    assert change.attainment == 0.0 and change.sizes == (2,) and s.spare() == ["n02"]
    s.prefilled("a", 1.0)
    # a's decode on n00 has saved 0.05 s of TPOT, less than b's 0.45 s prefill: Algorithm 1 moves on, to the
    # instance just added.
    assert s.submit("b", 450, 1.0).pipeline[0].node == "n01"  # type: ignore[index]


def test_a_window_whose_requests_met_their_slos_adds_nothing_and_a_queued_request_starts_on_an_added_one() -> None:
    s = scaled(2, ["n00"])
    s.set_capacity("n00", 1000)
    s.set_capacity("n01", 1000)
    s.submit("a", 100, 0.0)
    s.prefilled("a", 0.1)  # its phase's only prompt: decoding from 0.1
    s.finish("a", 11, 0.5)  # 10 tokens in 0.4 s: TPOT 0.04 <= 0.05, TTFT 0.1 <= 0.5
    assert s.scale(1.0) == (None, [])
    s.submit("b", 850, 1.0)  # 850 of 900 under the high-water mark
    queued = s.submit("c", 850, 1.0)
    assert queued.queued
    change, started = s.scale(2.0)  # c waited past its TTFT SLO: a miss
    assert change is not None and change.instance == "n01"
    assert [(d.request_id, d.pipeline[0].node) for d in started] == [("c", "n01")]  # type: ignore[index]


def test_sustained_under_use_removes_the_last_instance_which_finishes_what_it_holds() -> None:
    s = scaled(4, ["n00", "n01", "n02", "n03"])
    # 300-token prompts take 0.3 s each: a second one would break the 0.5 s TTFT, so each goes to the next.
    nodes = [s.submit(key, 300, 0.0).pipeline[0].node for key in "abcd"]  # type: ignore[index]
    assert nodes == ["n00", "n01", "n02", "n03"]
    for key in "abcd":
        s.prefilled(key, 0.05)
    for key in "abc":
        s.finish(key, 2, 0.1)  # TTFT 0.05, TPOT 0.05: met
    # Only n03 busy (d runs on): a quarter used, under 0.3, for two windows in a row.
    assert s.scale(10.0)[0] is None
    change, _ = s.scale(20.0)
    assert change is not None and change.action == "remove" and change.instance == "n03"
    assert change.attainment == 1.0 and change.utilization == pytest.approx(0.25)
    assert s.macros() == [["n00", "n01", "n02"]] and s.spare() == ["n03"]
    assert s.pipeline_of("d") is not None  # d still runs on n03, and ends there
    s.finish("d", 2, 20.1)
    assert {s.submit(f"r{i}", 100, 21.0).pipeline[0].node for i in range(6)} <= {"n00", "n01", "n02"}  # type: ignore[index]
    # Never below one instance.
    s2 = scaled(1, ["n00"], idle=1)
    assert s2.scale(10.0)[0] is None and s2.macros() == [["n00"]]


def test_a_split_moves_a_running_instance_to_the_new_macro_instance_with_its_requests() -> None:
    s = scaled(4, ["n00", "n01", "n02"], lower=2, upper=3)
    assert s.macros() == [["n00", "n01", "n02"]]
    nodes = [s.submit(f"r{i}", 400, 0.0).pipeline[0].node for i in range(3)]  # type: ignore[index]
    assert nodes == ["n00", "n01", "n02"]
    change, _ = s.scale(1.0)  # three prompts past their TTFT SLO without a decode phase
    assert change is not None and change.sizes == (2, 2)
    assert change.moves == (Move("n02", 0, 1),) and s.macros() == [["n00", "n01"], ["n02", "n03"]]
    # The moved instance keeps its request: still prefilling in its state for the new macro-instance, then
    # decoding, and it ends there as it would have.
    assert s.pipeline_of("r2") is not None and s.state("n02", 1.0).decodes == ()
    s.prefilled("r2", 1.1)
    assert [d.first_token_at for d in s.state("n02", 1.1).decodes] == [1.1]
    assert s.finish("r2", 2, 1.2) == [] and s.pipeline_of("r2") is None


def test_a_lost_last_instance_hands_over_to_a_spare_at_once() -> None:
    s = scaled(2, ["n00"])
    s.node_down("n00", 1.0)
    assert s.macros() == [["n01"]] and s.scalings[-1].instance == "n01" and math.isnan(s.scalings[-1].attainment)
    assert s.submit("a", 100, 1.0).pipeline[0].node == "n01"  # type: ignore[index]


def test_the_simulators_window_and_the_coordinators_scheduler_scale_the_same() -> None:
    """Random request lifecycles, one prompt per phase on each instance (so an instance's decode phase starts at
    its request's first token, as the coordinator infers it). Each window the simulator's way judges the requests
    that ended in it and those whose TTFT ran out before their decode phase (`padg.Request.meets`,
    `attainment`), measures each serving instance's busy share from the requests' spans, and scales through its
    own `Scaler`; the coordinator's scheduler sees only submits, first tokens and finishes, in time order."""
    rng = random.Random(7)
    names = [f"n{i:02d}" for i in range(6)]
    coord = scaled(6, ["n00"], lower=1, upper=2, idle=2)
    sim = Scaler(Overall(1, 2, lambda: MacroScheduler(SLOS, PREFILL)), ScalingTrigger(0.9, 0.3, 2), list(names))
    sim.overall.add("n00", InstanceState())
    window = 5.0
    requests: dict[str, Request] = {}
    events: list[tuple[float, int, str]] = []  # (time, 0 arrival / 1 first token / 2 finish, request)
    for w in range(6):
        slow = w in (2, 3, 4)  # a burst of slow first tokens in windows 3-5, then quiet
        for _ in range(rng.randint(2, 4)):
            arrival = w * window + rng.uniform(0.0, window)
            first = arrival + (rng.uniform(0.6, 1.2) if slow else rng.uniform(0.05, 0.3))
            output = rng.randint(2, 20)
            last = first + (output - 1) * rng.uniform(0.01, 0.06)
            key = f"r{len(requests)}"
            requests[key] = Request(len(requests), arrival, 50, output, gen=output, first_token=first,
                                    decode_start=first, last_token=last)
            events += [(arrival, 0, key), (first, 1, key), (last, 2, key)]
    events.sort()
    where: dict[str, str] = {}
    sim_changes, coord_changes = [], []
    for w in range(1, 13):
        start, end = (w - 1) * window, w * window
        while events and events[0][0] <= end:
            at, kind, key = events.pop(0)
            if kind == 0:
                decision = coord.submit(key, 50, at)
                assert decision.assigned
                where[key] = decision.pipeline[0].node  # type: ignore[index]
            elif kind == 1:
                coord.prefilled(key, at)
            else:
                coord.finish(key, requests[key].output, at)
        finished = [r for r in requests.values() if start < r.last_token <= end]
        late = [r for r in requests.values() if r.decode_start > end and start < r.arrival + SLOS.ttft_s <= end]
        serving = [str(i) for m in sim.overall.macros for i in m.ids]
        use = sum(busy_share(requests, where, n, start, end) for n in serving) / len(serving)
        verdict = attainment([r.meets(SLOS) for r in finished], len(late))
        change = sim.window(end, verdict, use, lambda _: InstanceState())
        sim_changes.append(None if change is None else (change.action, change.instance, change.sizes))
        got, _ = coord.scale(end)
        coord_changes.append(None if got is None else (got.action, got.instance, got.sizes))
        if got is not None:
            assert (got.attainment, got.utilization) == pytest.approx((verdict, use))
    assert sim_changes == coord_changes
    assert any(c and c[0] == "add" for c in sim_changes) and any(c and c[0] == "remove" for c in sim_changes)


def busy_share(requests: dict[str, Request], where: dict[str, str], node: str, start: float, end: float) -> float:
    """The share of [start, end] in which `node` held a request (the union of its requests' spans)."""
    spans = sorted((r.arrival, r.last_token) for key, r in requests.items() if where.get(key) == node)
    busy, reach = 0.0, start
    for a, b in spans:
        a, b = max(a, reach), min(b, end)
        if b > a:
            busy += b - a
            reach = b
    return busy / (end - start)
