"""The macro-instance scheduler over reported states, the overall scheduler with mitosis moves, the scaling
trigger, the prefill predictor and the baselines' balancer."""

from __future__ import annotations

import pytest

from hetnode.policy.balancer import least_loaded
from hetnode.policy.ecoserve import Decoding, InstanceState, MacroInstance, Slos
from hetnode.policy.ecoserve_overall import Overall, ScalingTrigger
from hetnode.policy.instance_steps import InstanceConfig, InstanceScheduler
from hetnode.policy.macro_scheduler import MacroScheduler
from hetnode.policy.prefill_predictor import PrefillPredictor

SLOS = Slos(ttft_s=1.0, tpot_s=0.1)


def prefill(n: int) -> float:
    return n / 1000


def test_requests_routed_since_a_report_count_against_the_instance() -> None:
    m = MacroScheduler(SLOS, prefill)
    for k in range(2):
        m.add(k, InstanceState(free_kv_tokens=10_000))
    # 0.4 s each: two fit instance 0's one second of TTFT; the third would make 1.2 s and rolls on.
    assert [m.route(400, 400, 0.0) for _ in range(3)] == [0, 0, 1]
    # A report that has seen only the first request keeps the second one's KV counted.
    m.update(0, InstanceState(free_kv_tokens=9_600, routed=1))
    assert m.states()[0].free_kv_tokens == 9_200
    m.update(0, InstanceState(free_kv_tokens=9_200, routed=2))
    assert m.states()[0].free_kv_tokens == 9_200


def test_a_burst_lasts_from_the_cycles_arrival_to_its_departure_whatever_the_instance_reports() -> None:
    """t_switch is the macro-instance scheduler's: an instance whose prompts were prefilled (and one that
    finished at its first token) keeps them in its burst until the cycle has moved on and come back."""
    m = MacroScheduler(SLOS, prefill)
    for k in range(2):
        m.add(k, InstanceState(free_kv_tokens=10_000))
    assert [m.route(300, 300, 0.0) for _ in range(3)] == [0, 0, 0]
    m.update(0, InstanceState(free_kv_tokens=10_000, routed=3))  # all prefilled, one already finished
    assert m.bursts() == [(300, 300, 300), ()]
    assert m.route(300, 300, 0.1) == 1  # 1.2 s with this one: on to instance 1
    assert [m.route(600, 600, 0.2) for _ in range(2)] == [1, 0]  # back to instance 0: its burst starts again
    assert m.bursts() == [(600,), (300, 600)]


def test_the_macro_scheduler_decides_as_algorithm_1_on_the_same_states() -> None:
    """Mirror: the wrapper with reports decides exactly what MacroInstance decides on those states and bursts."""
    states = [InstanceState((Decoding(5, 0.0),), 10_000, routed=1),
              InstanceState((Decoding(50, 0.0),), 10_000, routed=0)]
    m = MacroScheduler(SLOS, prefill)
    for k, s in enumerate(states):
        m.add(k, s)
    bare = MacroInstance(2)
    for prompt in (100, 700, 200, 50, 900, 300):
        expected = bare.route([*m.states()], m.bursts(), prompt, prompt, 1.0, SLOS, prefill)
        assert m.route(prompt, prompt, 1.0) == expected


def test_instances_join_and_leave_without_disturbing_the_cycle() -> None:
    m = MacroScheduler(SLOS, prefill)
    for k in "abc":
        m.add(k, InstanceState(free_kv_tokens=10_000))
    assert m.route(900, 900, 0.0) == "a"
    assert m.route(900, 900, 0.0) == "b"
    m.remove("a")
    assert m.route(50, 50, 0.0) == "b"
    m.add("d", InstanceState(free_kv_tokens=10_000))
    assert len(m) == 3 and m.route(900, 900, 0.0) == "c"
    with pytest.raises(ValueError):
        m.add("d", InstanceState())


def test_an_instance_reports_what_the_scheduler_reads() -> None:
    inst = InstanceScheduler(InstanceConfig(kv_tokens=5_000))
    m = MacroScheduler(SLOS, prefill)
    m.add(0, inst.status())
    assert m.route(300, 300, 0.0) == 0
    inst.route(0, 300, 0.0)
    m.update(0, inst.status())
    assert m.bursts() == [(300,)] and m.states()[0].free_kv_tokens == 4_700 and m.states()[0].decodes == ()
    plan = inst.next_step(0.0)
    assert plan is not None
    inst.step_done(plan, 0.3, ())
    m.update(0, inst.status())
    assert [d.output_len for d in m.states()[0].decodes] == [1]  # the burst's own request decodes: it counts


def test_overall_dispatches_by_capability_and_moves_instances_on_split_and_merge() -> None:
    o = Overall(2, 4, lambda: MacroScheduler(SLOS, prefill))
    moves = [o.add(k, InstanceState(free_kv_tokens=1000)) for k in range(6)]
    assert o.sizes == [4, 2] and [mv.instance for mv in moves[4]] == [3]  # the split at N_u = 4
    counts = [0, 0]
    for _ in range(60):
        counts[o.dispatch()] += 1
    assert counts == [40, 20]
    gone = [o.remove() for _ in range(3)]
    assert [bool(mv) for _, _, mv in gone] == [False, False, True]  # 1 + 2 < N_u: merged
    assert o.sizes == [3]
    assert sorted(o.macros[0].ids) == sorted(set(range(6)) - {g[0] for g in gone})


def test_scaling_trigger() -> None:
    t = ScalingTrigger(target=0.9, low_use=0.5, idle_windows=2)
    assert t.decide(0.8, 0.9) == 1
    assert t.decide(0.95, 0.2) == 0
    assert t.decide(0.95, 0.2) == -1
    assert t.decide(0.95, 0.7) == 0


def test_prefill_predictor_interpolates_the_profile() -> None:
    p = PrefillPredictor.fit([(2048, 0.4), (16, 0.05), (512, 0.1), (512, 0.12)])
    assert p(512) == pytest.approx(0.11)  # repeated lengths averaged
    assert p(1280) == pytest.approx(0.11 + 0.29 / 2)
    assert p(4096) == pytest.approx(0.4 + 0.29 * 2048 / 1536)  # the last segment, extended
    assert p(4) == pytest.approx(0.05)  # never below the shortest profiled prompt's pass
    assert PrefillPredictor.fit([(100, 0.5)])(200) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        PrefillPredictor.fit([])


def test_least_loaded() -> None:
    assert least_loaded([3, 1, 1]) == 1
    with pytest.raises(ValueError):
        least_loaded([])
