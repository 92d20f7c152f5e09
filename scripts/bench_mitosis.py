"""EcoServe's mitosis on a live testnet: does moving a running instance to another macro-instance pause its
requests? (EcoServe §3.5.2 reports a pause under 100 ms.)

    .venv/bin/python scripts/bench_mitosis.py [--max-tokens 160] [--clients 8] [--window 8] [--json out.json]

One run: a 4-node testnet (SmolLM2-135M on CPU) with `--placement ecoserve --macro-bounds 2,3 --scale-from 3
--slo 0.0001,0.1`: three instances serve in one macro-instance and the fourth is spare. Clients stream long
completions; the first window judges them misses (the TTFT SLO is below any prefill) and adds the spare. The
macro-instance of three is full (N_u = 3), so it splits: its last instance moves, with the requests it is
running, to a new macro-instance beside the added one (Fig. 7).

Measured side by side in the same run, for every request streaming across the move: the gap between its two
tokens that span the move, divided by that request's median gap between tokens; on the moved instance, and on
the instances that did not move (the control, which sees the same load). Printed: both ratios, and the routing
pause the coordinator measured (the time of its scale call: no request is routed meanwhile; the nodes are told
nothing).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

MODEL = "smollm2-135m"
HETNODE = [sys.executable, "-m", "hetnode"]
PROMPT = "Write a long story about a lighthouse keeper and the sea. " * 4


def stream(api: str, max_tokens: int) -> tuple[str, list[float]]:
    """One streamed completion: the instance that served it (x-hetnode-route) and the wall time of each token."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    times: list[float] = []
    with httpx.stream("POST", f"{api}/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()[:300]}")
        node = r.headers.get("x-hetnode-route", "").split(": ", 1)[-1].split(" ")[0]
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(str(event["error"]))
                times.append(time.time())
    return node, times


def wait_ready(api: str, timeout_s: float = 600) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # GET /v1/plan's long-poll: one request per minute at most
        plan = httpx.get(f"{api}/v1/plan", params={"ready": "true", "timeout": 60}, timeout=90).json()
        if plan["satisfied"]:
            return dict(plan)
    raise RuntimeError(f"no ready plan in {timeout_s:g} s")


def across(times: list[float], at: float) -> float | None:
    """The gap between the two tokens that span `at`, over the request's median gap (None if it does not span)."""
    gaps = [b - a for a, b in itertools.pairwise(times)]
    for a, b in itertools.pairwise(times):
        if a <= at < b:
            return (b - a) / statistics.median(gaps)
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--window", type=float, default=8.0, help="the scaling window in seconds (default 8)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-mitosis-"))
    up = subprocess.run([*HETNODE, "testnet", "up", "--nodes", "4", "--detach", "--state-dir", str(work),
                         "--model", MODEL, "--placement", "ecoserve", "--macro-bounds", "2,3", "--scale-from", "3",
                         "--scale-window", str(args.window), "--scale-idle", "1000", "--slo", "0.0001,0.1"],
                        capture_output=True, text=True, timeout=300)
    if up.returncode:
        print(up.stdout + up.stderr, file=sys.stderr)
        return 1
    api = json.loads((work / "state.json").read_text())["api"]
    try:
        wait_ready(api)
        stream(api, 4)  # warm: first-call allocations behind us
        done: list[tuple[str, list[float]]] = []
        stop = threading.Event()

        def client() -> None:
            while not stop.is_set():
                done.append(stream(api, args.max_tokens))

        threads = [threading.Thread(target=client, daemon=True) for _ in range(args.clients)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 300
        move = None
        while move is None and time.monotonic() < deadline:
            time.sleep(0.5)
            move = next((e for e in httpx.get(f"{api}/v1/plan", timeout=10).json()["scaling"] if e["moves"]), None)
        if move is None:
            raise RuntimeError("no split moved an instance within 300 s")
        time.sleep(1.0)  # the requests running across the move run on; they end within the clients' next round
        stop.set()
        for t in threads:
            t.join(timeout=600)
    finally:
        subprocess.run([*HETNODE, "testnet", "down", "--state-dir", str(work)], capture_output=True, timeout=120)
    moved = {m["instance"] for m in move["moves"]}
    at = float(move["at"])
    ratios: dict[str, list[float]] = {"moved": [], "others": []}
    for node, times in done:
        r = across(times, at)
        if r is not None:
            ratios["moved" if node in moved else "others"].append(r)
    print(f"mitosis: {move['action']} {move['instance']} -> macro-instances {move['sizes']}; moved "
          f"{', '.join(sorted(moved))} ({len(done)} requests of {args.max_tokens} tokens, {args.clients} clients)")
    for key, values in ratios.items():
        if values:
            print(f"  {key:6s}: {len(values)} requests across the move; gap across it / median gap: mean "
                  f"{statistics.fmean(values):.2f}, max {max(values):.2f}")
        else:
            print(f"  {key:6s}: no request was streaming across the move")
    print(f"  routing pause (the coordinator's scale call): {move['pause_s'] * 1e3:.3f} ms (EcoServe: < 100 ms)")
    if ratios["moved"] and ratios["others"]:
        ratio = statistics.fmean(ratios["moved"]) / statistics.fmean(ratios["others"])
        print(f"  moved / others (mean ratio): {ratio:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"move": move, "ratios": ratios, "requests": len(done)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
