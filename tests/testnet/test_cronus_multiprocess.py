"""Cronus on a multi-process testnet (`--placement cronus`): a weak node (an emulated A10) prefills the start of
each prompt, hands the KV of those tokens to a strong one (an emulated A100), which prefills the rest and
decodes. With the fp16 codec the greedy output equals transformers' on the same weights, token for token, with
the split point varying from request to request; a weak node killed mid-prompt leaves its request to the strong
node, which completes it alone.
"""

from __future__ import annotations

import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_split_failover_multiprocess import completion, pid_of, wait_for_line
from testnet_helpers import check_against_transformers, start_testnet, stop_testnet, wait_for_ready_plan

pytestmark = pytest.mark.slow

HANDOFF = re.compile(r"hands over the KV of (\d+) tokens")


def cluster_file(path: Path) -> Path:
    path.write_text("\n".join([
        'name = "cronus-test"', "", "[coordinator]", 'region = "r"', "",
        "[[nodes]]", 'name = "weak"', 'device = "a10"', 'region = "r"', "",
        "[[nodes]]", 'name = "strong"', 'device = "a100-80g"', 'region = "r"', "",
        "[links.intra_region]", "bandwidth_mbps = 1000", "latency_ms = 1", ""]))
    return path


@pytest.fixture
def cronus(tmp_path: Path) -> Any:
    def start(model: str) -> dict[str, Any]:
        return start_testnet(tmp_path / "tn", model, cluster=cluster_file(tmp_path / "cluster.toml"),
                             extra=("--placement", "cronus", "--kv-codec", "fp16", "--compute-dilation", "1"))

    yield start, tmp_path / "tn" / "logs" / "coordinator.log"
    if (tmp_path / "tn" / "state.json").exists():
        stop_testnet(tmp_path / "tn")


def pairs(api: str, timeout_s: float = 300) -> list[tuple[str, str]]:
    """The ready plan's replicas (role, node), once both nodes have joined and loaded the model."""
    plan = wait_for_ready_plan(api, timeout_s, nodes=2, accept=lambda p: len(p.get("replicas", ())) == 2)
    assert plan["method"] == "cronus", plan
    return [(r["role"], r["nodes"][0]) for r in plan["replicas"]]


def test_smollm2_cronus_greedy_matches_transformers_with_the_split_varying(cronus: Any,
                                                                          smollm2_transformers: Any) -> None:
    from hetnode.models.tokenizer import chat_prompt_ids, load_tokenizer

    start, log = cronus
    hf = smollm2_transformers
    tok = load_tokenizer("smollm2-135m")
    prompts = [
        chat_prompt_ids(tok, [{"role": "user", "content": "What is the capital of France?"}]),
        tok.encode("The three primary colors are " * 20),
        tok.encode("Once upon a time, " * 120),
    ]
    state = start("smollm2-135m")
    assert pairs(state["api"]) == [("ppi", "weak"), ("cpi", "strong")]
    joined = httpx.get(f"{state['api']}/v1/plan", timeout=10).json()["plan"]["replicas"][0]["balancer"]
    assert joined["refitted_on"] == {"partial": 0, "chunked": 0}
    check_against_transformers(state["api"], "smollm2-135m", hf, tok, prompts, 20)
    splits = [int(k) for k in HANDOFF.findall(log.read_text())]
    assert len(splits) == len(prompts) and len(set(splits)) == len(prompts), splits
    # Some prompt was split: its start on the weak node, its rest on the strong one.
    assert any(k < min(len(p) for p in prompts if len(p) >= k) for k in splits), (splits, [len(p) for p in prompts])
    assert "moved to" not in log.read_text()
    # The weak node says when its part is done (HandedOver): the PPI's place is free from then. Its HandedOver and
    # the strong node's first token reach the coordinator on different paths, so either may come first (on a
    # loaded machine the first token overtook it by 2 ms once, the rest of the prompt being short): the trace
    # must have it, whatever its order.
    r = httpx.post(f"{state['api']}/v1/completions", headers={"X-Request-Id": "cronus-long"}, timeout=300, json={
        "model": "smollm2-135m", "prompt": "Once upon a time, " * 120, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    (session,) = httpx.get(f"{state['api']}/v1/requests/cronus-long", timeout=10).json()["sessions"]
    assert session["handed_over_s"] is not None and session["first_token_s"] is not None, session
    # The pair's balancer was refitted on the times it saw: the partial prefills whose hand-over came before the
    # first token (a whole prompt's first token may overtake it), and the strong node's rests of those split
    # short of their prompt.
    now = httpx.get(f"{state['api']}/v1/plan", timeout=10).json()["plan"]["replicas"][0]["balancer"]
    assert now["refitted_on"]["partial"] >= 2 and now["refitted_on"]["chunked"] >= 1, now
    assert now["ppi"] != joined["ppi"] and now["cpi"] != joined["cpi"], (joined, now)


def test_a_weak_node_killed_mid_prompt_its_request_completes_on_the_strong_node(cronus: Any) -> None:
    start, log = cronus
    state = start("smollm2-135m")
    api = state["api"]
    assert pairs(api) == [("ppi", "weak"), ("cpi", "strong")]
    prompt = "Once upon a time, in a land far away, " * 150  # about 1,651 tokens: seconds of prefill here
    want = completion(api, prompt, 12)
    mark = len(log.read_text())
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(completion, api, prompt, 12)
        wait_for_line(log, "hands over the KV", mark)  # installed: the weak node prefills its part next
        os.kill(pid_of(state, "weak"), signal.SIGKILL)
        assert done.result(timeout=300) == want
    assert "moved to" in log.read_text()[mark:]
