"""Restarts on the multi-process testnet: the coordinator (SIGKILL, then the same command with its --state-dir)
and a node that crashes and comes straight back with the same identity.

The coordinator comes back as the same peer at the same addresses, with the same token; its nodes rejoin on
their own and it serves the plan they still hold (no shard reloads). A stream that was running when it died
ends with an error the client sees, and the nodes free that session's KV when its lease runs out. A node that
comes back before its heartbeat deadline replaces its old self: one member, and requests served correctly.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_serving_multiprocess import complete_text_str
from testnet_helpers import HETNODE, start_testnet, stop_testnet

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def restart(state_dir: Path, name: str) -> str:
    r = subprocess.run([*HETNODE, "testnet", "restart", name, "--kill", "--state-dir", str(state_dir)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def serve_again(api: str, deadline_s: float) -> tuple[str, float]:
    """The first completion that succeeds (after a start or a restart), and how long it took (the API answers 503 with a
    reason until a plan is ready; a refused connection means it is not listening yet)."""
    t0 = time.monotonic()
    last = ""
    while time.monotonic() - t0 < deadline_s:
        try:
            r = httpx.post(f"{api}/v1/completions", timeout=60, json={
                "model": "smollm2-135m", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
        except httpx.TransportError as exc:
            last = repr(exc)
        else:
            if r.status_code == 200:
                return str(r.json()["choices"][0]["text"]), time.monotonic() - t0
            assert r.status_code == 503, r.text  # not ready yet: anything else is a bug
            last = r.text
        time.sleep(0.2)  # polling a client-side deadline; the server side waits on readiness
    raise AssertionError(f"not serving {deadline_s} s after the restart: {last}")


def cluster(api: str) -> list[dict[str, Any]]:
    nodes: list[dict[str, Any]] = httpx.get(f"{api}/v1/cluster", timeout=10).json()["nodes"]
    return nodes


def test_coordinator_restart_keeps_identity_token_and_plan(tmp_path: Path) -> None:
    state_dir = tmp_path / "tn"
    state = start_testnet(state_dir, "smollm2-135m", nodes=2)
    try:
        api = state["api"]
        want, _ = serve_again(api, 180)  # the first plan's shards load (slowly on a loaded machine)
        before = httpx.get(f"{api}/v1/plan", timeout=10).json()["plan"]
        saved = json.loads((state_dir / "coordinator" / "state.json").read_text())
        assert saved["token"] == state["token"] and saved["plan"]["version"] == before["version"]
        assert os.stat(state_dir / "coordinator" / "state.json").st_mode & 0o077 == 0  # it holds secrets

        # A long stream is running when the coordinator dies: its client must see the end, not hang.
        outcome: dict[str, Any] = {}
        started = threading.Event()

        def long_stream() -> None:
            body = {"model": "smollm2-135m", "prompt": "Count from 1 to 500:", "max_tokens": 400,
                    "temperature": 0, "stream": True}
            try:
                with httpx.stream("POST", f"{api}/v1/completions", json=body, timeout=120) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            started.set()
                            if json.loads(line[6:])["choices"][0].get("finish_reason"):
                                outcome["finished"] = True
                outcome["ended"] = "without a finish_reason" if "finished" not in outcome else "finished"
            except httpx.TransportError as exc:
                outcome["ended"] = f"error: {exc!r}"
            finally:
                started.set()

        client = threading.Thread(target=long_stream)
        client.start()
        assert started.wait(120)
        t0 = time.monotonic()
        restart(state_dir, "coordinator")
        restarted_at = time.monotonic()
        client.join(60)
        assert not client.is_alive(), "the client of the killed coordinator hangs"
        assert outcome.get("ended") != "finished", outcome  # it was cut: the client saw an error or a cut stream

        text, waited = serve_again(api, 120)
        assert text == want
        print(f"coordinator restart: {restarted_at - t0:.1f} s to start again, serving {waited:.1f} s after it "
              f"was ready")
        after = httpx.get(f"{api}/v1/plan", timeout=10).json()["plan"]
        assert after["reason"] == "restored after a coordinator restart"
        assert after["version"] == before["version"] + 1
        assert [(s["peer_id"], s["first_layer"], s["last_layer"]) for s in after["shards"]] == \
            [(s["peer_id"], s["first_layer"], s["last_layer"]) for s in before["shards"]]
        # The nodes kept their shards: each loaded one once, before the restart.
        for p in state["procs"]:
            if p["role"] == "node":
                assert Path(p["log"]).read_text().count("serving layers") == 1, p["name"]

        # The dead coordinator's session expires on the nodes (a 30 s lease) and frees its KV.
        deadline = time.monotonic() + 90
        while any(n["load"]["kv_blocks_used"] or n["load"]["active_sessions"] for n in cluster(api)):
            assert time.monotonic() < deadline, cluster(api)
            time.sleep(0.5)
    finally:
        stop_testnet(state_dir)


def test_node_back_with_the_same_identity_replaces_its_old_self(tmp_path: Path) -> None:
    state_dir = tmp_path / "tn"
    state = start_testnet(state_dir, "smollm2-135m", nodes=2)
    try:
        api = state["api"]
        want, _ = serve_again(api, 180)
        victim = next(p for p in state["procs"] if p["name"] == "node-1")
        # Back long before its heartbeat deadline: the coordinator still has it as up when it rejoins.
        restart(state_dir, "node-1")
        members = [n for n in cluster(api) if n["peer_id"] == victim["peer_id"]]
        assert len(members) == 1 and members[0]["state"] == "up" and members[0]["joins"] == 2
        text, _ = serve_again(api, 120)
        assert text == want
        for _ in range(3):
            assert complete_text_str(api, PROMPT, 8) == want
        assert len(cluster(api)) == 2
    finally:
        stop_testnet(state_dir)
