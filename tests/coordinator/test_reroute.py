"""Requests outlive the pipeline they started on: in process, a coordinator and nodes over the memory transport.

A node that dies mid-generation moves each request to a pipeline of live nodes, which re-prefills the prompt plus
the tokens generated so far; a re-plan that moves layers while requests run moves them with their KV instead.
Either way the stream goes on and greedy output equals an undisturbed single-process run. When no live pipeline
remains, or a request keeps failing past the re-route bound, it ends with a clear error instead of hanging.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
import trio.testing
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hetnode.coordinator.daemon import Coordinator, CoordinatorConfig
from hetnode.coordinator.deployment import PlanningConfig
from hetnode.coordinator.generation import GenerationError, GenerationParams
from hetnode.coordinator.local import LocalGenerator
from hetnode.coordinator.metrics import CoordinatorMetrics
from hetnode.coordinator.sessions import PipelineGenerator
from hetnode.ids import NodeId
from hetnode.models.resolve import load_config
from hetnode.models.tiny import write_tiny_model
from hetnode.models.tokenizer import load_tokenizer
from hetnode.node.daemon import NodeConfig, NodeDaemon
from hetnode.node.engine import SamplingParams
from hetnode.node.hops import HopServer
from hetnode.policy.kv_codec import KVCodecPolicy
from hetnode.protocol.memory import MemoryNetwork
from hetnode.protocol.messages import HardwareProfile, Hop
from hetnode.protocol.probe import ProbeSettings

PROMPTS = [[5, 6, 7], list(range(20, 45)), list(range(100, 170)), [9] * 11]
MAX_TOKENS = 150  # long enough that a re-plan lands while every request still runs
PROBE = ProbeSettings(first_bytes=1024, max_bytes=1024)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama") / "m", "llama")


@pytest.fixture(scope="module")
def undisturbed(tiny_model: Path) -> dict[int, list[int]]:
    """Greedy tokens of every prompt from the whole model in one process."""

    async def run() -> dict[int, list[int]]:
        got: dict[int, list[int]] = {}

        async def one(local: LocalGenerator, i: int, p: list[int]) -> None:
            got[i] = await collect(local, p, MAX_TOKENS)

        async with LocalGenerator.open(tiny_model) as local, trio.open_nursery() as nursery:
            for i, p in enumerate(PROMPTS):
                nursery.start_soon(one, local, i, p)
        return got

    return trio.run(run)


def profile(bw: float) -> HardwareProfile:
    return HardwareProfile(device="cpu", device_type="cpu", memory_bytes=8 << 30, matmul_tflops=0.1,
                           mem_bandwidth_gbps=bw, dtype="float32")


@dataclass
class _Node:
    daemon: NodeDaemon
    hops: HopServer
    scope: trio.CancelScope
    gone: trio.Event


class Cluster:
    """A coordinator and nodes that can join and die (all of a node's streams reset, as a killed process's)."""

    def __init__(self, net: MemoryNetwork, nursery: trio.Nursery, coord: Coordinator, gen: PipelineGenerator,
                 ) -> None:
        self.net, self.nursery, self.coord, self.gen = net, nursery, coord, gen
        self.nodes: dict[str, _Node] = {}

    async def add(self, name: str, bw: float) -> None:
        self.nodes[name] = await self.nursery.start(self._run_node, name, bw)

    async def _run_node(self, name: str, bw: float, *, task_status: trio.TaskStatus[_Node]) -> None:
        gone = trio.Event()
        try:
            with trio.CancelScope() as scope:
                async with self.net.transport(name) as t, trio.open_nursery() as nursery:
                    hops = HopServer(t, lambda peer: daemon.is_member(peer))
                    daemon = NodeDaemon(NodeConfig(bootstrap=("/memory/coord/p2p/coord",), token="t", name=name,
                                                   profile=profile(bw), probe=PROBE), t, hops)
                    await nursery.start(hops.run)
                    await nursery.start(daemon.run)
                    task_status.started(_Node(daemon, hops, scope, gone))
                    await trio.sleep_forever()
        finally:
            gone.set()

    async def kill(self, name: str) -> None:
        node = self.nodes.pop(name)
        node.scope.cancel()
        await node.gone.wait()

    async def plan_over(self, names: set[str]) -> None:
        """Until the ready plan's stages are exactly the named nodes."""
        deployment = self.coord.deployment
        assert deployment is not None
        with trio.fail_after(30):
            while True:
                plan = await deployment.wait_ready(30)
                if plan is not None and set(plan.names) == names:
                    return
                await deployment._changed.wait()


@asynccontextmanager
async def cluster(model: Path, bandwidths: list[float], method: str = "pipeline", **gen_options: object,
                  ) -> AsyncIterator[Cluster]:
    net = MemoryNetwork()
    async with trio.open_nursery() as nursery, net.transport("coord") as ct:
        coord = Coordinator(CoordinatorConfig(token="t", probe_interval_s=3600, probe=PROBE), ct)
        # These tests kill a middle stage: a pipeline through every node, not Helix's placement (which would
        # replicate a small model on every node).
        gen = coord.enable_serving(model=str(model), model_config=load_config(model),
                                   tokenizer=load_tokenizer(model), planning=PlanningConfig(method=method))
        assert coord.deployment is not None
        coord.deployment.debounce_s = 0.05
        for key, value in gen_options.items():
            setattr(gen, key, value)
        await nursery.start(coord.run)
        c = Cluster(net, nursery, coord, gen)
        for i, bw in enumerate(bandwidths):
            await c.add(f"n{i}", bw)
        await c.plan_over({f"n{i}" for i in range(len(bandwidths))})
        yield c
        nursery.cancel_scope.cancel()


async def collect(gen: object, prompt: list[int], n: int, on_token: Callable[[int], object] | None = None,
                  ) -> list[int]:
    params = GenerationParams(max_tokens=n, sampling=SamplingParams())
    out: list[int] = []
    async with gen.generate(prompt, params) as events:  # type: ignore[attr-defined]
        async for e in events:
            out.append(e.token)
            if on_token is not None:
                on_token(len(out))
    return out


async def run_all(gen: PipelineGenerator, disturb: Callable[[], Awaitable[object]], *, hold: bool = False,
                  ) -> dict[int, list[int]]:
    """Every prompt concurrently; `disturb()` runs once the first request has streamed three tokens, or with
    `hold`, once every request has, while they all wait for it (a client reading slowly: nothing in flight)."""
    got: dict[int, list[int]] = {}
    reached = 0
    go, resume = trio.Event(), trio.Event()

    async def one(i: int, p: list[int]) -> None:
        nonlocal reached
        out: list[int] = []
        async with gen.generate(p, GenerationParams(max_tokens=MAX_TOKENS, sampling=SamplingParams())) as events:
            async for e in events:
                out.append(e.token)
                if len(out) == 3:
                    reached += 1
                    if not hold or reached == len(PROMPTS):
                        go.set()
                    if hold:
                        await resume.wait()
        got[i] = out

    async with trio.open_nursery() as nursery:
        for i, p in enumerate(PROMPTS):
            nursery.start_soon(one, i, p)
        await go.wait()
        await disturb()
        resume.set()
    return got


async def assert_kv_freed(c: Cluster) -> None:
    assert c.gen.active_sessions == 0
    await c.gen.wait_released()
    await trio.testing.wait_all_tasks_blocked()  # the Release messages reach the stages' handlers
    for node in c.nodes.values():
        if node.hops.loop is not None:
            await node.hops.loop.wait_idle()
            assert node.hops.loop.kv.used_blocks == 0


@pytest.mark.parametrize(("victim", "hold"), [("n0", False), ("n1", False), ("n2", False), ("n1", True)])
async def test_node_killed_mid_generation_requests_move_and_complete(
        tiny_model: Path, undisturbed: dict[int, list[int]], victim: str, hold: bool) -> None:
    async with cluster(tiny_model, [30.0, 20.0, 10.0]) as c:
        got = await run_all(c.gen, lambda: c.kill(victim), hold=hold)
        assert got == undisturbed
        # Each request moved once at most; held ones all had to.
        assert (c.gen.reroutes == len(PROMPTS)) if hold else (1 <= c.gen.reroutes <= len(PROMPTS))
        plan = c.coord.deployment.plan  # type: ignore[union-attr]
        assert plan is not None and victim not in plan.names
        await assert_kv_freed(c)


async def test_node_joining_mid_generation_replans_and_requests_move(
        tiny_model: Path, undisturbed: dict[int, list[int]]) -> None:
    # fp32 hand-offs: the moved KV is exactly what these fp32 nodes computed (fp16 or int4 would round it, and
    # over 4 x 150 tokens of a random tiny model a greedy choice flips).
    async with cluster(tiny_model, [30.0, 10.0], kv_codecs=KVCodecPolicy("fp32")) as c:

        async def join() -> None:
            await c.add("n2", 20.0)
            await c.plan_over({"n0", "n1", "n2"})
            assert c.gen.active_sessions == len(PROMPTS)

        got = await run_all(c.gen, join, hold=True)
        assert got == undisturbed
        # n0 and n1 now hold other layers: every request moved with its KV to the new pipeline (each old shard
        # served on until its sessions had gone), and nothing was prefilled again.
        assert (c.gen.migrations, c.gen.reroutes) == (len(PROMPTS), 0)
        await assert_kv_freed(c)


async def test_last_node_dying_ends_the_request_clearly(tiny_model: Path) -> None:
    async with cluster(tiny_model, [30.0], ready_timeout_s=1.0) as c:
        gen = c.gen
        with pytest.raises(GenerationError) as info:
            await collect(gen, PROMPTS[1], 200, lambda n: n == 3 and c.nursery.start_soon(c.kill, "n0"))
        assert info.value.code == "node_down"
        assert "n0 went down" in str(info.value) and "no pipeline of live nodes" in str(info.value)
        assert gen.active_sessions == 0


async def test_reroutes_are_bounded(tiny_model: Path) -> None:
    async with cluster(tiny_model, [30.0, 20.0, 10.0], max_reroutes=2) as c:
        gen = c.gen
        plan = c.coord.deployment.plan  # type: ignore[union-attr]
        assert plan is not None
        routes: list[list[Hop]] = []

        async def broken_route(exclude: set[NodeId]) -> list[Hop]:
            # Every stage asks for the layers of the one after it: the first stage refuses every item.
            stages = list(plan.shards)
            routes.append([Hop(peer=s.peer, first_layer=t.first_layer, last_layer=t.last_layer)
                           for s, t in zip(stages, stages[1:] + stages[:1], strict=True)])
            return routes[-1]

        gen.route_for = broken_route
        with pytest.raises(GenerationError) as info:
            await collect(gen, PROMPTS[0], 8)
        assert info.value.status == 502 and info.value.code == "stage_failed"
        assert "giving up after 2 re-routes" in str(info.value)
        assert len(routes) == 3 and gen.reroutes == 2
        assert gen.active_sessions == 0
        # The route source is the only thing that was broken.
        gen.route_for = None  # back to the scheduler's routes
        assert await collect(gen, PROMPTS[0], 4)


async def test_a_node_down_is_masked_not_the_whole_plan(tiny_model: Path, undisturbed: dict[int, list[int]]) -> None:
    """Three replicas; one dies and no re-plan follows: the scheduler masks the dead node and every new request
    is served by the other two at once, instead of waiting for a plan without it."""
    async with cluster(tiny_model, [30.0, 20.0, 10.0], method="helix") as c:
        deployment = c.coord.deployment
        assert deployment is not None
        plan = deployment.serving
        layers = c.gen.model_config.num_layers
        assert plan is not None and sorted((s.first_layer, s.last_layer) for s in plan.shards) == [(0, layers)] * 3
        deployment.debounce_s = 3600  # no re-plan: only the mask keeps requests off the dead node
        await c.kill("n0")
        with trio.fail_after(30):
            while "n0" not in plan.scheduler.down:
                await deployment._changed.wait()
        got: dict[int, list[int]] = {}

        async def one(i: int, p: list[int]) -> None:
            got[i] = await collect(c.gen, p, MAX_TOKENS)

        async with trio.open_nursery() as nursery:
            for i, p in enumerate(PROMPTS):
                nursery.start_soon(one, i, p)
        assert got == undisturbed
        assert deployment.plan is plan and c.gen.reroutes == 0


async def test_a_moved_request_shows_its_move_in_its_trace_and_in_the_metrics(
        tiny_model: Path, undisturbed: dict[int, list[int]]) -> None:
    async with cluster(tiny_model, [30.0, 20.0, 10.0]) as c:
        params = GenerationParams(max_tokens=MAX_TOKENS, sampling=SamplingParams(), trace_id="moved-1")
        out: list[int] = []
        async with c.gen.generate(PROMPTS[1], params) as events:
            async for e in events:
                out.append(e.token)
                if len(out) == 3:
                    await c.kill("n1")
        assert out == undisturbed[1]
        trace = c.gen.traces.get("moved-1")
        assert trace is not None and trace.status == "completed" and trace.completion_tokens == len(out)
        first, second = trace.sessions
        [move] = trace.moves
        assert move["kind"] == "reprefill" and "n1" in move["reason"]
        assert (move["from_session"], move["to_session"]) == (first.session, second.session)
        assert move["recomputed_tokens"] == len(PROMPTS[1]) + 3
        assert (first.end, second.end) == ("moved", "finished")
        assert "n1" not in {h["node"] for p in second.route["phases"] for h in p["hops"]}
        scrape = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(
            generate_latest(CoordinatorMetrics(c.coord).registry).decode()) for s in f.samples}
        assert scrape[("hetnode_request_moves_total", (("kind", "reprefill"),))] == 1
        assert scrape[("hetnode_request_moves_total", (("kind", "with_kv"),))] == 0
        assert scrape[("hetnode_move_recomputed_tokens_total", (("kind", "reprefill"),))] == len(PROMPTS[1]) + 3
        assert scrape[("hetnode_replans_total", (("reason", "node_lost"),))] >= 1
