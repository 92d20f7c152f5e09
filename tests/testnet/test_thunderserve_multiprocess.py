"""ThunderServe on a multi-process testnet (`--placement thunderserve`): the coordinator runs ThunderServe's search
over the live members' profiles and probed links, routes each request to a prefill and a decode group by the
plan's orchestration (tstp), and the KV moves between them. With the fp16 codec the greedy output equals
transformers' on the same weights. A decode node killed: the coordinator reschedules lightly (§3.4): the
surviving groups keep their layers (no node reloads anything) and the next requests are served at once, with the
same text.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_split_failover_multiprocess import completion, pid_of
from testnet_helpers import check_against_transformers, start_testnet, stop_testnet, wait_for_ready_plan

pytestmark = pytest.mark.slow


def cluster_file(path: Path) -> Path:
    path.write_text("\n".join([
        'name = "thunderserve-test"', "", "[coordinator]", 'region = "r"', "",
        "[[nodes]]", 'name = "a100-0"', 'device = "a100-80g"', 'region = "r"', "",
        "[[nodes]]", 'name = "l4-0"', 'device = "l4"', 'region = "r"', "",
        "[[nodes]]", 'name = "l4-1"', 'device = "l4"', 'region = "r"', "",
        "[links.intra_region]", "bandwidth_mbps = 1000", "latency_ms = 1", ""]))
    return path


def ready_plan(api: str, after_version: int = 0, timeout_s: float = 300) -> dict[str, Any]:
    """The first ready phase-split plan newer than `after_version`."""
    return wait_for_ready_plan(api, timeout_s, after_version=after_version, accept=lambda p: bool(p.get("replicas")))


def test_thunderserve_serves_greedy_and_reschedules_lightly_when_a_decode_node_dies(
        tmp_path: Path, smollm2_transformers: Any) -> None:
    from hetnode.models.tokenizer import chat_prompt_ids, load_tokenizer

    state_dir = tmp_path / "tn"
    state = start_testnet(state_dir, "smollm2-135m", cluster=cluster_file(tmp_path / "cluster.toml"),
                          extra=("--placement", "thunderserve", "--kv-codec", "fp16", "--compute-dilation", "1"))
    try:
        api = state["api"]
        plan = ready_plan(api)
        while len(plan["shards"]) < 3:  # the plan of all three nodes (earlier ones were made as they joined)
            plan = ready_plan(api, plan["version"])
        assert plan["method"] == "thunderserve" and plan["scheduler"]["name"] == "tstp", plan
        roles = {r["role"] for r in plan["replicas"]}
        assert roles == {"prefill", "decode"}, plan["replicas"]
        assert abs(sum(r["share"] for r in plan["replicas"] if r["role"] == "prefill") - 1) < 1e-6

        tok = load_tokenizer("smollm2-135m")
        prompts = [
            chat_prompt_ids(tok, [{"role": "user", "content": "What is the capital of France?"}]),
            tok.encode("The three primary colors are"),
            tok.encode("Once upon a time, " * 40),
        ]
        check_against_transformers(api, "smollm2-135m", smollm2_transformers, tok, prompts, 16)
        handoffs = httpx.get(f"{api}/v1/plan", timeout=10).json()["handoffs"]
        assert handoffs and all(k["codec"] == "fp16" and k["bytes"] > 0 for h in handoffs for k in h["links"])
        before = completion(api, "The capital of France is", 8)

        # The decode group the orchestration sends the most requests to dies.
        victim = max((r for r in plan["replicas"] if r["role"] == "decode"), key=lambda r: r["share"])["nodes"][0]
        ranges = {s["name"]: (s["first_layer"], s["last_layer"]) for s in plan["shards"]}
        os.kill(pid_of(state, victim), signal.SIGKILL)
        after = ready_plan(api, plan["version"])
        assert after["method"] == "thunderserve" and victim not in {s["name"] for s in after["shards"]}, after
        assert after["notes"][0].startswith("lightweight reschedule of 3 replicas: 1 dropped"), after["notes"]
        # Layouts kept: every survivor holds the layers it held, so none reloaded.
        assert {s["name"]: (s["first_layer"], s["last_layer"]) for s in after["shards"]} == {
            n: r for n, r in ranges.items() if n != victim}
        assert {r["role"] for r in after["replicas"]} == {"prefill", "decode"}  # a phase flipped if it had to
        assert completion(api, "The capital of France is", 8) == before
    finally:
        stop_testnet(state_dir)
