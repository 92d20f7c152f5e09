#!/usr/bin/env python
"""TPOT by region on the `demo` cluster: is a replica in the region without the coordinator as fast per token?

`hetnode testnet up --cluster demo` (A100 + L4 in `us` with the coordinator, L4 + T4 in `eu`; 25 ms one way
between the regions, 10 ms inside one), serving SmolLM2 under the coordinator's own plan. Requests go one at a
time (so every node decodes at batch 1 and nothing but the route differs), streamed through the OpenAI API; the
`x-hetnode-route` header of each answer names the nodes that served it. Per route: TPOT ((last chunk - first
chunk) / (tokens - 1)) and TTFT, p50 over its requests.

The comparison the design is about: the two L4s are the same emulated device with the same shard, one in the
coordinator's region, one across a 25 ms link. When every token went back to the coordinator before the next
decode step, the remote L4 paid a cross-region round trip per token; with the decode loop on the nodes it pays it
once, in TTFT. Target: TPOT p50 of the remote L4 within 10% of the local one's.

    .venv/bin/python scripts/bench_regions.py [--requests 40] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx
import trio

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetnode.models.tokenizer import chat_prompt_ids, load_tokenizer
from hetnode.testnet import launcher

MODEL = "smollm2-135m"
QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "Why is the sky blue?",
    "What is two plus two?", "Write a haiku about rain.", "What does a CPU do?", "Who wrote Hamlet?",
    "How many legs does a spider have?",
]
TARGET = 0.10


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


async def one(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> dict[str, object]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = end = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}")
        route = r.headers.get("x-hetnode-route", "?")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                first = first or now
                if choice.get("finish_reason"):
                    end = now
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if first is None or end is None:
        raise RuntimeError("stream ended without tokens")
    return {"route": route, "ttft": first - start, "tpot": (end - first) / (tokens - 1) if tokens > 1 else None,
            "tokens": tokens}


def short(route: str) -> str:
    """'mixed: l4-1 [0,30)' -> 'l4-1 [0,30)'."""
    return route.split(": ", 1)[-1]


async def run(requests: int, max_tokens: int) -> dict[str, object]:
    tokenizer = load_tokenizer(MODEL)
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    with tempfile.TemporaryDirectory(prefix="bench-regions-") as tmp:
        args = argparse.Namespace(
            cluster="demo", nodes=None, model=MODEL, detach=False, state_dir=Path(tmp), api="127.0.0.1:0",
            api_key=None, token=None, heartbeat_deadline=5.0, ready_timeout=180.0, log_level="info")
        log("starting the demo testnet ...")
        running = await launcher.start(args)
        try:
            async with httpx.AsyncClient(base_url=running.state.api, timeout=300) as client:
                with trio.fail_after(300):
                    while True:  # the first request waits for the nodes to load their layers
                        try:
                            await one(client, prompts[0], 4)
                            break
                        except RuntimeError as exc:
                            log(f"warming up: {exc}")
                            await trio.sleep(2)
                plan = (await client.get("/v1/plan")).json()
                results = []
                for i in range(requests):
                    results.append(await one(client, prompts[i % len(prompts)], max_tokens))
                    log(f"{i + 1}/{requests} {short(str(results[-1]['route']))}: "
                        f"TPOT {1000 * float(results[-1]['tpot'] or 0):.1f} ms")
        finally:
            await launcher.stop(running)
    by_route: dict[str, list[dict[str, object]]] = defaultdict(list)
    for r in results:
        by_route[short(str(r["route"]))].append(r)
    table = {}
    for route, rs in sorted(by_route.items()):
        tpots = [float(r["tpot"]) for r in rs if r["tpot"] is not None]  # type: ignore[arg-type]
        table[route] = {"requests": len(rs), "tpot_p50_ms": 1000 * statistics.median(tpots) if tpots else None,
                        "ttft_p50_ms": 1000 * statistics.median(float(r["ttft"]) for r in rs)}  # type: ignore[arg-type]
    return {"routes": table, "plan": plan.get("plan", {}).get("shards") if isinstance(plan, dict) else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    t0 = time.time()
    load0 = os.getloadavg()[0]
    r = trio.run(run, a.requests, a.max_tokens)
    if a.json:
        print(json.dumps(r, indent=2))
        return
    print(f"\n== TPOT by route on the demo cluster (one request at a time, max_tokens={a.max_tokens}) ==")
    print(f"{'route':<36} {'requests':>8} {'TPOT p50':>10} {'TTFT p50':>10}")
    for route, row in r["routes"].items():  # type: ignore[union-attr]
        tpot = "-" if row["tpot_p50_ms"] is None else f"{row['tpot_p50_ms']:.1f}ms"
        print(f"{route:<36} {row['requests']:>8} {tpot:>10} {row['ttft_p50_ms']:>8.1f}ms")
    rows = r["routes"]  # type: ignore[assignment]
    local = [v for k, v in rows.items() if k.startswith("l4-0 ") and " -> " not in k]
    remote = [v for k, v in rows.items() if k.startswith("l4-1 ") and " -> " not in k]
    if local and remote and local[0]["tpot_p50_ms"] and remote[0]["tpot_p50_ms"]:
        ratio = remote[0]["tpot_p50_ms"] / local[0]["tpot_p50_ms"]
        verdict = "met" if abs(ratio - 1) <= TARGET else "MISSED"
        print(f"\nTPOT p50, L4 in eu (no coordinator) / L4 in us (coordinator's region): {ratio:.3f}x "
              f"(target within {TARGET:.0%}: {verdict})")
    else:
        print("\nthe plan did not route requests to each L4 alone; no ratio (see the routes above)")
    print(f"\n{os.cpu_count()} cores; load average before {load0:.2f}, after {os.getloadavg()[0]:.2f}; "
          f"{time.time() - t0:.0f} s in all")


if __name__ == "__main__":
    main()
