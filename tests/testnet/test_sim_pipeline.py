"""Whole runs: one request on an idle pipeline takes exactly what the profiles and links predict; the simulator
drives the runtime's own scheduler and planner objects; runs are deterministic."""

from __future__ import annotations

from typing import Any

import pytest
from sim_helpers import PROFILE, PROFILES, TOY, two_node_cluster, two_node_plan

import hetnode.coordinator.routing as routing
from hetnode.coordinator.scheduler import IwrrScheduler
from hetnode.errors import ConfigError
from hetnode.planner.cluster import parse_cluster
from hetnode.planner.model import TOKEN_BYTES
from hetnode.planner.plan import SINK, SOURCE, NodePlacement, PlacementPlan
from hetnode.planner.profile import ProfileTable
from hetnode.testnet.sim import SimOptions, Workload, simulate
from hetnode.testnet.sim.coordinator import SimulationError

COORD_BPS, COORD_LAT = 1e6, 0.005  # 8 Mb/s, 5 ms
MID_BPS, MID_LAT = 1e7, 0.020  # 80 Mb/s, 20 ms
ACT = TOY.activation_bytes  # 128 bytes per token


def one_request(input_len: int, output_len: int, *, arrival: float = 1.0) -> Workload:
    return Workload(name="one", inputs=(input_len,), outputs=(output_len,), arrivals=(arrival,))


def hop(tokens: int, bytes_per_token: float, bps: float, latency: float) -> float:
    return tokens * bytes_per_token / bps + latency


def prompt_round_trip(tokens: int) -> float:
    """Token ids to a, two layers on a, hidden states to b, two layers on b, one token back."""
    return (hop(tokens, TOKEN_BYTES, COORD_BPS, COORD_LAT) + PROFILE.prefill_time(tokens, 2)
            + hop(tokens, ACT, MID_BPS, MID_LAT) + PROFILE.prefill_time(tokens, 2)
            + hop(1, TOKEN_BYTES, COORD_BPS, COORD_LAT))


def decode_round_trip(position: int) -> float:
    """The token at `position` once more through both nodes (each attends to position + 1 tokens): the last
    node feeds it straight back to the first (token ids on the b->a link), never through the coordinator; the
    coordinator hears of each token one b->coordinator hop later, the same for every token."""
    return (hop(1, TOKEN_BYTES, MID_BPS, MID_LAT) + PROFILE.decode_time(1, 2, position + 1)
            + hop(1, ACT, MID_BPS, MID_LAT) + PROFILE.decode_time(1, 2, position + 1))


def run(workload: Workload, **kwargs: Any) -> Any:
    return simulate(two_node_cluster(), TOY, PROFILES, two_node_plan(), workload=workload,
                    duration_s=kwargs.pop("duration_s", 100.0), warmup_s=0.0, **kwargs)


def test_one_request_on_an_idle_two_node_pipeline_takes_what_profiles_and_links_predict() -> None:
    result = run(one_request(100, 4))
    (r,) = result.requests
    ttft = prompt_round_trip(100)
    decodes = [decode_round_trip(p) for p in (100, 101, 102)]
    assert r.ttft == pytest.approx(ttft, rel=1e-12, abs=1e-12)
    assert r.e2e == pytest.approx(ttft + sum(decodes), rel=1e-12)
    assert r.tpot == pytest.approx(sum(decodes) / 3, rel=1e-12)
    assert r.max_tbt == pytest.approx(max(decodes), rel=1e-12)
    assert r.first_token == pytest.approx(1.0 + ttft, rel=1e-12)
    assert r.generated == 4 and r.queue == 0.0 and r.kv_wait == 0.0 and r.depth == 2
    assert r.path == "a[0,2)>b[2,4)"
    assert result.summary["requests"]["finished"] == 1


def test_helixs_decode_loop_takes_each_token_through_the_coordinator() -> None:
    """decode_loop "coordinator" (Helix's simulator issues each decode iteration anew from its source): a token goes
    b -> coordinator -> a, both coordinator links' latency and bytes, instead of b -> a; the prompt is the same."""
    (r,) = run(one_request(100, 4), options=SimOptions(decode_loop="coordinator")).requests
    relayed = [2 * hop(1, TOKEN_BYTES, COORD_BPS, COORD_LAT) + PROFILE.decode_time(1, 2, p + 1)
               + hop(1, ACT, MID_BPS, MID_LAT) + PROFILE.decode_time(1, 2, p + 1) for p in (100, 101, 102)]
    assert r.ttft == pytest.approx(prompt_round_trip(100), rel=1e-12)
    assert r.tpot == pytest.approx(sum(relayed) / 3, rel=1e-12)
    assert r.generated == 4 and r.finished
    links = {link.name: link for link in run(one_request(100, 4), options=SimOptions(decode_loop="coordinator")).links}
    assert "b->a" not in links  # nothing goes straight back
    # The coordinator sends the prompt and relays three tokens; the tokens it relays are the ones b streams to it.
    assert links["coordinator->a"].messages == 1 + 3 and links["b->coordinator"].messages == 4
    with pytest.raises(ConfigError, match="decode_loop"):
        SimOptions(decode_loop="sink")


def test_swarm_by_link_delay_keeps_to_the_near_node_where_by_node_rate_it_does_not() -> None:
    """swarm_wiring "link" (SWARM's own per-peer estimate, Helix's): the simulator measures each link's delay (send
    to the end of the receiver's step) and the scheduler draws by it, so of two equal nodes b1 (1 ms from a) and b2
    (100 ms) b1 takes most requests; by the nodes' rates ("node", the runtime's) they share them."""
    cluster = parse_cluster({
        "name": "fork", "coordinator": {"region": "r"},
        "nodes": [{"name": n, "device": "a100", "region": "r"} for n in ("a", "b1", "b2")],
        "links": {"default": {"bandwidth_mbps": 1000.0, "latency_ms": 1.0},
                  "pairs": [{"a": "a", "b": "b2", "bandwidth_mbps": 1000.0, "latency_ms": 100.0}]},
    }, "test")
    plan = PlacementPlan(cluster="fork", model="toy", num_layers=4, method="given",
                         placements=(NodePlacement("a", 0, 2), NodePlacement("b1", 2, 4), NodePlacement("b2", 2, 4)),
                         flows={(SOURCE, "a"): 2.0, ("a", "b1"): 1.0, ("a", "b2"): 1.0, ("b1", SINK): 1.0,
                                ("b2", SINK): 1.0}, max_flow=2.0)
    wl = Workload(name="many", inputs=(20,) * 400, outputs=(4,) * 400, arrivals=tuple(0.05 * i for i in range(400)))

    def share_of_b1(wiring: str) -> float:
        result = simulate(cluster, TOY, PROFILES, plan, workload=wl, scheduler="swarm", duration_s=40.0,
                          warmup_s=0.0, options=SimOptions(swarm_wiring=wiring))
        paths = [r.path for r in result.requests if r.path]
        return sum("b1" in p for p in paths) / len(paths)

    assert share_of_b1("link") > 0.75
    assert share_of_b1("node") == pytest.approx(0.5, abs=0.1)
    with pytest.raises(ConfigError, match="swarm_wiring"):
        SimOptions(swarm_wiring="peer")


def test_a_prompt_over_the_step_budget_runs_in_chunks_without_round_trips() -> None:
    """The coordinator sends the whole prompt; the first node's batch policy runs it in budget-sized chunks, each
    passed on as soon as it is done (the chunks pipeline through the nodes, no trip back to the coordinator)."""
    (whole,) = run(one_request(700, 2)).requests
    assert whole.ttft == pytest.approx(prompt_round_trip(700), rel=1e-12)
    (chunked,) = run(one_request(700, 2), options=SimOptions(max_batch_tokens=512)).requests
    # a: chunk 1 (512) then chunk 2 (188) back to back; b starts chunk 1 when it arrives and chunk 2 after both
    # it is free and chunk 2 has arrived.
    a1 = hop(700, TOKEN_BYTES, COORD_BPS, COORD_LAT) + PROFILE.prefill_time(512, 2)
    a2 = a1 + PROFILE.prefill_time(188, 2)
    b1 = a1 + hop(512, ACT, MID_BPS, MID_LAT) + PROFILE.prefill_time(512, 2)
    b2 = max(b1, a2 + hop(188, ACT, MID_BPS, MID_LAT)) + PROFILE.prefill_time(188, 2)
    assert chunked.ttft == pytest.approx(b2 + hop(1, TOKEN_BYTES, COORD_BPS, COORD_LAT), rel=1e-9)


def test_link_and_node_statistics_of_one_request() -> None:
    result = run(one_request(100, 4))
    links = {link.name: link for link in result.links}
    assert set(links) == {"coordinator->a", "a->b", "b->a", "b->coordinator"}
    mid = links["a->b"]
    assert mid.messages == 4 and mid.items == 4 and mid.prompt_items == 1
    assert mid.bytes == (100 + 3) * ACT and mid.queued_messages == 0
    # The decode loop: three tokens fed back as ids; the coordinator sends the prompt once and gets 4 tokens.
    back = links["b->a"]
    assert back.messages == 3 and back.bytes == 3 * TOKEN_BYTES
    assert links["coordinator->a"].messages == 1 and links["b->coordinator"].messages == 4
    a = next(n for n in result.nodes if n.name == "a")
    assert a.steps == 4 and a.tokens == 103 and a.prompt_tokens == 100
    assert a.busy_s == pytest.approx(PROFILE.prefill_time(100, 2) + sum(PROFILE.decode_time(1, 2, p + 1)
                                                                        for p in (100, 101, 102)))
    assert result.summary["decode_throughput"] == pytest.approx(4 / 100.0)
    assert result.summary["prompt_throughput"] == pytest.approx(100 / 100.0)


def test_two_requests_share_steps_and_queue_on_links() -> None:
    # Both arrive together: the second waits on the coordinator's link behind the first one's prompt.
    wl = Workload(name="two", inputs=(100, 100), outputs=(2, 2), arrivals=(1.0, 1.0))
    result = run(wl)
    first, second = result.requests
    link = next(link for link in result.links if link.name == "coordinator->a")
    assert link.queued_messages == 1
    assert link.max_queue_s == pytest.approx(100 * TOKEN_BYTES / COORD_BPS)
    assert second.ttft > first.ttft


def test_the_simulator_drives_the_runtime_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Any] = []
    real = routing.make_scheduler

    def spy(name: str, plan: Any, **kwargs: Any) -> Any:
        made.append(real(name, plan, **kwargs))
        return made[-1]

    monkeypatch.setattr(routing, "make_scheduler", spy)
    run(one_request(100, 2), scheduler="iwrr")
    assert len(made) == 1 and type(made[0]) is IwrrScheduler
    assert made[0].running == 0  # the request was submitted and finished through it


@pytest.mark.parametrize("name", ["iwrr", "random", "shortest-queue", "swarm"])
def test_every_runtime_policy_runs(name: str) -> None:
    wl = Workload(name="few", inputs=(50, 60, 70), outputs=(3, 4, 5), arrivals=(0.0, 0.1, 0.2))
    result = run(wl, scheduler=name, seed=3)
    assert result.summary["requests"]["finished"] == 3
    assert result.config["scheduler"] == name


def test_runs_are_deterministic() -> None:
    wl = Workload(name="many", inputs=tuple(20 + 7 * i for i in range(40)), outputs=tuple(2 + i % 9 for i in range(40)),
                  arrivals=tuple(0.05 * i for i in range(40)))
    a = run(wl, scheduler="random", seed=7).to_json(requests=True)
    b = run(wl, scheduler="random", seed=7).to_json(requests=True)
    a["run"] = b["run"] = None  # wall-clock time
    assert a == b


def test_an_invalid_pipeline_from_a_scheduler_is_an_error() -> None:
    class Broken:
        def submit(self, request_id: str, input_len: int, now: float) -> Any:
            from hetnode.coordinator.scheduler import Decision, PipelineHop

            return Decision(request_id, (PipelineHop("a", 0, 2), PipelineHop("b", 3, 4)))

        def finish(self, request_id: str, output_len: int, now: float) -> list[Any]:
            return []

    with pytest.raises(SimulationError, match="every layer once"):
        run(one_request(10, 2), scheduler=Broken())


def test_offline_closed_loop_keeps_the_cluster_busy() -> None:
    wl = Workload(name="off", inputs=(100, 200, 50), outputs=(20, 10, 30), offline=True, backlog=4)
    result = simulate(two_node_cluster(), TOY, PROFILES, two_node_plan(), workload=wl, duration_s=20.0, warmup_s=2.0)
    s = result.summary
    assert s["requests"]["arrived"] > 10 and s["decode_throughput"] > 0
    assert all(n.utilization > 0.5 for n in result.nodes)


_RUN_SNIPPET = """
import hashlib, json, sys
sys.path.insert(0, sys.argv[1])
from sim_helpers import PROFILES, TOY, two_node_cluster, two_node_plan
from hetnode.testnet.sim import Workload, simulate
wl = Workload(name="many", inputs=tuple(20 + 7 * i for i in range(30)), outputs=tuple(2 + i % 9 for i in range(30)),
              arrivals=tuple(0.05 * i for i in range(30)))
out = simulate(two_node_cluster(), TOY, PROFILES, two_node_plan(), workload=wl, duration_s=50.0, warmup_s=1.0,
               scheduler="shortest-queue", seed=5).to_json(requests=True)
del out["run"]
print(hashlib.sha256(json.dumps(out, sort_keys=True).encode()).hexdigest())
"""


def test_runs_do_not_depend_on_hash_randomization() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = str(Path(__file__).parent)
    digests = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        r = subprocess.run([sys.executable, "-c", _RUN_SNIPPET, here], capture_output=True, text=True, env=env,
                           timeout=120, check=True)
        digests.add(r.stdout.strip())
    assert len(digests) == 1


def test_progress_bar_runs(capsys: pytest.CaptureFixture[str]) -> None:
    wl = Workload(name="few", inputs=(50,) * 20, outputs=(30,) * 20, arrivals=tuple(0.5 * i for i in range(20)))
    result = run(wl, progress=True, duration_s=20.0)
    assert result.summary["requests"]["finished"] == 20
    assert "sim s" in capsys.readouterr().err


def test_a_prompt_waits_at_a_node_until_kv_is_released() -> None:
    from dataclasses import replace

    from hetnode.planner.profile import kv_tokens

    # Room for 20 tokens of KV beside two layers: one block of 16. No KV limit in the scheduler, so the nodes'
    # own memory does the gating.
    memory = int(2 * TOY.layer_bytes + 20 * 2 * TOY.kv_bytes_per_token_layer) + 1
    assert kv_tokens(memory, TOY, 2) == 20
    small = ProfileTable("toy", {"a100": replace(PROFILE, memory_bytes=memory)}, source="test")
    wl = Workload(name="two", inputs=(10, 10), outputs=(3, 3), arrivals=(1.0, 1.0))
    result = simulate(two_node_cluster(), TOY, small, two_node_plan(), workload=wl,
                      scheduler=IwrrScheduler(two_node_plan()), duration_s=100.0, warmup_s=0.0)
    first, second = result.requests
    assert first.kv_wait == 0.0 and second.kv_wait > 0
    # The second prompt starts at a when the first one's Release gets there (one coordinator->a latency).
    expected = (first.finish + COORD_LAT + PROFILE.prefill_time(10, 2) + hop(10, ACT, MID_BPS, MID_LAT)
                + PROFILE.prefill_time(10, 2) + hop(1, TOKEN_BYTES, COORD_BPS, COORD_LAT))
    assert second.first_token == pytest.approx(expected, rel=1e-12)
    a = next(n for n in result.nodes if n.name == "a")
    assert a.kv_waits == 1 and a.kv_capacity_blocks == 1 and a.kv_peak == 1.0


def test_dilated_profiles_and_kv_capacity_override() -> None:
    from hetnode.testnet.sim.profiles import dilated

    slow = dilated(PROFILES, 10.0)
    p = slow.profiles["a100"]
    assert p.prefill_time(100, 2) == pytest.approx(10 * PROFILE.prefill_time(100, 2))
    assert p.decode_time(3, 2, 40) == pytest.approx(10 * PROFILE.decode_time(3, 2, 40))
    assert p.tokens_per_s(1) == pytest.approx(PROFILE.tokens_per_s(1) / 10)
    result = simulate(two_node_cluster(), TOY, slow, two_node_plan(), workload=one_request(100, 2),
                      duration_s=100.0, warmup_s=0.0, options=SimOptions(kv_capacity={"a": 160}))
    r = result.requests[0]
    compute = 2 * slow.profiles["a100"].prefill_time(100, 2)
    assert r.ttft == pytest.approx(prompt_round_trip(100) - 2 * PROFILE.prefill_time(100, 2) + compute, rel=1e-12)
    assert {n.name: n.kv_capacity_blocks for n in result.nodes}["a"] == 10


def test_offline_loop_skips_requests_the_scheduler_refuses() -> None:
    from dataclasses import replace

    memory = int(2 * TOY.layer_bytes + 40 * 2 * TOY.kv_bytes_per_token_layer) + 1  # 40 tokens of KV per node
    small = ProfileTable("toy", {"a100": replace(PROFILE, memory_bytes=memory)}, source="test")
    wl = Workload(name="off", inputs=(5, 500, 6), outputs=(4, 4, 4), offline=True, backlog=2)
    result = simulate(two_node_cluster(), TOY, small, two_node_plan(), workload=wl, duration_s=10.0, warmup_s=1.0)
    s = result.summary["requests"]
    assert s["rejected_all"] > 0 and s["finished"] > 0
    assert all(r.input_len == 500 for r in result.requests if r.rejected)
    assert not any(r.input_len == 500 and r.finished for r in result.requests)


def test_the_coordinators_time_adds_to_each_request_and_each_token() -> None:
    req_s, tok_s = 0.015, 0.003
    result = run(one_request(100, 4), options=SimOptions(coordinator_request_s=req_s, coordinator_token_s=tok_s))
    (r,) = result.requests
    # Starting the request, then every token that comes back; the decode loop runs on the nodes, so the
    # coordinator's time per token is paid once per token as it is counted, not on the loop.
    ttft = req_s + prompt_round_trip(100) + tok_s
    decodes = [decode_round_trip(p) for p in (100, 101, 102)]
    assert r.ttft == pytest.approx(ttft, rel=1e-12)
    assert r.e2e == pytest.approx(ttft + sum(decodes), rel=1e-12)
    assert r.tpot == pytest.approx(sum(decodes) / 3, rel=1e-12)
    assert r.queue == 0.0  # the scheduler admitted it on arrival


def test_the_coordinator_serves_one_thing_at_a_time() -> None:
    wl = Workload(name="two", inputs=(100, 100), outputs=(2, 2), arrivals=(1.0, 1.0))
    # Starting two requests that arrive together: the second one's first item leaves after both starts.
    first, second = run(wl, options=SimOptions(coordinator_request_s=0.010)).requests
    assert first.ttft == pytest.approx(0.010 + prompt_round_trip(100), rel=1e-12)
    assert second.ttft == pytest.approx(0.020 + prompt_round_trip(100), rel=1e-12)
    # Their first tokens come back 6 ms apart; handling one takes 8 ms, so the second waits for the first.
    base = run(wl).requests
    gap = base[1].first_token - base[0].first_token
    assert 0 < gap < 0.008
    served = run(wl, options=SimOptions(coordinator_token_s=0.008)).requests
    assert served[0].first_token == pytest.approx(base[0].first_token + 0.008, rel=1e-12)
    assert served[1].first_token == pytest.approx(base[0].first_token + 0.016, rel=1e-12)
    with pytest.raises(ConfigError, match="coordinator"):
        SimOptions(coordinator_token_s=-1.0)


def test_a_decode_out_of_kv_is_preempted_and_moved_and_every_request_finishes() -> None:
    # Three blocks per node; each request ends at 10 + 30 = 40 tokens (three blocks), so two cannot both grow.
    wl = Workload(name="two", inputs=(10, 10), outputs=(30, 30), arrivals=(1.0, 1.0))
    result = simulate(two_node_cluster(), TOY, PROFILES, two_node_plan(), workload=wl,
                      scheduler=IwrrScheduler(two_node_plan()), duration_s=100.0, warmup_s=0.0,
                      options=SimOptions(kv_capacity={"a": 48, "b": 48}))
    assert result.summary["requests"]["preemptions"] >= 1
    assert [(r.generated, r.rejected) for r in result.requests] == [(30, ""), (30, "")]
    assert all(n.kv_peak <= 1.0 for n in result.nodes)  # never past the pool


def test_a_prompt_larger_than_a_nodes_pool_is_refused_unless_oversized_prompts_are_admitted() -> None:
    kw: dict[str, Any] = {"scheduler": IwrrScheduler(two_node_plan()), "duration_s": 100.0, "warmup_s": 0.0}
    refused = simulate(two_node_cluster(), TOY, PROFILES, two_node_plan(), workload=one_request(100, 3),
                       options=SimOptions(kv_capacity={"b": 64}), **kw)
    (r,) = refused.requests
    assert r.rejected.startswith("out of KV memory on this node") and "pool is 4 blocks" in r.rejected
    assert {n.name: n.kv_peak for n in refused.nodes}["a"] > 0  # a ran it, then freed it
    kw["scheduler"] = IwrrScheduler(two_node_plan())
    lax = simulate(two_node_cluster(), TOY, PROFILES, two_node_plan(), workload=one_request(100, 3),
                   options=SimOptions(kv_capacity={"b": 64}, admit_oversized=True), **kw)
    (r,) = lax.requests
    assert r.generated == 3 and not r.rejected
    assert {n.name: n.kv_peak for n in lax.nodes}["b"] == 7 / 4  # an overcommit, alone


def test_the_rest_of_a_refused_split_prompt_leaves_no_kv_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    import hetnode.testnet.sim.runner as runner

    held: dict[str, int] = {}
    stats = runner._node_stats

    def record(n: Any, end: float, window: tuple[float, float]) -> Any:
        held[n.name] = n.ledger.used + len(n.queue)
        return stats(n, end, window)

    monkeypatch.setattr(runner, "_node_stats", record)
    # a splits the 200-token prompt into pieces of 16; over fast links b refuses the first while most of the rest
    # still waits at a, which has freed the session's KV by the time it would run them.
    wl = Workload(name="two", inputs=(200, 20), outputs=(3, 5), arrivals=(1.0, 1.0))
    result = simulate(two_node_cluster(coord_ms=0.01, mid_ms=0.01), TOY, PROFILES, two_node_plan(), workload=wl,
                      scheduler=IwrrScheduler(two_node_plan()), duration_s=100.0, warmup_s=0.0,
                      options=SimOptions(kv_capacity={"b": 64}, max_batch_tokens=16))
    assert [r.generated for r in result.requests] == [0, 5] and result.requests[0].rejected
    assert held == {"a": 0, "b": 0}


def test_a_pruned_coordinator_link_carries_no_data_and_releases_still_arrive() -> None:
    """Helix's pruning (§4.5): the coordinator sends only to the first node and hears only from the last. The
    plan's data path uses just those links; a Release still reaches the node without one."""
    from hetnode.planner.cluster import parse_cluster

    cluster = parse_cluster({
        "name": "two", "coordinator": {"region": "r", "links": "listed"},
        "nodes": [{"name": "a", "device": "a100", "region": "r"}, {"name": "b", "device": "a100", "region": "r"}],
        "links": {"pairs": [{"a": "a", "b": "b", "bandwidth_mbps": 80.0, "latency_ms": 20.0}],
                  "directed": [{"from": "coordinator", "to": "a", "bandwidth_mbps": 8.0, "latency_ms": 5.0},
                               {"from": "b", "to": "coordinator", "bandwidth_mbps": 8.0, "latency_ms": 5.0}]},
    }, "test")
    assert not cluster.has_link("coordinator", "b") and not cluster.has_link("a", "coordinator")
    wl = Workload(name="two", inputs=(30, 40, 50), outputs=(4, 5, 6), arrivals=(0.0, 0.5, 1.0))
    result = simulate(cluster, TOY, PROFILES, two_node_plan(), workload=wl, duration_s=60.0, warmup_s=0.0)
    assert result.summary["requests"]["finished"] == 3
    assert {link.name for link in result.links} <= {"coordinator->a", "a->b", "b->a", "b->coordinator"}
