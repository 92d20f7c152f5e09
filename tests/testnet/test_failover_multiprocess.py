"""A node killed while a batch of streams runs through it: every request moves and completes unchanged.

A 3-node testnet serves SmolLM2; several greedy streaming requests run concurrently; one node gets SIGKILL while
they stream. The coordinator re-plans over the two nodes left, moves each request to the new pipeline by
re-prefilling its prompt plus the tokens it has generated, and every client sees one uninterrupted stream whose
text equals the undisturbed greedy run (taken on the same testnet before the kill).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from test_serving_multiprocess import complete_text_str, stream
from testnet_helpers import start_testnet, stop_testnet, wait_for_ready_plan

pytestmark = pytest.mark.slow

PROMPTS = [
    "Count from 1 to 20:",
    "The three primary colors are",
    "Once upon a time, " * 6,
    "def fibonacci(n):",
    "Write a haiku about the sea.",
]
MAX_TOKENS = 48


@pytest.mark.parametrize("victim", ["node-1"])
def test_node_killed_during_concurrent_streams_every_request_completes(tmp_path: Path, victim: str) -> None:
    state = start_testnet(tmp_path / "tn", "smollm2-135m")
    try:
        api = state["api"]
        wait_for_ready_plan(api, nodes=3)  # the victim in the plan, and two nodes to take its layers
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            want = list(pool.map(lambda p: complete_text_str(api, p, MAX_TOKENS), PROMPTS))
        pid = next(p["pid"] for p in state["procs"] if p["name"] == victim)
        killed_at: list[float] = []
        lock = threading.Lock()

        def kill_once(n: int) -> None:
            # Every stream is under way (the first chunk of each comes after the batch's prefill).
            with lock:
                if n == 4 and not killed_at:
                    os.kill(pid, signal.SIGKILL)
                    killed_at.append(time.monotonic())

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(lambda p: stream(api, p, MAX_TOKENS, kill_once), PROMPTS))
        assert killed_at, "the streams ended before the kill"
        for prompt, expected, (text, _, error) in zip(PROMPTS, want, results, strict=True):
            assert error is None, (prompt, error, text)
            assert text == expected, (prompt, text, expected)
        # Streams were cut mid-way by the kill and went on after it.
        assert any(times[0] < killed_at[0] < times[-1] for _, times, _ in results)
        plan = httpx.get(f"{api}/v1/plan", timeout=10).json()["plan"]
        assert plan["ready"] and victim not in [s["name"] for s in plan["shards"]]
    finally:
        stop_testnet(tmp_path / "tn")
