"""A 3-node testnet serving real models over libp2p, against single-process transformers.

Greedy output through the testnet equals transformers `generate` on the same weights, token for token (SmolLM2
from its GGUF, and tiny random Llama and Qwen2 models), for prompts of several lengths sent concurrently;
32 concurrent streams all complete correctly with tokens arriving as they are produced; when the last node
serving is killed mid-request, the request ends with a clear error instead of a hang (with nodes left, it moves
and completes: test_failover_multiprocess.py).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from testnet_helpers import check_against_transformers, complete_ids, start_testnet, stop_testnet, wait_for_ready_plan

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol_testnet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    state_dir = tmp_path_factory.mktemp("smol")
    state = start_testnet(state_dir, "smollm2-135m")
    try:
        wait_for_ready_plan(state["api"], nodes=3)
        yield state
    finally:
        stop_testnet(state_dir)


def test_smollm2_greedy_matches_transformers(smol_testnet: dict[str, Any], smollm2_transformers: Any) -> None:
    from hetnode.models.tokenizer import chat_prompt_ids, load_tokenizer

    hf = smollm2_transformers
    tok = load_tokenizer("smollm2-135m")
    prompts = [
        chat_prompt_ids(tok, [{"role": "user", "content": "What is the capital of France?"}]),
        tok.encode("The three primary colors are"),
        tok.encode("Once upon a time, " * 12),
        tok.encode("def fibonacci(n):"),
    ]
    check_against_transformers(smol_testnet["api"], "smollm2-135m", hf, tok, prompts, 24)
    plan = httpx.get(f"{smol_testnet['api']}/v1/plan", timeout=10).json()["plan"]
    assert len(plan["shards"]) == 3 and plan["ready"]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_models_greedy_match_transformers(arch: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hetnode.models.tiny import write_tiny_model

    model_dir = write_tiny_model(tmp_path / arch, arch)
    # Two nodes: each holds the whole tiny model (a third is one more replica, as 3 nodes' plan was: each [0, 5)),
    # so the four prompts still share a node's batches; the pipelines of several stages are the split tests'.
    state = start_testnet(tmp_path / "tn", str(model_dir), nodes=2)
    try:
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        prompts = [[5, 6, 7], list(range(20, 45)), list(range(100, 170)), [9] * 11]
        check_against_transformers(state["api"], str(model_dir), hf, tok, prompts, 16)
    finally:
        stop_testnet(tmp_path / "tn")


def stream(api: str, prompt: str, max_tokens: int,
           on_chunk: Callable[[int], None] | None = None) -> tuple[str, list[float], str | None]:
    """Text, arrival time of each content chunk, and the error event if any; on_chunk(n) after the n-th chunk."""
    pieces: list[str] = []
    times: list[float] = []
    error = None
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{api}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]["message"]
                continue
            text = event["choices"][0]["text"]
            if text:
                pieces.append(text)
                times.append(time.monotonic())
                if on_chunk is not None:
                    on_chunk(len(pieces))
    return "".join(pieces), times, error


def test_32_concurrent_streams(smol_testnet: dict[str, Any]) -> None:
    api = smol_testnet["api"]
    prompts = [f"Count from {i} to {i + 5}:" for i in range(32)]
    want = {p: complete_text_str(api, p, 12) for p in prompts[:4]}
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda p: stream(api, p, 12), prompts))
    for prompt, (text, times, error) in zip(prompts, results, strict=True):
        assert error is None
        assert text
        if prompt in want:
            assert text == want[prompt]
        # Tokens arrive as they are produced: several separate chunks, in order, not one at the end.
        assert len(times) > 1 and times == sorted(times)


def complete_text_str(api: str, prompt: str, max_tokens: int) -> str:
    r = httpx.post(f"{api}/v1/completions", timeout=300, json={
        "model": "smollm2-135m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def test_last_node_killed_mid_request_gives_a_clear_error(tmp_path: Path) -> None:
    state = start_testnet(tmp_path / "tn", "smollm2-135m", nodes=1, extra=("--route-wait", "5"))
    try:
        api = state["api"]
        # The plan is ready once a request is served; each try waits up to --route-wait for it.
        for _ in range(24):
            r = httpx.post(f"{api}/v1/completions", timeout=60, json={
                "model": "smollm2-135m", "prompt": "Hello", "max_tokens": 2, "temperature": 0})
            if r.status_code != 503:
                break
        assert r.status_code == 200, r.text
        victim = next(p for p in state["procs"] if p["name"] == "node-0")

        def kill_after_three(n: int) -> None:
            if n == 3:
                os.kill(victim["pid"], signal.SIGKILL)

        # No live pipeline is left to move the request to: after a bounded wait for one, a clear error.
        text, _, error = stream(api, "1, 2, 3, 4, 5, 6, 7,", 400, kill_after_three)
        assert error is not None and "node-0" in error and "no pipeline of live nodes" in error, (error, text)
        assert "within 5 s" in error, error
        # Afterwards the API answers with a clear status, not a hang.
        r2 = httpx.post(f"{api}/v1/completions", timeout=120, json={
            "model": "smollm2-135m", "prompt": "Hi", "max_tokens": 2, "temperature": 0})
        assert r2.status_code == 503, r2.text
    finally:
        stop_testnet(tmp_path / "tn")


async def test_a_hostile_admitted_member_disturbs_no_other_request(smol_testnet: dict[str, Any]) -> None:
    """An admitted member (right token, real libp2p peer) that holds no layers attacks every node's data path while
    four greedy streams run: it tries to install a session (only the coordinator may), release one, feed items for
    a session that is not its own, and sends a malformed frame. Each node answers with an error (the malformed
    frame also resets the stream), and every stream completes with exactly the tokens of an undisturbed run."""
    import trio

    from hetnode.ids import NodeId
    from hetnode.node.daemon import NodeConfig, NodeDaemon
    from hetnode.protocol.framing import FramedStream
    from hetnode.protocol.identity import load_or_create_identity
    from hetnode.protocol.libp2p_transport import open_libp2p_transport
    from hetnode.protocol.messages import (
        INFER_PROTOCOL,
        ErrorReply,
        HardwareProfile,
        Hop,
        Install,
        Item,
        Items,
        Release,
        Sampling,
        infer_decoder,
    )
    from hetnode.protocol.routes import pipeline_route
    from hetnode.protocol.tensors import to_wire, token_tensor

    api = smol_testnet["api"]
    prompts = [[1, 510, 3575, 282, 4649, 314], [1, 9519, 2843, 28, 253, 655], list(range(200, 240)), [1, 7, 8, 9]]

    async def complete(prompt: list[int]) -> list[int]:
        return await trio.to_thread.run_sync(complete_ids, api, prompt, 24, "smollm2-135m")

    async def all_streams() -> list[list[int]]:
        out: list[list[int]] = [[] for _ in prompts]

        async def one(i: int) -> None:
            out[i] = await complete(prompts[i])

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        return out

    want = await all_streams()
    nodes = [NodeId(p["peer_id"]) for p in smol_testnet["procs"] if p["role"] == "node"]
    replies: list[tuple[str, str]] = []
    all_refused = trio.Event()  # every node refused our Install
    weak = HardwareProfile(device="cpu", device_type="cpu", memory_bytes=1 << 20, matmul_tflops=0.01,
                           mem_bandwidth_gbps=1, dtype="float32")  # too small for a layer: it stays idle
    async with open_libp2p_transport(load_or_create_identity(None), ["/ip4/127.0.0.1/tcp/0"]) as transport, \
            trio.open_nursery() as nursery:

        async def collect(stream: Any) -> None:  # what the nodes' outboxes send back to us
            framed = FramedStream(stream)
            while (msg := await framed.receive_msg(infer_decoder)) is not None:
                if isinstance(msg, ErrorReply):
                    replies.append((str(stream.remote_peer), msg.code))
                    if len({p for p, c in replies if c == "not_coordinator"}) == len(nodes):
                        all_refused.set()

        transport.set_handler(INFER_PROTOCOL, collect)
        evil = NodeDaemon(NodeConfig(bootstrap=(smol_testnet["bootstrap"],), token=smol_testnet["token"],
                                     name="evil", profile=weak), transport)
        await nursery.start(evil.run)

        async def attack(node: NodeId) -> str:
            """The reply to the malformed frame; before it, refused messages on the same stream. (The node knows
            us as a member by then: the coordinator pushes the membership before it welcomes us, and a node
            waits for the push that names a peer it does not know yet.)"""
            with trio.fail_after(60):
                framed = FramedStream(await transport.open_stream(node, INFER_PROTOCOL))
                hop = Hop(peer=str(node), first_layer=0, last_layer=30)
                await framed.send_msg(Install(session="evil-s", route=pipeline_route([hop]), sampling=Sampling(),
                                              prefill_end=3, max_tokens=4, lease_s=30))
                await framed.send_msg(Release(session="s0-000000000000"))
                meta, raw = to_wire(token_tensor([1, 2, 3]))
                await framed.send_with_payload(Items(items=[Item("s1-000000000000", 0, 3)], tensor=meta), raw)
                await framed.send_with_payload(Items(items=[Item("evil-s", 0, 2)], tensor=meta), raw)
                reply = await framed.receive_msg(infer_decoder)
                assert isinstance(reply, ErrorReply)
                return reply.code

        codes: list[str] = []

        async def attack_all() -> None:
            for node in nodes:
                codes.append(await attack(node))

        got: list[list[int]] = []

        async def streams() -> None:
            got.extend(await all_streams())

        async with trio.open_nursery() as inner:
            inner.start_soon(attack_all)
            inner.start_soon(streams)
        with trio.fail_after(30):  # the refusals travel on the nodes' own streams back to us
            await all_refused.wait()
        nursery.cancel_scope.cancel()
    assert codes == ["bad_message"] * len(nodes)
    assert got == want
