"""Phase-split serving when a node dies: the request moves (re-prefill) and completes unchanged.

A 4-node testnet serves SmolLM2 with `--placement split` (fp16 KV). A decode node killed the moment the first
token reaches the client (its KV is arriving, or it has just started decoding), and a prefill node killed while
it prefills a long prompt: either way the coordinator moves the request to a route of live nodes, re-prefilling
what it had, and the client sees one stream whose greedy text equals an undisturbed run.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from testnet_helpers import start_testnet, stop_testnet, wait_for_ready_plan

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"


def completion(api: str, prompt: str, max_tokens: int, on_headers: Any = None) -> str:
    """The streamed text; `on_headers(route)` runs when the first token's headers arrive (x-hetnode-route)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text = []
    with httpx.stream("POST", f"{api}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        if on_headers is not None:
            on_headers(r.headers.get("x-hetnode-route", ""))
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            text.append(event["choices"][0]["text"])
    return "".join(text)


def pid_of(state: dict[str, Any], name: str) -> int:
    return int(next(p["pid"] for p in state["procs"] if p["name"] == name))


def phase_nodes(route: str) -> dict[str, str]:
    """{"prefill": node, "decode": node} from a route header like 'prefill: node-1 [0,30) | decode: node-0 [0,30)'."""
    out = {}
    for part in route.split(" | "):
        kind, hops = part.split(": ", 1)
        out[kind] = hops.split(" ")[0]
    return out


def wait_for_line(path: Path, needle: str, after: int, timeout_s: float = 60) -> None:
    """Until the log has a line with `needle` past byte `after` (a readiness signal the coordinator writes)."""
    deadline = time.monotonic() + timeout_s
    while needle not in path.read_text()[after:]:
        assert time.monotonic() < deadline, f"no {needle!r} in {path}"
        time.sleep(0.02)


@pytest.fixture
def testnet(tmp_path: Path) -> Any:
    state = start_testnet(tmp_path / "tn", MODEL, nodes=4, extra=("--placement", "split", "--kv-codec", "fp16"))
    try:
        wait_for_ready_plan(state["api"], nodes=4)
        yield state, tmp_path / "tn" / "logs" / "coordinator.log"
    finally:
        stop_testnet(tmp_path / "tn")


def test_a_decode_node_killed_at_the_first_token_the_request_moves_and_completes(testnet: Any) -> None:
    state, log = testnet
    api, prompt = state["api"], "Write a haiku about the sea."
    want = completion(api, prompt, 40)
    victims: list[str] = []

    def kill_decode(route: str) -> None:
        victims.append(phase_nodes(route)["decode"])
        os.kill(pid_of(state, victims[0]), signal.SIGKILL)

    assert completion(api, prompt, 40, kill_decode) == want
    text = log.read_text()
    assert "moved to" in text and victims[0] in text


def test_a_prefill_node_killed_mid_prompt_the_request_moves_and_completes(testnet: Any) -> None:
    state, log = testnet
    api = state["api"]
    prompt = "Once upon a time, in a land far away, " * 150  # about 1,500 tokens: seconds of prefill here
    want = completion(api, prompt, 12)
    plan = httpx.get(f"{api}/v1/plan", timeout=10).json()["plan"]
    # An idle CLS scheduler sends the request to the first prefill replica (ties go to the plan's order).
    victim = next(r["nodes"][0] for r in plan["replicas"] if r["role"] == "prefill")
    mark = len(log.read_text())
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(completion, api, prompt, 12)
        wait_for_line(log, "hands over the KV", mark)  # installed: the context goes out next
        os.kill(pid_of(state, victim), signal.SIGKILL)
        assert done.result(timeout=300) == want
    assert "moved to" in log.read_text()[mark:]


def test_a_decode_node_killed_mid_transfer_the_request_moves_and_completes(testnet: Any) -> None:
    """The decode node is killed once the route is installed: while the prefill node computes the prompt (seconds
    here) and sends it its KV."""
    state, log = testnet
    api = state["api"]
    prompt = "Once upon a time, in a land far away, " * 150
    want = completion(api, prompt, 12)
    plan = httpx.get(f"{api}/v1/plan", timeout=10).json()["plan"]
    victim = next(r["nodes"][0] for r in plan["replicas"] if r["role"] == "decode")
    mark = len(log.read_text())
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(completion, api, prompt, 12)
        wait_for_line(log, "hands over the KV", mark)
        os.kill(pid_of(state, victim), signal.SIGKILL)
        assert done.result(timeout=300) == want
    assert "moved to" in log.read_text()[mark:]
