"""The README's first command: a heterogeneous local testnet serving SmolLM2, answering prompts.

Starts the shipped demo cluster (emulated A100, L4 and T4 nodes in two regions, shaped links; every node holds
only its layers), waits until every node is admitted and every link measured, sends a few prompts through
the OpenAI-compatible API (streaming, so the time to the first token shows), prints the answers with TTFT and
tokens/s, and keeps the API up until Ctrl-C with the lines that show how to query it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio

from hetnode.cli import report_error
from hetnode.errors import HetnodeError
from hetnode.testnet import launcher

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
]


async def ask(client: httpx.AsyncClient, question: str) -> None:
    t0 = time.monotonic()
    ttft = None
    text = []
    tokens = 0
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": question}], "max_tokens": 48,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            print(f"  error {r.status_code}: {(await r.aread()).decode()[:300]}")
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    ttft = ttft or time.monotonic() - t0
                    text.append(piece)
    total = time.monotonic() - t0
    decode = total - (ttft or total)
    rate = (tokens - 1) / decode if tokens > 1 and decode > 0 else 0.0
    print(f"> {question}\n  {''.join(text).strip()}\n  [TTFT {ttft or 0:.2f} s, {tokens} tokens, {rate:.1f} tokens/s]")


async def main(cluster: str, state_dir: Path) -> int:
    args = argparse.Namespace(
        cluster=cluster, nodes=None, model="smollm2-135m", detach=False, state_dir=state_dir,
        api="127.0.0.1:0", api_key=None, token=None, heartbeat_deadline=5.0, ready_timeout=120.0,
        log_level="info")
    running = await launcher.start(args)
    try:
        launcher.print_summary(running.state, running.cluster, running.elapsed_s)
        n = len(running.cluster.nodes)
        async with httpx.AsyncClient(base_url=running.state.api, timeout=180) as client:
            # Each node measures its link to every other node and to the coordinator, and the coordinator its
            # links to the nodes.
            view = (await client.get("/v1/cluster", params={"min_up": n, "min_links": n * (n + 1),
                                                            "timeout": 60})).json()
            print(f"\n{view['up']} nodes up; measured links (Mbit/s, RTT ms):")
            for lk in view["links"]:
                print(f"  {lk['src_name']:>12} -> {lk['dst_name']:<12} {lk['bandwidth_mbps']:7.1f} {lk['rtt_ms']:7.2f}")
            print("\nasking (the first answer waits for the nodes to load their layers):")
            for question in PROMPTS:
                await ask(client, question)
            plan = (await client.get("/v1/plan")).json()["plan"]
            if plan:
                # Each node's layers under the plan; a request's route is one chain of them covering every layer
                # (a full replica here is a route by itself).
                print(f"\nplan ({plan['method']}): " + ", ".join(f"{s['name']}[{s['first_layer']},{s['last_layer']})"
                                                            for s in plan["shards"]))
        api = running.state.api
        print(f"\nquery it:  curl -s {api}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
              f"             -d '{{\"model\": \"smollm2-135m\", \"messages\": [{{\"role\": \"user\", "
              f"\"content\": \"Hi!\"}}]}}'")
        print(f"   python:  openai.OpenAI(base_url='{api}/v1', api_key='none').chat.completions.create("
              "model='smollm2-135m', messages=[...])")
        print("press Ctrl-C to stop", flush=True)
        await launcher.supervise(running)
    finally:
        print("stopping the testnet...", flush=True)
        await launcher.stop(running)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cluster", default="demo", help="cluster file or shipped name (default: demo)")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hetnode-demo-") as tmp:
        try:
            sys.exit(trio.run(main, opts.cluster, Path(tmp)))
        except HetnodeError as exc:
            sys.exit(report_error(exc))
