"""Phase-split serving on a multi-process testnet: prefill on one replica, decode on another, the KV handed over
the network between pipelines that cut the model differently.

With the fp16 codec the greedy output equals transformers' on the same weights, token for token, for SmolLM2
and the tiny Llama and Qwen2 models, with the prefill replica two stages and the decode replica one, and the
reverse. The shapes come from the plan itself (`--placement split`): node memory, set per node in the cluster
file, decides how many nodes a replica needs, and the nodes' prefill/decode affinity which role they get.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from testnet_helpers import check_against_transformers, start_testnet, stop_testnet

pytestmark = pytest.mark.slow

# Per node: (name, device, layers its memory holds beside the KV share, or None for the device's own memory).
Nodes = list[tuple[str, str, int | None]]
# Prefill on two small nodes (their smaller KV makes their decode rate lower: they prefill), decode on one big.
P2_D1: Nodes = [("small-a", "l4", 0), ("small-b", "l4", 0), ("big", "l4", None)]
# Prefill on one L4 (the most compute per byte of bandwidth), decode on two small T4s.
P1_D2: Nodes = [("l4", "l4", None), ("t4-a", "t4", 0), ("t4-b", "t4", 0)]


def cluster_file(path: Path, model: str, nodes: Nodes) -> Path:
    """A one-region cluster whose small nodes (layers 0 above) each hold just over half the model."""
    from hetnode.coordinator.deployment import PLAN_BYTES_PER_PARAM
    from hetnode.models.resolve import load_config
    from hetnode.planner.model import from_model_config

    spec = from_model_config(model, load_config(model), bytes_per_param=PLAN_BYTES_PER_PARAM)
    half = math.ceil(spec.num_layers * 0.6)
    lines = ['name = "split-test"', "", "[coordinator]", 'region = "r"', ""]
    for name, device, layers in nodes:
        lines += ["[[nodes]]", f'name = "{name}"', f'device = "{device}"', 'region = "r"']
        if layers is not None:
            # The planner keeps half of a node's memory for KV (kv_share 0.5): room for `half` layers and a bit.
            lines.append(f"memory_gb = {(half + 0.5) * spec.layer_bytes * 2 / 2**30:.9f}")
        lines.append("")
    lines += ["[links.intra_region]", "bandwidth_mbps = 1000", "latency_ms = 1", ""]
    path.write_text("\n".join(lines))
    return path


def split_shape(api: str) -> tuple[list[int], list[int]]:
    """Stages per prefill replica and per decode replica of the plan in use."""
    plan = httpx.get(f"{api}/v1/plan", timeout=10).json()["plan"]
    assert plan["method"] == "split" and plan["ready"], plan
    replicas = plan["replicas"]
    return ([len(r["nodes"]) for r in replicas if r["role"] == "prefill"],
            [len(r["nodes"]) for r in replicas if r["role"] == "decode"])


def serve_and_check(tmp_path: Path, model: str, nodes: Nodes, shape: tuple[list[int], list[int]], hf: Any,
                    tok: Any, prompts: list[list[int]], max_tokens: int, policy: tuple[str, ...] = ()) -> None:
    """`policy`: more `testnet up` arguments (Splitwise's pools and batching)."""
    state_dir = tmp_path / "tn"
    cluster = cluster_file(tmp_path / "cluster.toml", model, nodes)
    state = start_testnet(state_dir, model, cluster=cluster,
                          extra=("--placement", "split", "--kv-codec", "fp16", "--compute-dilation", "1", *policy))
    try:
        check_against_transformers(state["api"], model, hf, tok, prompts, max_tokens)  # waits for a ready plan
        assert split_shape(state["api"]) == shape
        plan = httpx.get(f"{state['api']}/v1/plan", timeout=10).json()["plan"]
        if "splitwise" in policy:  # the pools: every replica's home role and the pool it is lent to now
            assert plan["scheduler"]["name"] == "splitwise" and all("pool" in r for r in plan["replicas"]), plan
        else:
            assert plan["scheduler"]["name"] == "cls", plan
        handoffs = httpx.get(f"{state['api']}/v1/plan", timeout=10).json()["handoffs"]  # per request, visible
        assert len(handoffs) >= len(prompts) and all(
            k["codec"] == "fp16" and k["bytes"] > 0 for h in handoffs for k in h["links"])
        log = (state_dir / "logs" / "coordinator.log").read_text()
        assert "hands over the KV" in log and " fp16 " in log
        assert "moved to" not in log  # no request was re-routed (and so none re-prefilled)
    finally:
        stop_testnet(state_dir)


# CLS's routing with the nodes' shared batching; Splitwise's pools with its machine-level batching on the nodes.
@pytest.mark.parametrize(("nodes", "shape", "policy"), [
    (P2_D1, ([2], [1]), ()), (P1_D2, ([1], [2]), ("--scheduler", "splitwise", "--batching", "splitwise"))],
    ids=["p2-d1-cls", "p1-d2-splitwise"])
def test_smollm2_split_greedy_matches_transformers(nodes: Nodes, shape: tuple[list[int], list[int]],
                                                   policy: tuple[str, ...], tmp_path: Path,
                                                   smollm2_transformers: Any) -> None:
    from hetnode.models.tokenizer import chat_prompt_ids, load_tokenizer

    hf = smollm2_transformers
    tok = load_tokenizer("smollm2-135m")
    prompts = [
        chat_prompt_ids(tok, [{"role": "user", "content": "What is the capital of France?"}]),
        tok.encode("The three primary colors are"),
        # ~300 tokens: a transfer the hops stream layer by layer (6.9 MB in fp16, 55 ms at the 1 Gbit/s link).
        tok.encode("Once upon a time, " * 60),
    ]
    serve_and_check(tmp_path, "smollm2-135m", nodes, shape, hf, tok, prompts, 20, policy)


@pytest.mark.parametrize(("arch", "nodes", "shape"), [("llama", P2_D1, ([2], [1])), ("qwen2", P1_D2, ([1], [2]))])
def test_tiny_models_split_greedy_match_transformers(arch: str, nodes: Nodes, shape: tuple[list[int], list[int]],
                                                     tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hetnode.models.tiny import write_tiny_model

    model_dir = write_tiny_model(tmp_path / arch, arch)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [[5, 6, 7], list(range(20, 45)), list(range(100, 170))]
    serve_and_check(tmp_path, str(model_dir), nodes, shape, hf, tok, prompts, 16)


def test_kv_queues_greedy_output_matches_with_more_requests_than_the_decode_kv_holds(tmp_path: Path) -> None:
    """ThunderServe's KV queues on the testnet (--decode-booking handoff): every node's KV pool is small (a quarter
    of a megabyte and a bit), so the decode replica's holds one request's estimate (its prompt and the average
    output the scheduler starts from) at a time. Six requests at once: all are admitted and prefilled (the
    prefill side's KV holds every prompt), their first tokens stream at once, and all but the first keep their KV
    on the prefill nodes until the decode replica has room. Greedy output still equals transformers'."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hetnode.models.tiny import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "llama", "llama")
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [list(range(100, 170)), [5, 6, 7], list(range(20, 45)), list(range(200, 241)), list(range(230, 288)),
               list(range(40, 73))]
    state_dir = tmp_path / "tn"
    cluster = cluster_file(tmp_path / "cluster.toml", str(model_dir), P2_D1)
    state = start_testnet(state_dir, str(model_dir), cluster=cluster, extra=(
        "--placement", "split", "--decode-booking", "handoff", "--kv-codec", "fp16", "--compute-dilation", "1",
        "--kv-cache-mb", "0.55"))
    api = state["api"]
    try:
        assert split_shape(api) == ([2], [1])
        # The scheduler counts the nodes' real pools (their heartbeats after the ready report), not the planner's.
        view = httpx.get(f"{api}/v1/plan", params={"kv_reported": "true", "timeout": 60}, timeout=90).json()
        assert view["satisfied"], view
        scheduler = view["plan"]["scheduler"]
        assert scheduler["name"] == "cls" and scheduler["decode_booking"] == "handoff", scheduler
        decode = scheduler["kv_capacity"]["big"]
        assert 70 + 240 <= 0.9 * decode < 2 * (3 + 240), scheduler  # one request's estimate at a time
        check_against_transformers(api, str(model_dir), hf, tok, prompts, 16)
        metrics = httpx.get(f"{api}/metrics", timeout=10).text
        waited = re.search(r'^hetnode_kv_queue_handoffs_total\{start="waited"\} (\S+)$', metrics, re.M)
        at_once = re.search(r'^hetnode_kv_queue_handoffs_total\{start="at_once"\} (\S+)$', metrics, re.M)
        assert waited and at_once, metrics
        assert float(waited[1]) >= 3 and float(waited[1]) + float(at_once[1]) == len(prompts)
        log = (state_dir / "logs" / "coordinator.log").read_text()
        assert log.count("when its decode replica has room") == len(prompts)
        assert "moved to" not in log  # no request was re-routed: no hand-off failed for want of room
        plan = httpx.get(f"{api}/v1/plan", timeout=10).json()["plan"]
        assert plan["scheduler"]["waiting_handoffs"] == 0 and plan["scheduler"]["running"] == 0
    finally:
        stop_testnet(state_dir)
