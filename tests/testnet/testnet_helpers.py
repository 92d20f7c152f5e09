"""What the multi-process testnet tests share: starting and stopping a testnet, and greedy output checked
against transformers on the same weights."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch

HETNODE = [sys.executable, "-m", "hetnode"]


def start_testnet(state_dir: Path, model: str, nodes: int = 3, *, cluster: Path | None = None,
                  extra: tuple[str, ...] = (), ready: bool = True) -> dict[str, Any]:
    """A detached testnet of `nodes` CPU nodes, or of `cluster`'s nodes; `extra` arguments go to `testnet up`.
    With `ready`, once its first plan is ready: `testnet up` returns when the processes listen, and under CI load
    loading the shards can outlast a first request's --route-wait."""
    which = ["--cluster", str(cluster)] if cluster is not None else ["--nodes", str(nodes)]
    r = subprocess.run([*HETNODE, "testnet", "up", *which, "--detach", "--state-dir", str(state_dir),
                        "--model", model, *extra], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    state: dict[str, Any] = json.loads((state_dir / "state.json").read_text())
    if ready:
        try:
            wait_for_ready_plan(state["api"], key=state.get("api_key"))
        except AssertionError as exc:
            stop_testnet(state_dir)
            raise AssertionError(f"{exc}\n{log_tails(state_dir)}") from None
        except BaseException:
            stop_testnet(state_dir)
            raise
    return state


def log_tails(state_dir: Path, lines: int = 40) -> str:
    """The last lines of each process's log: what a test that gave up waiting shows of why."""
    out = []
    for log in sorted((state_dir / "logs").glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- last {len(tail)} lines of {log.name}:\n" + "\n".join(tail))
    return "\n".join(out)


def wait_for_ready_plan(api: str, timeout_s: float = 300, *, nodes: int | None = None, key: str | None = None,
                        after_version: int = 0, accept: Callable[[dict[str, Any]], bool] | None = None,
                        ) -> dict[str, Any]:
    """The first plan newer than `after_version` that is ready (its nodes have loaded their shards), places
    `nodes` nodes if given and passes `accept`: a request sent before then waits only --route-wait and gets a 503
    if loading takes longer, as it does when another testnet shares the cores, and a node that joined after the
    first plan's debounce is not in it yet. GET /v1/plan's long-poll answers when the plan changes, so this sends
    a request per plan, not one every fraction of a second."""
    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    min_version = after_version + 1
    while True:
        left = deadline - time.monotonic()
        params: dict[str, Any] = {"ready": "true", "min_version": min_version, "timeout": min(30.0, max(left, 0))}
        if nodes is not None:
            params["min_nodes"] = nodes
        r = httpx.get(f"{api}/v1/plan", params=params, timeout=60, headers=headers)
        assert r.status_code == 200, r.text
        plan = r.json().get("plan") or {}
        if r.json()["satisfied"]:
            placed = {s["peer_id"] for s in plan.get("shards", [])}
            if (nodes is None or len(placed) == nodes) and (accept is None or accept(plan)):
                return dict(plan)
            min_version = plan["version"] + 1  # this plan will not do: wait for the next one
        assert time.monotonic() < deadline, f"no ready plan within {timeout_s:g} s: {plan}"


def stop_testnet(state_dir: Path) -> None:
    r = subprocess.run([*HETNODE, "testnet", "down", "--state-dir", str(state_dir)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def reference(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy tokens, up to and including EOS (our completion_tokens count EOS too)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
    return [int(t) for t in out[0, len(prompt):]]


def complete_ids(api: str, prompt: list[int], max_tokens: int, model: str) -> list[int]:
    """Greedy token ids through the API, exact even where they are not valid text (tiny random models)."""
    r = httpx.post(f"{api}/v1/completions", timeout=300, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
        "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    return [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def check_against_transformers(api: str, model_name: str, hf_model: Any, tokenizer: Any,
                               prompts: list[list[int]], max_tokens: int) -> None:
    want = [reference(hf_model, p, max_tokens) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:  # concurrently: the nodes batch them together
        got = list(pool.map(lambda p: complete_ids(api, p, max_tokens, model_name), prompts))
    from hetnode.models.resolve import load_config

    # The API stops at the model's EOS tokens and the tokenizer's.
    eos = set(load_config(model_name).eos_token_ids) | {tokenizer.eos_token_id}
    # transformers pads a sequence that ended early with EOS; ours ends at its first EOS.
    assert [g for g in got] == [w[:len(g)] for w, g in zip(want, got, strict=True)]
    # Shorter only where the reference's next token is EOS (the API's logprobs do not list the EOS token).
    assert all(len(g) == max_tokens or (g[-1:] and g[-1] in eos) or w[len(g)] in eos
               for g, w in zip(got, want, strict=True)), (got, want, eos)


