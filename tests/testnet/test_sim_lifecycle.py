"""One lifecycle, two executors: the runtime's coordinator and the simulated one decide the same.

The same script of what a request's routes do (each route samples some tokens, then fails it for a cause, or
runs it to the end) goes through the runtime's `PipelineGenerator`, with a raw peer of the test as the route's
only hop that sends exactly the script's Tokens and Failed, and through `SimCoordinator`, whose last hop is
stepped by hand. Both must run the same routes (what each Install asks: prefill_end and max_tokens), give the
client the same tokens and end the same way: finished, refused, or given up after the last move.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from raw_peer import RawPeer
from sim_helpers import PROFILE

from hetnode.coordinator.deployment import Deployment
from hetnode.coordinator.generation import GenerationError, GenerationParams
from hetnode.coordinator.registry import Registry
from hetnode.coordinator.sessions import PipelineGenerator
from hetnode.ids import NodeId
from hetnode.models.resolve import load_config
from hetnode.models.tiny import write_tiny_model
from hetnode.models.tokenizer import load_tokenizer
from hetnode.node.engine import SamplingParams
from hetnode.policy import CAUSES, Cause
from hetnode.protocol.memory import MemoryNetwork
from hetnode.protocol.messages import (
    Failed,
    HardwareProfile,
    Hop,
    Install,
    Items,
    Join,
    Token,
    Tokens,
)
from hetnode.protocol.routes import pipeline_route
from hetnode.testnet.sim.coordinator import SimCoordinator, SimRequest
from hetnode.testnet.sim.node import SimNode

Attempt = tuple[int, Cause | None]  # tokens the route samples, then the cause it fails the request for (None: it
# runs the request to its end)
Outcome = tuple[list[tuple[int, int]], int, str]  # (each route's prefill_end and max_tokens, tokens, end)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama") / "m", "llama")


async def _runtime(model: Path, prompt_len: int, max_tokens: int, max_moves: int,
                   script: list[Attempt]) -> Outcome:
    cfg = load_config(model)
    net = MemoryNetwork()
    routes: list[tuple[int, int]] = []
    async with trio.open_nursery() as nursery, net.transport("coord") as ct, net.transport("hop") as ht:
        registry = Registry(token="t", heartbeat_deadline_s=60.0)
        profile = HardwareProfile(device="cpu", device_type="cpu", memory_bytes=8 << 30, matmul_tflops=0.1,
                                  mem_bandwidth_gbps=10.0, dtype="float32")
        assert registry.admit(NodeId("hop"), Join(token="t", name="hop", profile=profile, listen_addrs=[]),
                              now=trio.current_time(), wall=time.time()).admitted

        async def no_control(*args: Any) -> None:
            raise AssertionError("the deployment does not run here")

        deployment = Deployment(registry, no_control, model=str(model), model_config=cfg,  # type: ignore[arg-type]
                                coordinator=NodeId("coord"))
        gen = PipelineGenerator(ct, registry, deployment, model_name=str(model), model_config=cfg,
                                tokenizer=load_tokenizer(model), max_reroutes=max_moves, step_timeout_s=30.0)

        async def the_hop(exclude: set[NodeId]) -> list[Hop]:
            return [Hop(peer="hop", first_layer=0, last_layer=cfg.num_layers)]

        gen.route_for = the_hop
        await nursery.start(gen.run)
        hop = RawPeer(ht)

        async def play() -> None:
            for k, cause in script:
                _, install = await hop.next_of(Install)
                await hop.next_of(Items)  # the context
                routes.append((install.prefill_end, install.max_tokens))
                n = install.max_tokens if cause is None else min(k, install.max_tokens)
                for i in range(n):
                    await hop.send("coord", Tokens(tokens=[Token(session=install.session,
                                                                 position=install.prefill_end + i, token=7,
                                                                 last=i + 1 == install.max_tokens)]))
                if cause is None or n == install.max_tokens:
                    return
                await hop.send("coord", Failed(session=install.session, hop_peer="hop", reason=f"{cause}!",
                                               cause=cause))

        got = 0
        end = "finished"
        nursery.start_soon(play)
        params = GenerationParams(max_tokens=max_tokens, sampling=SamplingParams())
        try:
            async with gen.generate([3] * prompt_len, params) as events:
                async for _ in events:
                    got += 1
        except GenerationError as exc:
            end = "refused" if exc.code == "kv_capacity_exceeded" else "gave up"
        nursery.cancel_scope.cancel()
    return routes, got, end


def _sim(prompt_len: int, max_tokens: int, max_moves: int, script: list[Attempt]) -> Outcome:
    routes: list[tuple[int, int]] = []

    class Decision:
        def __init__(self, request_id: str) -> None:
            self.request_id = request_id
            self.route = pipeline_route([Hop(peer="n", first_layer=0, last_layer=4)])
            self.queued = False

    class Scheduler:
        def submit(self, request_id: str, input_len: int, now: float) -> Decision:
            return Decision(request_id)

        def finish(self, request_id: str, output_len: int, now: float) -> list[Decision]:
            return []

        def cancel(self, request_id: str, now: float | None = None) -> list[Decision]:
            return []

    node = SimNode(0, "n", "x", PROFILE, 0, 4, kv_capacity_tokens=1 << 20, block_size=16, max_batch_tokens=512,
                   window=(0.0, 1e9), bin_s=1.0)

    def send(src: int, dst: int, items: list[Any], now: float) -> None:
        if dst == coord.index:
            coord.on_message(items, now)  # the step's tokens reach the coordinator
        else:
            routes.extend((r.prefill_end, r.output_len - r.gen) for r in items)  # a route's context

    coord = SimCoordinator(Scheduler(), [node], num_layers=4, send=send, send_ids=lambda *a: None,
                           release=lambda *a: None, block_size=16, window=(0.0, 1e9), bin_s=1.0,
                           max_reroutes=max_moves)
    r = SimRequest(0, 0.0, prompt_len, max_tokens)
    coord.arrive(r, 0.0)
    for k, cause in script:
        sampled = 0
        while r.done < 0 and not r.rejected and (cause is None or sampled < k):
            coord.at_last_hop(0, [r], 0.0)  # the route's last hop finished a step of the request's item
            sampled += 1
        if r.done >= 0 or r.rejected or cause is None:
            break
        coord.on_failed([(r, f"{cause}!", cause)], 0.0)
        if r.rejected:
            break
    end = "finished" if r.done >= 0 else "gave up" if "gave up" in r.rejected else "refused"
    return routes, r.received, end


_attempt = st.tuples(st.integers(0, 5), st.sampled_from(CAUSES))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(prompt_len=st.integers(1, 40), max_tokens=st.integers(1, 12), max_moves=st.integers(0, 3),
       failures=st.lists(_attempt, max_size=5))
def test_moves_refusals_and_ends_mirror_the_runtime(tiny_model: Path, prompt_len: int, max_tokens: int,
                                                    max_moves: int, failures: list[Attempt]) -> None:
    script: list[Attempt] = [*failures, (0, None)]
    runtime = trio.run(_runtime, tiny_model, prompt_len, max_tokens, max_moves, script)
    assert _sim(prompt_len, max_tokens, max_moves, script) == runtime


def test_the_mirror_covers_every_lifecycle_decision(tiny_model: Path) -> None:
    """A move after tokens, a move before any, a refusal; the bound on moves; a request run to its end."""
    cases = [
        (10, 8, 3, [(2, "lost"), (0, "preempted"), (3, "lost"), (0, None)], ([(10, 8), (12, 6), (12, 6), (15, 3)],
                                                                             8, "finished")),
        (10, 8, 3, [(2, "lost"), (1, "refused"), (0, None)], ([(10, 8), (12, 6)], 3, "refused")),
        (10, 8, 1, [(1, "preempted"), (1, "lost"), (0, None)], ([(10, 8), (11, 7)], 2, "gave up")),
    ]
    for prompt_len, max_tokens, max_moves, script, expected in cases:
        runtime = trio.run(_runtime, tiny_model, prompt_len, max_tokens, max_moves, script)
        assert runtime == expected
        assert _sim(prompt_len, max_tokens, max_moves, script) == expected
