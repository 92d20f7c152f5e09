"""EcoServe's live routing: the plan (instances of the whole model in macro-instances), Algorithm 1 over the
instances' states as the coordinator sees them, queueing and node loss; and the mirror test: the PaDG simulator's
way (instance schedulers reporting `status()` to the overall scheduler) and the coordinator's scheduler, fed the
same arrivals and the same tokens, route every request to the same instance."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetnode.coordinator.ecoserve_scheduler import EcoServeScheduler
from hetnode.coordinator.routing import make_scheduler, scheduler_for
from hetnode.errors import ConfigError
from hetnode.planner.devices import parse_device
from hetnode.planner.ecoserve_plan import ecoserve_placement, ecoserve_predictors, macro_groups
from hetnode.planner.model import model_spec
from hetnode.policy.ecoserve import Slos
from hetnode.policy.ecoserve_overall import Overall
from hetnode.policy.instance_steps import InstanceConfig, InstanceScheduler
from hetnode.policy.macro_scheduler import MacroScheduler
from hetnode.policy.prefill_predictor import PrefillPredictor

MODEL = model_spec("llama3-8b")
A100 = parse_device("a100-80g")
PREFILL = PrefillPredictor.fit([(100, 0.1), (1000, 1.0)])  # 1 ms a token
SLOS = Slos(ttft_s=0.5, tpot_s=0.05)


def plan(n: int, lower: int = 4, upper: int = 16) -> object:
    return ecoserve_placement("test", MODEL, {f"n{i:02d}": A100.memory_bytes for i in range(n)}, lower=lower,
                              upper=upper)


def scheduler(n: int = 3, **kw: object) -> EcoServeScheduler:
    p = plan(n)
    return EcoServeScheduler(p, predictors={r.nodes[0]: PREFILL for r in p.replicas}, slos=SLOS,  # type: ignore[attr-defined]
                             learn_output=False, avg_output_len=0.0, **kw)  # type: ignore[arg-type]


def test_the_plan_makes_every_node_that_holds_the_model_an_instance_in_macro_instances() -> None:
    p = ecoserve_placement("c", MODEL, {"b": A100.memory_bytes, "a": A100.memory_bytes, "tiny": 1 << 30})
    assert [(r.role, r.nodes) for r in p.replicas] == [("macro0", ("a",)), ("macro0", ("b",))]
    assert all((x.first_layer, x.last_layer) == (0, 32) for x in p.placements) and p.notes == (
        "cannot hold the model, nor complete a pipeline: tiny",)
    # The 17th instance (N_u = 16) splits N_l = 4 off into a second macro-instance, as the simulator's does.
    big = plan(17)
    roles = [r.role for r in big.replicas]  # type: ignore[attr-defined]
    assert roles.count("macro0") == 13 and roles.count("macro1") == 4
    assert [len(g) for g in macro_groups([f"n{i}" for i in range(17)])] == [13, 4]
    groups: dict[str, list[str]] = {}
    for r in big.replicas:  # type: ignore[attr-defined]
        groups.setdefault(r.role, []).append(r.nodes[0])
    s = EcoServeScheduler(big, predictors={r.nodes[0]: PREFILL for r in big.replicas})  # type: ignore[arg-type, attr-defined]
    assert s.macros() == [groups["macro0"], groups["macro1"]]  # the scheduler groups them as the plan says
    with pytest.raises(ConfigError, match="hold all of"):
        ecoserve_placement("c", MODEL, {"tiny": 1 << 30})


def test_nodes_that_cannot_hold_the_model_form_pipelined_instances_routed_through_every_stage() -> None:
    from hetnode.coordinator.scheduler import PipelineHop

    gib = 1 << 30
    # LLaMA-3 8B: 32 layers of 0.41 GiB. Half of 10 GiB holds 12 layers, half of 8 GiB 9: three of the small
    # nodes make a pipeline of 12 + 12 + 9 >= 32 layers (largest first), cut in proportion; the rest is too few.
    memory = {"big": A100.memory_bytes, "s1": 10 * gib, "s2": 10 * gib, "s3": 8 * gib, "s4": 8 * gib}
    p = ecoserve_placement("c", MODEL, memory)
    assert [r.nodes for r in p.replicas] == [("big",), ("s1", "s2", "s3")]
    ranges = p.ranges()
    assert [ranges[n] for n in ("s1", "s2", "s3")] == [(0, 12), (12, 23), (23, 32)]
    assert p.notes == ("cannot hold the model, nor complete a pipeline: s4",)
    from hetnode.protocol.messages import HardwareProfile

    profiles = {n: HardwareProfile(device="a100", device_type="a100", memory_bytes=m, matmul_tflops=312,
                                   mem_bandwidth_gbps=2039, dtype="float16") for n, m in memory.items()}
    predictors = ecoserve_predictors(p, MODEL, profiles)
    assert set(predictors) == {"big", "s1"}  # an instance by its first node
    assert predictors["s1"](2048) == pytest.approx(predictors["big"](2048), rel=0.05)  # the same GPUs, in turn
    s = EcoServeScheduler(p, predictors=predictors, slos=SLOS, kv_capacity={"big": 1_000, "s1": 5_000,
                                                                             "s2": 2_000, "s3": 9_000},
                          learn_output=False, avg_output_len=0.0, high_water=1.0)
    routes = [s.submit(f"r{i}", 900, 0.0).pipeline for i in range(2)]  # the big node has room for one
    assert (PipelineHop("s1", 0, 12), PipelineHop("s2", 12, 23), PipelineHop("s3", 23, 32)) in routes
    # The pipeline holds what its tightest stage holds.
    assert s.state("s1", 0.0).free_kv_tokens == 2_000 - 900
    # A stage down takes its instance down, with its requests.
    on_pipe = next(f"r{i}" for i in range(2) if routes[i][0].node == "s1")  # type: ignore[index]
    down = s.node_down("s2", 1.0)
    assert down.affected == (on_pipe,) and s.macros() == [["big"]]
    assert s.node_down("s3", 1.0).affected == ()


def test_the_predictor_comes_from_the_nodes_advertised_numbers() -> None:
    from hetnode.protocol.messages import HardwareProfile

    p = ecoserve_placement("c", MODEL, {"fast": A100.memory_bytes, "slow": A100.memory_bytes})
    fast = HardwareProfile(device="a100", device_type="a100", memory_bytes=A100.memory_bytes, matmul_tflops=312,
                           mem_bandwidth_gbps=2039, dtype="float16")
    slow = HardwareProfile(device="x", device_type="x", memory_bytes=A100.memory_bytes, matmul_tflops=31.2,
                           mem_bandwidth_gbps=203.9, dtype="float16")
    predictors = ecoserve_predictors(p, MODEL, {"fast": fast, "slow": slow})
    assert 5 < predictors["slow"](2048) / predictors["fast"](2048) < 15
    assert predictors["fast"](4096) > predictors["fast"](1024) > 0
    with pytest.raises(ConfigError, match="no profile"):
        ecoserve_predictors(p, MODEL, {"fast": fast})


def test_requests_stay_on_an_instance_while_its_prefills_fit_the_ttft_slo_then_roll_on() -> None:
    s = scheduler()
    # 200-token prompts take 0.2 s each: two fit the 0.5 s TTFT at n00, a third goes to n01.
    nodes = [s.submit(f"r{i}", 200, 0.0).pipeline[0].node for i in range(5)]  # type: ignore[index]
    assert nodes == ["n00", "n00", "n01", "n01", "n02"]
    assert scheduler_for(s.plan, "iwrr") == "ecoserve"


def test_a_request_decodes_from_its_first_token_and_saved_tpot_gates_its_instance() -> None:
    s = scheduler(1)
    s.submit("a", 100, 0.0)
    s.submit("b", 100, 0.0)
    s.prefilled("a", 0.1)
    assert [d.first_token_at for d in s.state("n00", 0.1).decodes] == [0.1]  # b's prompt is still prefilling
    s.prefilled("b", 0.2)
    assert len(s.state("n00", 0.2).decodes) == 2
    # Decodes that have saved nothing (1 token in 0 s... 0.3 s later: 1 x 0.05 - 0.3 < 0) turn a request away
    # from this instance; with one instance Algorithm 1 comes back to it, and progress restores the saving.
    s.progress("a", 20, 0.5)
    s.progress("b", 20, 0.5)
    assert s.state("n00", 0.5).decodes[0].output_len == 20


def test_a_request_that_ends_at_its_first_token_still_counts_in_its_instances_burst() -> None:
    s = scheduler(2)
    s.submit("a", 100, 0.0)
    s.submit("b", 300, 0.0)
    s.prefilled("a", 0.1)
    s.finish("a", 1, 0.1)  # a's one token: it ends while b still prefills
    s.prefilled("b", 0.4)
    assert s.overall.macros[0].bursts() == [(100, 300), ()]  # until Algorithm 1 moves on
    # 0.1 + 0.3 + 0.2 s > the 0.5 s TTFT SLO: the next request goes on, as it would had a not finished.
    assert s.submit("c", 200, 0.4).pipeline[0].node == "n01"  # type: ignore[index]


def test_no_kv_room_queues_and_a_finish_lets_the_head_go() -> None:
    s = scheduler(2, kv_capacity={"n00": 1000, "n01": 1000}, high_water=1.0)
    a, b = s.submit("a", 900, 0.0), s.submit("b", 900, 0.0)
    assert {a.pipeline[0].node, b.pipeline[0].node} == {"n00", "n01"}  # type: ignore[index]
    c = s.submit("c", 900, 0.0)
    assert c.queued and "KV room" in c.reason
    assert [d.request_id for d in s.finish("a", 5, 1.0)] == ["c"]
    assert s.pipeline_of("c") == a.pipeline
    assert s.submit("huge", 5000, 1.0).too_large


def test_a_node_down_leaves_its_macro_instance_and_its_requests_move() -> None:
    s = scheduler(2)
    d = s.submit("a", 100, 0.0)
    down = s.node_down(d.pipeline[0].node, 1.0)  # type: ignore[index]
    assert down.affected == ("a",) and s.macros() == [["n01"]]
    assert s.submit("b", 100, 1.0).pipeline[0].node == "n01"  # type: ignore[index]
    s.node_down("n01", 2.0)
    assert "every instance is down" in s.submit("c", 100, 2.0).reason


def test_make_scheduler_routes_only_an_ecoserve_plan_by_ecoserve() -> None:
    p = plan(2)
    with pytest.raises(ConfigError, match="EcoServe plan"):
        make_scheduler("iwrr", p, predictors={})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="predictor"):
        make_scheduler("ecoserve", p, predictors={})  # type: ignore[arg-type]


def test_the_simulators_instances_and_the_coordinators_scheduler_route_the_same() -> None:
    """Both fed the same arrivals and tokens: instances step every 20 ms (a prefill step or a decode step, by
    the instance scheduler), each request ends after 30 tokens, every fifth after its first (it ends inside its
    prefill phase, which its prompt still made longer); the simulator's way reports each instance's `status()`
    to the overall scheduler, the coordinator's way sees first tokens and progress."""
    n, dt = 3, 0.02

    def out(rid: int) -> int:
        return 1 if rid % 5 == 0 else 30

    coord = scheduler(n)
    sims = {f"n{i:02d}": InstanceScheduler(InstanceConfig(kv_tokens=1 << 30)) for i in range(n)}
    overall = Overall(4, 16, lambda: MacroScheduler(SLOS, PREFILL))
    for node, inst in sims.items():
        overall.add(node, inst.status())
    arrivals = [(0.013 * k + 0.001 * (k % 3), 50 + (37 * k) % 300) for k in range(150)]
    plans: dict[str, object] = {}
    busy = dict.fromkeys(sims, 0.0)
    ids = {}
    t, a, picks = 0.0, 0, ([], [])  # type: ignore[var-annotated]
    while a < len(arrivals) or any(not i.idle() for i in sims.values()):
        for node, inst in sims.items():  # steps that end now, then the next step at once (as the simulator)
            if node in plans and busy[node] <= t + 1e-12:
                step = plans.pop(node)
                ended = [r for r, _ in step.decodes if inst.running[r].output + 1 >= out(r)]  # type: ignore[attr-defined]
                ended += [r for r, done, take in step.chunks  # type: ignore[attr-defined]
                          if done + take >= inst.running[r].prompt and out(r) == 1]
                for rid in inst.step_done(step, t, ended):  # type: ignore[arg-type]
                    key = f"r{rid}"
                    if rid in ended:
                        if out(rid) == 1:
                            coord.prefilled(key, t)
                        coord.finish(key, out(rid), t)
                    elif inst.running[rid].output == 1:
                        coord.prefilled(key, t)
                    else:
                        coord.progress(key, inst.running[rid].output, t)
            if node not in plans:
                nxt = inst.next_step(t)
                if nxt is not None:
                    plans[node], busy[node] = nxt, t + dt
        while a < len(arrivals) and arrivals[a][0] <= t + 1e-12:
            prompt = arrivals[a][1]
            for node, inst in sims.items():
                overall.macros[overall.macro_of(node)].update(node, inst.status())
            sim_pick = str(overall.route(prompt, prompt, t))
            decision = coord.submit(f"r{a}", prompt, t)
            picks[0].append(sim_pick)
            picks[1].append(decision.pipeline[0].node)  # type: ignore[index]
            sims[sim_pick].route(a, prompt, t)
            ids[a] = sim_pick
            if sim_pick not in plans:
                nxt = sims[sim_pick].next_step(t)
                if nxt is not None:
                    plans[sim_pick], busy[sim_pick] = nxt, t + dt
            a += 1
        t = round(t + 0.001, 6)
    assert picks[0] == picks[1]
    assert len(set(picks[0])) == n and picks[0] != sorted(picks[0])  # all instances used, and not in blocks only


def test_the_operators_settings_are_checked() -> None:
    from hetnode.coordinator.deployment import PlanningConfig

    assert PlanningConfig(method="ecoserve", slo_s=(1.0, 0.05), macro_bounds=(2, 3)).slo_s == (1.0, 0.05)
    with pytest.raises(ConfigError, match="SLOs"):
        PlanningConfig(method="ecoserve", slo_s=(0.0, 0.1))
    with pytest.raises(ConfigError, match="N_l < N_u"):
        PlanningConfig(method="ecoserve", macro_bounds=(4, 4))
    with pytest.raises(ConfigError, match="scale-from >= 0"):
        PlanningConfig(method="ecoserve", scale_from=-1)
    with pytest.raises(ConfigError, match="shares in"):
        PlanningConfig(method="ecoserve", scale_from=1, scale_target=1.5)


def test_scale_from_needs_the_ecoserve_placement(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hetnode.cli import main

    for command in (["coordinator", "--model", "none"], ["testnet", "up", "--nodes", "1"]):
        assert main([*command, "--scale-from", "2", "--state-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert "--scale-from" in err and "--placement ecoserve" in err, err
