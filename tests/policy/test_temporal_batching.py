"""EcoServe's temporal batching on a node: a step is all prompt chunks or all decodes, prefills first while one can
run; and the mirror test: a node's batch policy and the PaDG simulator's instance scheduler, fed the same
arrivals, run the same phase at every step and switch to decoding at the same instants."""

from __future__ import annotations

from pathlib import Path

import pytest
from batch_items import It

from hetnode.policy.batching import BatchConfig
from hetnode.policy.instance_steps import DECODE, PREFILL, InstanceConfig, InstanceScheduler
from hetnode.policy.kv_ledger import KVLedger
from hetnode.policy.machine_batching import batch_policy_for
from hetnode.policy.temporal_batching import TemporalBatchPolicy


def policy(blocks: int = 1000, budget: int = 8192, now: list[float] | None = None) -> TemporalBatchPolicy:
    clock = now or [0.0]
    return TemporalBatchPolicy(KVLedger(blocks, 16), BatchConfig(max_batch_tokens=budget), lambda: clock[0])


def test_prompts_run_alone_then_decodes_alone_and_the_queue_keeps_its_order() -> None:
    p = policy()
    queue = [It("d1", 40, 1, 40), It("a", 0, 100), It("d2", 50, 1, 50), It("b", 0, 30)]
    p.ledger.reserve("d1", 41)
    p.ledger.reserve("d2", 51)
    step = p.form(queue)
    assert [it.session for it in step.batch] == ["a", "b"] and p.phases.phase == PREFILL
    assert [it.session for it in step.waiting] == ["d1", "d2"]
    step = p.form(step.waiting)
    assert [it.session for it in step.batch] == ["d1", "d2"] and p.phases.phase == DECODE


def test_a_prompt_blocked_on_kv_gives_way_to_the_decodes_that_will_free_it() -> None:
    p = policy(blocks=10)
    p.ledger.reserve("d", 100)  # 7 of 10 blocks
    step = p.form([It("big", 0, 100), It("d", 100, 1, 100)])
    assert [it.session for it in step.batch] == ["d"] and [it.session for it in step.waiting] == ["big"]
    assert [it.session for it in step.blocked] == ["big"]


def test_a_prompt_over_the_budget_runs_in_chunks_before_any_decode() -> None:
    p = policy(budget=64)
    p.ledger.reserve("d", 11)
    step = p.form([It("d", 10, 1, 10), It("a", 0, 100)])
    assert [it.session for it in step.batch] == ["a"] and step.split_tokens == 64
    assert [it.session for it in step.waiting] == ["d", "a"]


def test_the_runtime_picks_it_by_name() -> None:
    make = batch_policy_for("ecoserve", clock=lambda: 7.0)
    p = make(KVLedger(100, 16), BatchConfig())
    assert isinstance(p, TemporalBatchPolicy)
    p.form([It("a", 0, 10)])
    p.form([It("a", 10, 1, 10)])
    assert p.phases.switched_at == 7.0


def test_the_node_and_the_simulators_instance_decide_the_same_phases() -> None:
    """Prompts arrive while the instance decodes; every request decodes 12 tokens. The node's queue holds the
    hops' items (a prompt, then one decode item a token); the instance scheduler holds requests."""
    arrivals = {0: [(0, 120), (1, 40)], 3: [(2, 300)], 4: [(3, 16)], 9: [(4, 500), (5, 64)], 20: [(6, 90)]}
    out = 12
    now = [0.0]
    node = policy(now=now)
    sim = InstanceScheduler(InstanceConfig(kv_tokens=1 << 20))
    queue: list[It] = []
    produced: dict[int, int] = {}
    node_phases, sim_phases, switches = [], [], []
    for k in range(80):
        now[0] = float(k)
        for rid, prompt in arrivals.get(k, []):
            queue.append(It(str(rid), 0, prompt))
            sim.route(rid, prompt, now[0])
        plan = sim.next_step(now[0])
        step = node.form(queue)
        sim_phases.append(None if plan is None else plan.kind)
        node_phases.append(None if not step.batch else node.phases.phase)
        switches.append((sim.switched_at, node.phases.switched_at))
        queue = list(step.waiting)
        ended = []
        for it in step.batch:
            if it is step.split:
                continue
            produced[int(it.session)] = produced.get(int(it.session), 0) + 1
            if produced[int(it.session)] >= out:
                ended.append(int(it.session))
                node.ledger.release(it.session)
            else:
                end = it.start + it.num_tokens
                queue.append(It(it.session, end, 1, it.prefill_end))
        if plan is not None:
            sim.step_done(plan, now[0] + 0.5, ended)
    assert node_phases == sim_phases
    assert all(a == b for a, b in switches)
    assert node_phases.count(PREFILL) >= 4 and node_phases.count(DECODE) >= 20
    assert len({s for s, _ in switches}) >= 4  # it switched back to decoding several times


def test_testnet_up_with_ecoserve_placement_gives_its_nodes_temporal_batching(tmp_path: Path) -> None:
    from hetnode.cli import build_parser
    from hetnode.testnet.launcher import NodeSpec, join_args

    parser = build_parser()
    for extra, want in (([], "ecoserve"), (["--batching", "splitwise"], "splitwise")):
        up = parser.parse_args(["testnet", "up", "--placement", "ecoserve", *extra])
        cmd = join_args(up, NodeSpec("n0", "cpu", "r1", 8.0), "/ip4/127.0.0.1/tcp/4001/p2p/x", tmp_path, [])
        assert parser.parse_args(cmd).batching == want
    assert parser.parse_args(["coordinator", "--model", "m", "--slo", "1,0.05", "--macro-bounds",
                              "2,3"]).slo == (1.0, 0.05)
    with pytest.raises(SystemExit):
        parser.parse_args(["coordinator", "--model", "m", "--macro-bounds", "3,3"])
