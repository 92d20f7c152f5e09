"""A node's hop server against the peers around it: who may send what, positions, leases, malformed frames.

Real HopServers with real engines (a tiny random-weight Llama split over two nodes) on the memory transport. The
coordinator and a hostile admitted member are raw peers of the test, so every message is exactly what the test
says, and every answer (tokens, failures, error replies) is seen as it arrives.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
import trio.testing
from raw_peer import RawPeer

from hetnode.coordinator.generation import GenerationParams
from hetnode.coordinator.local import LocalGenerator
from hetnode.errors import StreamClosed, StreamReset
from hetnode.ids import NodeId
from hetnode.models.resolve import load_config
from hetnode.models.tiny import write_tiny_model
from hetnode.node.engine import SamplingParams
from hetnode.node.hops import HopServer
from hetnode.protocol.memory import MemoryNetwork
from hetnode.protocol.messages import (
    Assignment,
    AssignmentStatus,
    ErrorReply,
    Failed,
    Hop,
    Install,
    Item,
    Items,
    Release,
    Renew,
    Sampling,
    Token,
    Tokens,
    infer_decoder,
)
from hetnode.protocol.routes import pipeline_route
from hetnode.protocol.tensors import to_wire, token_tensor

PROMPT = [5, 6, 7, 8, 9, 10, 11]
MEMBERS = {"coord", "evil", "n0", "n1"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama") / "m", "llama")


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> list[int]:
    async def run() -> list[int]:
        async with LocalGenerator.open(tiny_model) as local, local.generate(
                PROMPT, GenerationParams(max_tokens=12, sampling=SamplingParams())) as events:
            return [e.token async for e in events]

    return trio.run(run)


@dataclass
class Net:
    coord: RawPeer
    evil: RawPeer
    n0: HopServer
    n1: HopServer
    hops: list[Hop]


@asynccontextmanager
async def network(model: Path) -> AsyncIterator[Net]:
    layers = load_config(model).num_layers
    cut = layers // 2
    net = MemoryNetwork()
    async with trio.open_nursery() as nursery, net.transport("coord") as ct, net.transport("evil") as et, \
            net.transport("n0") as t0, net.transport("n1") as t1:
        servers = []
        for t, (a, b) in ((t0, (0, cut)), (t1, (cut, layers))):
            hops = HopServer(t, lambda peer: peer in MEMBERS)
            hops.is_coordinator = lambda peer: peer == "coord"
            await nursery.start(hops.run)

            async def report(status: AssignmentStatus) -> None:
                assert status.state != "failed", status.detail

            await hops.assign(Assignment(plan_version=1, model=str(model), first_layer=a, last_layer=b,
                                         role="mixed"), report)
            servers.append(hops)
        route = [Hop(peer="n0", first_layer=0, last_layer=cut), Hop(peer="n1", first_layer=cut, last_layer=layers)]
        yield Net(RawPeer(ct), RawPeer(et), servers[0], servers[1], route)
        nursery.cancel_scope.cancel()


def install(session: str, hops: list[Hop], *, max_tokens: int = 12, lease_s: float = 30.0) -> Install:
    return Install(session=session, route=pipeline_route(hops), sampling=Sampling(), prefill_end=len(PROMPT),
                   max_tokens=max_tokens, lease_s=lease_s)


def prompt_items(session: str, ids: list[int] = PROMPT, start: int = 0) -> tuple[Items, memoryview]:
    meta, raw = to_wire(token_tensor(ids))
    return Items(items=[Item(session, start, len(ids))], tensor=meta), raw


async def tokens_of(peer: RawPeer, session: str, n: int) -> list[int]:
    got: list[int] = []
    while len(got) < n:
        _, msg = await peer.next_of(Tokens)
        got += [t.token for t in msg.tokens if t.session == session]
    return got


async def test_the_nodes_decode_by_themselves_and_stop_at_max_tokens(tiny_model: Path, reference: list[int]) -> None:
    async with network(tiny_model) as net:
        await net.coord.send("n1", install("s", net.hops))
        await net.coord.send("n0", install("s", net.hops))
        await net.coord.send("n0", *prompt_items("s"))
        tokens: list[Token] = []
        while not tokens or not tokens[-1].last:
            peer, msg = await net.coord.next_of(Tokens)
            assert peer == "n1"  # only the last hop streams tokens
            tokens += msg.tokens
        assert [t.token for t in tokens] == reference
        assert [t.position for t in tokens] == list(range(len(PROMPT), len(PROMPT) + len(reference)))
        assert net.n0.load().tokens_per_s > 0 and net.n1.load().tokens_per_s > 0  # what swarm's scheduler reads
        await trio.testing.wait_all_tasks_blocked()
        assert net.coord.inbox.statistics().current_buffer_used == 0  # nothing after the last token
        for hops in (net.n0, net.n1):
            await net.coord.send(hops.transport.peer_id, Release(session="s"))
        await trio.testing.wait_all_tasks_blocked()
        for hops in (net.n0, net.n1):
            assert hops.loop is not None
            await hops.loop.wait_idle()
            assert not hops.sessions and hops.loop.kv.used_blocks == 0


async def test_items_before_their_install_wait_for_it(tiny_model: Path, reference: list[int]) -> None:
    async with network(tiny_model) as net:
        # n1 hears of the session only after n0 has already passed the prompt's hidden states on.
        await net.coord.send("n0", install("s", net.hops))
        await net.coord.send("n0", *prompt_items("s"))
        assert net.n0.loop is not None
        await trio.testing.wait_all_tasks_blocked()
        await net.n0.loop.wait_idle()  # n0 ran the prompt ...
        await trio.testing.wait_all_tasks_blocked()  # ... and its outbox delivered the result
        assert "s" in net.n1._parked
        await net.coord.send("n1", install("s", net.hops))
        assert await tokens_of(net.coord, "s", len(reference)) == reference


async def test_items_waiting_for_their_install_are_bounded_in_bytes(tiny_model: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A member that sends items for sessions nobody installs cannot fill a node's memory."""
    monkeypatch.setattr("hetnode.node.hops._PARK_BYTES", 4 * 8)  # four int64 token ids
    async with network(tiny_model) as net:
        await net.evil.send("n0", *prompt_items("a", [1, 2, 3]))
        await net.evil.send("n0", *prompt_items("b", [4, 5]))  # 3 + 2 ids: over the bound
        _, reply = await net.evil.next_of(ErrorReply)
        assert reply.code == "unknown_session" and "session b" in reply.message
        assert list(net.n0._parked) == ["a"] and net.n0._parked_bytes == 3 * 8
        await net.coord.send("n0", Release(session="a"))  # the coordinator frees what waited, bytes too
        await trio.testing.wait_all_tasks_blocked()
        assert not net.n0._parked and net.n0._parked_bytes == 0


async def test_a_hostile_member_cannot_touch_another_peers_session(tiny_model: Path, reference: list[int],
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "hetnode.node.hops")
    async with network(tiny_model) as net:
        for node in ("n1", "n0"):
            await net.coord.send(node, install("s", net.hops))
        await net.coord.send("n0", *prompt_items("s"))
        want = await tokens_of(net.coord, "s", len(reference))
        assert want == reference
        await trio.testing.wait_all_tasks_blocked()
        before = {h.transport.peer_id: (h.sessions["s"].next_start, h.loop.kv_usage()) for h in (net.n0, net.n1)
                  if h.loop is not None}
        hidden = torch.zeros(1, load_config(tiny_model).hidden_size)
        at = net.n1.sessions["s"].next_start
        meta, raw = to_wire(hidden)
        attacks: list[tuple[str, Any, Any]] = [
            ("n1", Items(items=[Item("s", at, 1)], tensor=meta), raw),  # not n1's previous hop
            ("n1", Items(items=[Item("s", 0, 1)], tensor=meta), raw),  # a rewind
            ("n0", *prompt_items("s", [1, 2, 3], 0)),  # the context again, not from the coordinator
            ("n0", *prompt_items("s", [1], net.n0.sessions["s"].next_start)),  # a decode token, not from n1
            ("n0", install("s", net.hops), None),  # overwrite the session's route
            ("n0", install("other", net.hops), None),  # only the coordinator installs
            ("n1", Release(session="s"), None),  # only the installing coordinator releases
            ("n1", Renew(sessions=["s"]), None),  # ignored, not an error: renewing does no harm... but not ours
        ]
        for node, msg, payload in attacks:
            await net.evil.send(node, msg, payload)
        replies = []
        for _ in range(7):
            peer, reply = await net.evil.next_of(ErrorReply)
            replies.append((peer, reply.code))
        assert sorted(replies) == sorted([("n1", "refused"), ("n1", "refused"), ("n0", "refused"), ("n0", "refused"),
                                          ("n0", "not_coordinator"), ("n0", "not_coordinator"),
                                          ("n1", "not_yours")])
        await trio.testing.wait_all_tasks_blocked()
        after = {h.transport.peer_id: (h.sessions["s"].next_start, h.loop.kv_usage()) for h in (net.n0, net.n1)
                 if h.loop is not None}
        assert after == before  # no KV touched, no position moved
        assert "other" not in net.n0.sessions
        assert not any(isinstance(m, Tokens | Failed) for _, m in _drain(net.coord))  # the session ran on quietly


async def test_a_malformed_frame_gets_an_error_reply_and_a_reset_stream(tiny_model: Path) -> None:
    async with network(tiny_model) as net:
        await net.coord.send("n0", install("s", net.hops))
        meta, raw = to_wire(token_tensor([1, 2, 3]))
        # Two positions announced, three token ids sent.
        framed = await net.evil.send("n0", Items(items=[Item("s", 0, 2)], tensor=meta), raw)
        reply = await framed.receive_msg(infer_decoder)
        assert isinstance(reply, ErrorReply) and reply.code == "bad_message" and "3" in reply.message
        with pytest.raises((StreamClosed, StreamReset)):
            while await framed.receive_msg(infer_decoder) is not None:
                pass
            raise StreamClosed("ended")
        assert net.n0.sessions["s"].next_start == 0  # untouched
        # Hidden states where a first hop takes token ids: the whole frame is wrong.
        net.evil.out.clear()  # a new stream: the last one was reset
        meta, raw = to_wire(torch.zeros(2, 4))
        framed = await net.evil.send("n0", Items(items=[Item("s", 0, 2)], tensor=meta), raw)
        reply = await framed.receive_msg(infer_decoder)
        assert isinstance(reply, ErrorReply) and reply.code == "bad_message" and "token ids" in reply.message


async def test_a_session_whose_coordinator_goes_silent_is_freed(tiny_model: Path, mock_clock: trio.testing.MockClock,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "hetnode.node.hops")
    async with network(tiny_model) as net:
        for node in ("n1", "n0"):
            await net.coord.send(node, install("s", net.hops, max_tokens=4, lease_s=5.0))
            await net.coord.send(node, install("kept", net.hops, max_tokens=4, lease_s=5.0))
        await net.coord.send("n0", *prompt_items("s"))
        await net.coord.send("n0", *prompt_items("kept"))
        assert len(await tokens_of(net.coord, "s", 4)) == 4
        # Time moves only when the test says so (the engine's steps run on real time in their thread).
        for _ in range(4):  # the coordinator keeps renewing "kept" only
            mock_clock.jump(2.0)
            await trio.testing.wait_all_tasks_blocked()
            for node in ("n0", "n1"):
                await net.coord.send(node, Renew(sessions=["kept"]))
            await trio.testing.wait_all_tasks_blocked()
        for hops in (net.n0, net.n1):
            assert set(hops.sessions) == {"kept"}
            assert hops.leases_expired == 1 and hops.load().leases_expired == 1
        assert "lease expired" in caplog.text
        mock_clock.jump(10.0)
        await trio.testing.wait_all_tasks_blocked()
        for hops in (net.n0, net.n1):
            assert not hops.sessions and hops.loop is not None
            await hops.loop.wait_idle()
            assert hops.loop.kv.used_blocks == 0  # nothing leaked


async def test_a_refused_install_fails_only_its_own_session(tiny_model: Path, reference: list[int]) -> None:
    async with network(tiny_model) as net:
        bad = [Hop(peer="n0", first_layer=0, last_layer=1), Hop(peer="n1", first_layer=1, last_layer=99)]
        await net.coord.send("n0", install("bad", bad))
        for node in ("n1", "n0"):
            await net.coord.send(node, install("good", net.hops))
        await net.coord.send("n0", *prompt_items("good"))
        peer, failed = await net.coord.next_of(Failed)
        assert peer == "n0" and failed.session == "bad" and "layers" in failed.reason
        assert await tokens_of(net.coord, "good", len(reference)) == reference


def _drain(peer: RawPeer) -> list[tuple[NodeId, Any]]:
    out = []
    while True:
        try:
            out.append(peer.inbox.receive_nowait())
        except trio.WouldBlock:
            return out




def test_a_node_takes_splitwise_machine_batching_from_its_command_line(tmp_path: Path) -> None:
    import argparse

    from hetnode.cli import build_parser
    from hetnode.policy import BatchConfig, BatchPolicy, KVLedger
    from hetnode.policy.machine_batching import SplitwiseBatchPolicy, batch_policy_for
    from hetnode.testnet.launcher import NodeSpec, join_args

    up = build_parser().parse_args(["testnet", "up", "--batching", "splitwise"])
    cmd = join_args(argparse.Namespace(log_level="info", compute_dilation=None, batching=up.batching),
                    NodeSpec("n0", "cpu", "r1", 8.0), "/ip4/127.0.0.1/tcp/4001/p2p/x", tmp_path, [])
    args = build_parser().parse_args([*cmd, "--prompt-tokens", "512"])
    made = batch_policy_for(args.batching, args.prompt_tokens)(KVLedger(10, 16), BatchConfig())
    assert isinstance(made, SplitwiseBatchPolicy) and made.machine.prompt_tokens == 512
    assert batch_policy_for("shared") is BatchPolicy
    with pytest.raises(SystemExit):
        build_parser().parse_args([*cmd, "--batching", "fcfs"])
    with pytest.raises(ValueError, match="batching"):
        batch_policy_for("fcfs")


async def test_a_prefill_role_gives_the_nodes_steps_its_prompt_token_cap_and_a_flip_takes_it_away(
        tiny_model: Path) -> None:
    """The live side of role_batching: the role the assignment names sets BatchConfig.prompt_tokens, and a phase
    flip that keeps the layers (no reload) changes it in place."""
    layers = load_config(tiny_model).num_layers
    net = MemoryNetwork()

    async def report(status: AssignmentStatus) -> None:
        assert status.state != "failed", status.detail

    async with trio.open_nursery() as nursery, net.transport("n0") as t0:
        hops = HopServer(t0, lambda peer: peer in MEMBERS, prefill_tokens=64)
        await nursery.start(hops.run)
        for version, role, cap in ((1, "prefill", 64), (2, "decode", None), (3, "prefill", 64)):
            await hops.assign(Assignment(plan_version=version, model=str(tiny_model), first_layer=0,
                                         last_layer=layers, role=role), report)
            assert hops.loop is not None and hops.loop.policy.config.prompt_tokens == cap
        # The node's own --prefill-tokens wins over the cap the coordinator names.
        await hops.assign(Assignment(plan_version=4, model=str(tiny_model), first_layer=0, last_layer=layers,
                                     role="prefill", prompt_tokens=1024), report)
        assert hops.loop is not None and hops.loop.policy.config.prompt_tokens == 64
        nursery.cancel_scope.cancel()


async def test_without_a_setting_of_its_own_a_node_takes_the_cap_its_assignment_names(tiny_model: Path) -> None:
    layers = load_config(tiny_model).num_layers
    net = MemoryNetwork()

    async def report(status: AssignmentStatus) -> None:
        assert status.state != "failed", status.detail

    async with trio.open_nursery() as nursery, net.transport("n0") as t0:
        hops = HopServer(t0, lambda peer: peer in MEMBERS)
        await nursery.start(hops.run)
        for version, role, cap in ((1, "prefill", 96), (2, "decode", None), (3, "prefill", 128)):
            await hops.assign(Assignment(plan_version=version, model=str(tiny_model), first_layer=0,
                                         last_layer=layers, role=role, prompt_tokens=cap), report)
            assert hops.loop is not None and hops.loop.policy.config.prompt_tokens == cap
        nursery.cancel_scope.cancel()
