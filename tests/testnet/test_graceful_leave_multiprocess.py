"""A graceful leave under load: SIGTERM on a node that decodes for several streams moves every one of them, KV and
all, to nodes that stay. Every stream completes with the greedy text of an undisturbed run, and no request was
re-prefilled (the coordinator counts moves with and without KV in GET /v1/cluster)."""

from __future__ import annotations

import collections
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from test_split_failover_multiprocess import completion, phase_nodes, pid_of
from testnet_helpers import start_testnet, stop_testnet, wait_for_ready_plan

pytestmark = pytest.mark.slow

PROMPTS = [
    "Count from 1 to 20:",
    "The three primary colors are",
    "Once upon a time, " * 6,
    "def fibonacci(n):",
    "Write a haiku about the sea.",
    "List the planets of the solar system:",
    "The capital of France is",
    "Explain what a prime number is.",
]
MAX_TOKENS = 48


def test_sigterm_on_a_decode_node_moves_every_stream_with_its_kv(tmp_path: Path) -> None:
    state = start_testnet(tmp_path / "tn", "smollm2-135m", nodes=4,
                          extra=("--placement", "split", "--kv-codec", "fp16"))
    try:
        api = state["api"]
        wait_for_ready_plan(api, nodes=4)  # the victim's streams need another decode node to move to
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            want = list(pool.map(lambda p: completion(api, p, MAX_TOKENS), PROMPTS))
        before = httpx.get(f"{api}/v1/cluster", timeout=10).json()["moves"]
        routes: list[str] = []
        victim: list[str] = []
        lock = threading.Lock()

        def on_headers(route: str) -> None:
            # Once every stream has its first token, the node that decodes for most of them gets SIGTERM.
            with lock:
                routes.append(phase_nodes(route)["decode"])
                if len(routes) == len(PROMPTS):
                    victim.append(collections.Counter(routes).most_common(1)[0][0])
                    os.kill(pid_of(state, victim[0]), signal.SIGTERM)

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: completion(api, p, MAX_TOKENS, on_headers), PROMPTS))
        assert victim, "the streams ended before the leave"
        assert got == want
        after = httpx.get(f"{api}/v1/cluster", timeout=10).json()["moves"]
        assert after["reprefilled"] == before["reprefilled"]  # nothing was re-prefilled
        assert after["with_kv"] - before["with_kv"] >= 1  # and the victim's streams moved with their KV
        log = (tmp_path / "tn" / "logs" / "coordinator.log").read_text()
        assert "moved with its KV" in log and "re-prefilling" not in log
    finally:
        stop_testnet(tmp_path / "tn")
