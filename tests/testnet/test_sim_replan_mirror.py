"""One loss, one lightweight re-plan, two executors: the runtime's coordinator and the simulator decide the same.

The simulator runs a ThunderServe deployment (the coordinator's own first plan of a live registry's nodes) while
a node of a decode replica is lost mid-run and the coordinator's re-plan follows (`replan.after_loss`,
`simulate(loss=..., replan=...)`). The same run's events, in the simulator's order, then drive the runtime's
coordinator: each arrival asks the `Deployment` for a route, the loss goes to `PipelineGenerator.node_down` over
the sessions running at that moment and to `Deployment.node_down`, the moved requests ask for a route again,
the node is marked down and `Deployment.replan(kind="node_lost")` makes its plan, whose shards report ready when
the simulated one serves; every request ends where the simulator ended it. Both must move the same requests,
switch to the same plan with the same kind of scheduler, and give every request the same route, before the loss,
after it and after the switch. The KV pools are larger than any of these requests need, so no decision waits on
the simulated timing of a step: the order of the calls decides, which is what the mirror replays.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from hetnode.coordinator.deployment import Deployment, PlanningConfig
from hetnode.coordinator.planning import live_cluster
from hetnode.coordinator.registry import Registry
from hetnode.coordinator.sessions import PipelineGenerator
from hetnode.ids import NodeId, SessionId
from hetnode.models.resolve import load_config
from hetnode.models.tiny import write_tiny_model
from hetnode.models.tokenizer import load_tokenizer
from hetnode.planner.cluster import ClusterSpec
from hetnode.planner.plan import PlacementPlan
from hetnode.planner.profile_sources import profile_table_for
from hetnode.planner.thunderserve.settings import ThunderServeOptions, Traffic
from hetnode.protocol.memory import MemoryNetwork
from hetnode.protocol.messages import AssignmentStatus, HardwareProfile, Join, Route
from hetnode.testnet.sim import SimResult, simulate
from hetnode.testnet.sim.replan import Loss, Replan, after_loss
from hetnode.testnet.sim.workload import Workload

# Six GPUs of two kinds, each its own host (the live cluster knows no hosts): the planner's groups are of one or
# two of them.
NODES = {"a0": "a100-80g", "a1": "a100-80g", "l0": "l4", "l1": "l4", "l2": "l4", "l3": "l4"}
SPECS = {"a100-80g": (80 << 30, 312.0, 2039.0), "l4": (24 << 30, 121.0, 300.0)}
PLANNING = PlanningConfig(method="thunderserve", split_workload=(600, 40))
# What the coordinator's `_thunderserve` plans for before any request has been measured: its planned mix at 1/s.
OPTIONS = ThunderServeOptions(traffic=Traffic(input_len=600, output_len=40, rate=1.0), slo_s=PLANNING.slo_s)
LOSS_AT = 7.2
# One request every 0.5 s for 20 s, and a burst just before the loss: the tiny model's requests take tens of
# milliseconds, so only these are running when the node goes.
ARRIVALS = sorted([0.5 * k for k in range(40)] + [LOSS_AT - 0.03 + 0.003 * k for k in range(10)])
OUTPUT = 400
DELAY_S = 1.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama") / "m", "llama")


def registry() -> Registry:
    reg = Registry(token="t", heartbeat_deadline_s=1e9)
    for name, device in NODES.items():
        memory, tflops, bandwidth = SPECS[device]
        profile = HardwareProfile(device=device, device_type=device, memory_bytes=memory, matmul_tflops=tflops,
                                  mem_bandwidth_gbps=bandwidth, dtype="float16", emulated=True)
        assert reg.admit(NodeId(name), Join(token="t", name=name, profile=profile, listen_addrs=[]), now=0.0,
                         wall=time.time()).admitted
    return reg


async def _no_control(*args: Any) -> bool:
    return True  # assignments reach every node; the test reports their status itself


def deployment(model: Path, reg: Registry) -> Deployment:
    return Deployment(reg, _no_control, model=str(model), model_config=load_config(model),  # type: ignore[arg-type]
                      coordinator=NodeId("coord"), planning=PLANNING)


async def _ready(d: Deployment) -> None:
    assert d.plan is not None
    for shard in d.plan.shards:
        d.on_status(NodeId(shard.peer), AssignmentStatus(plan_version=d.plan.version, state="ready"))
    assert d.serving is d.plan


def first_plan(model: Path) -> tuple[PlacementPlan, ClusterSpec]:
    """The coordinator's first plan of the registry's nodes, and the cluster it made it for."""
    async def run() -> PlacementPlan:
        d = deployment(model, registry())
        await d.replan("initial", kind="initial")
        assert d.plan is not None
        return d.plan.placement

    plan = trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
    reg = registry()
    return plan, live_cluster(reg, NodeId("coord"), "", reg.up_members())


def path(route: Route) -> str:
    return " | ".join(">".join(f"{h.peer}[{h.first_layer},{h.last_layer})" for h in phase.hops)
                      for phase in route.phases)


def _victim(plan: PlacementPlan, role: str, unperturbed: SimResult) -> str:
    """The prefill replica the orchestration sends the most to, or the decode replica with the most requests on it
    when the loss comes, in the same run without the loss (the routing spreads requests over equal decode replicas
    in proportion to what they sustain, so the shares name no busiest one)."""
    replicas = [r for r in plan.replicas if r.role == role]
    if role == "prefill":
        orch = plan.orchestration
        assert orch is not None
        shares = list(orch.prefill_share)
        return replicas[shares.index(max(shares))].nodes[0]
    firsts = [r.nodes[0] for r in replicas]
    held = {n: sum(r.arrival < LOSS_AT < r.finish and r.path.split(" | ")[-1].startswith(f"{n}[")
                   for r in unperturbed.requests) for n in firsts}
    return max(firsts, key=lambda n: (held[n], n))


def simulated(model: Path, role: str) -> tuple[SimResult, Replan, PlacementPlan, str]:
    spec = deployment(model, registry()).spec
    plan, cluster = first_plan(model)
    workload = Workload("mirror", inputs=(600,) * len(ARRIVALS), outputs=(OUTPUT,) * len(ARRIVALS),
                        arrivals=tuple(ARRIVALS))
    profiles = profile_table_for(cluster, spec, "roofline")
    unperturbed = simulate(cluster, spec, profiles, plan, workload=workload, scheduler="tstp", duration_s=30.0,
                           warmup_s=0.0)
    lost = _victim(plan, role, unperturbed)
    loss = Loss(LOSS_AT, (lost,))
    replan = after_loss(plan, cluster, spec, loss, "lightweight", options=OPTIONS, delay_s=DELAY_S)
    assert replan is not None and replan.note == ""
    result = simulate(cluster, spec, profiles, plan, workload=workload,
                      scheduler="tstp", duration_s=30.0, warmup_s=0.0, loss=loss, replan=replan)
    return result, replan, plan, lost


async def _runtime(model: Path, result: SimResult, lost: str) -> dict[str, Any]:
    """The simulated run's events, in its order, through the runtime's coordinator (module docstring)."""
    reg = registry()
    d = deployment(model, reg)
    await d.replan("initial", kind="initial")
    await _ready(d)
    first = d.serving
    assert first is not None
    events = {e["event"]: e for e in result.summary["replan"]}
    replanned, ready = events["replan"]["at"], events["ready"]["at"]
    todo: list[tuple[float, int, str, Any]] = []
    for r in result.requests:
        todo.append((r.arrival, 1, "arrive", r))
        todo.append((r.finish, 3, "finish", r))
    todo += [(LOSS_AT, 0, "loss", None), (replanned, 0, "replan", None), (ready, 0, "ready", None)]
    routes: dict[str, str] = {}
    keys: dict[str, str] = {}
    moved: list[str] = []
    old_scheduler_ends = []
    net = MemoryNetwork()
    async with net.transport("coord") as transport:
        cfg = load_config(model)
        gen = PipelineGenerator(transport, reg, d, model_name=str(model), model_config=cfg,
                                tokenizer=load_tokenizer(model))
        sessions: dict[str, Any] = {}
        # Requests that find no plan able to serve them wait for one (`Deployment.route` waits in
        # `wait_ready`); they are routed when it serves, in the order they came, as the simulator takes them
        # (the runtime's own order among waiters woken together is trio's).
        waiting: list[tuple[str, str, int]] = []

        async def route(rid: str, key: str, input_len: int) -> None:
            if d._usable(()) is None:
                waiting.append((rid, key, input_len))
                return
            routed = await d.route(key, input_len)
            routes[rid] = path(routed)
            sessions[rid] = gen._open(SessionId(key), routed, OUTPUT)

        for at, _, what, r in sorted(todo, key=lambda e: (e[0], e[1], e[3].id if e[3] is not None else "")):
            await trio.sleep_until(at)
            if what == "arrive":
                keys[r.id] = r.id
                await route(r.id, r.id, r.input_len)
            elif what == "loss":
                gen.node_down(NodeId(lost), "lost its control stream")
                told = [rid for rid, s in sessions.items() if s.recv.statistics().current_buffer_used]
                d.node_down(NodeId(lost))
                for rid in told:  # as each session's `_move` does: the old one ends, a route for the new one
                    moved.append(rid)
                    gen._close(sessions.pop(rid), None)
                    keys[rid] = f"{rid}.moved"
                    await route(rid, keys[rid], 600)
            elif what == "replan":
                reg.mark(NodeId(lost), "down", "lost its control stream")
                await d.replan(f"{lost} lost its control stream", kind="node_lost")
            elif what == "ready":
                await _ready(d)
                for rid, key, input_len in waiting:
                    await route(rid, key, input_len)
                waiting.clear()
            elif what == "finish" and r.id in sessions:
                if d._routed.get(keys[r.id]) is first.scheduler:
                    old_scheduler_ends.append(r.id)
                gen._close(sessions.pop(r.id), r.generated)
    assert d.serving is not None
    return {"routes": routes, "moved": sorted(moved), "plan": d.serving.placement,
            "scheduler": type(d.serving.scheduler).name, "old_scheduler_ends": old_scheduler_ends}


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_lost_node_and_the_lightweight_replan_mirror_the_coordinator(tiny_model: Path, role: str) -> None:
    """Losing the busiest decode node moves the requests decoding there; losing the prefill node moves every
    request it prefilled, decoding elsewhere or not, and the re-plan flips a decode group to prefill."""
    result, replan, _, lost = simulated(tiny_model, role)
    assert all(r.finished for r in result.requests) and not any(r.rejected for r in result.requests)
    runtime = trio.run(_runtime, tiny_model, result, lost, clock=trio.testing.MockClock(autojump_threshold=0))
    sim_moved = sorted(r.id for r in result.requests if r.moves)
    assert runtime["moved"] == sim_moved and sim_moved  # the same requests move ...
    assert runtime["routes"] == {r.id: r.path for r in result.requests}  # ... and every request runs the same route
    # The same plan after the switch (only the planner's own timing differs), routed by the same kind of scheduler.
    assert replace(runtime["plan"], solve_time_s=0.0) == replace(replan.plan, solve_time_s=0.0)
    assert runtime["scheduler"] == result.config["scheduler"] == "tstp"
    assert replan.plan.notes[0].startswith("lightweight reschedule")
    flipped = next(e["flipped"] for e in result.summary["replan"] if e["event"] == "replan")
    assert bool(flipped) == (role == "prefill")
    # Requests admitted before the switch, on routes that survive, end in the scheduler that admitted them.
    switched = next(e["at"] for e in result.summary["replan"] if e["event"] == "ready")
    before = [r.id for r in result.requests if r.admitted < LOSS_AT and not r.moves and r.finish > switched]
    assert set(before) <= set(runtime["old_scheduler_ends"])
    after = [r for r in result.requests if r.admitted > switched]
    assert after and {r.path for r in after} != {r.path for r in result.requests if r.admitted < LOSS_AT}
