"""Faults on a schedule against a live multi-process testnet: does every request end well, or clearly?

    .venv/bin/python scripts/chaos.py [--minutes 5] [--every 10] [--nodes 3] [--clients 4] [--seed 0]

Starts a detached testnet serving SmolLM2 (`hetnode testnet up`), takes each prompt's greedy text undisturbed,
then runs a steady load of streaming requests (--clients threads, one request after another) for --minutes:
first an undisturbed minute-long phase (the latency yardstick), then the chaos phase, where every --every seconds
a random node is killed with SIGKILL and started again with the same identity (`hetnode testnet restart`), and
once, halfway, the coordinator is. At the end it waits for the KV leases of the dead coordinator's sessions to
expire and checks on the coordinator's /metrics that no node holds any KV or session.

Each request ends one of four ways:
- completed: its text equals the undisturbed run's (greedy, so it must);
- failed: the client saw an error (an error event in the stream, an HTTP error status, a refused or dropped
  connection), which is the clear failure a client can act on;
- wrong: it finished normally with other text (silently wrong: must be 0);
- hung: no byte for --hang seconds (must be 0).

Prints the counts, p50/p99 latency of completed requests in the undisturbed phase and under chaos, the share
completed while the coordinator was up (target: at least 99%), and exits 1 if anything hung, was silently wrong,
or KV leaked.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

HETNODE = [sys.executable, "-m", "hetnode"]
PROMPTS = [
    "The capital of France is",
    "Count from 1 to 20:",
    "The three primary colors are",
    "def fibonacci(n):",
    "Write a haiku about the sea.",
    "Once upon a time, " * 4,
]
MAX_TOKENS = 32


@dataclass
class Outcome:
    phase: str  # "calm" or "chaos"
    started: float
    ended: float
    kind: str  # completed, failed, wrong, hung
    detail: str = ""


def stream_once(api: str, prompt: str, hang_s: float) -> tuple[str, str]:
    """(kind, text or reason) of one streaming request."""
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    pieces: list[str] = []
    finished = False
    try:
        # `read` is the time allowed between two bytes: a stream silent that long hangs.
        timeout = httpx.Timeout(connect=hang_s, read=hang_s, write=hang_s, pool=hang_s)
        with httpx.stream("POST", f"{api}/v1/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                r.read()
                return "failed", f"HTTP {r.status_code}: {r.text[:200]}"
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return "failed", f"error event: {event['error'].get('message', '')[:200]}"
                choice = event["choices"][0]
                pieces.append(choice.get("text") or "")
                finished = finished or bool(choice.get("finish_reason"))
    except httpx.ReadTimeout:
        return "hung", f"no byte for {hang_s} s"
    except httpx.TransportError as exc:
        return "failed", f"connection: {exc!r}"[:200]
    if not finished:
        return "failed", "the stream ended without a finish_reason"
    return "completed", "".join(pieces)


def held(api: str) -> dict[str, float]:
    """KV blocks in use and sessions held, per node, from the coordinator's /metrics (each node's latest
    heartbeat), plus the leases each node has expired."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{api}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            node = sample.labels.get("node", "")
            if sample.name == "hetnode_node_kv_blocks" and sample.labels.get("state") == "used":
                out[f"{node} kv_blocks_used"] = sample.value
            elif sample.name == "hetnode_node_active_sessions":
                out[f"{node} active_sessions"] = sample.value
            elif sample.name == "hetnode_node_kv_leases_expired_total":
                out[f"{node} leases_expired"] = sample.value
    return out


def restart(state_dir: Path, name: str) -> float:
    t0 = time.monotonic()
    r = subprocess.run([*HETNODE, "testnet", "restart", name, "--kill", "--state-dir", str(state_dir)],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"restarting {name} failed:\n{r.stdout}{r.stderr}")
    return time.monotonic() - t0


def wait_serving(api: str, deadline_s: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        try:
            r = httpx.post(f"{api}/v1/completions", timeout=60, json={
                "model": "smollm2-135m", "prompt": "Hi", "max_tokens": 1, "temperature": 0})
            if r.status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)  # a client-side deadline: the server answers 503 until a plan is ready
    raise SystemExit(f"the testnet did not serve within {deadline_s} s")


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0, help="length of the chaos phase (default: 5)")
    ap.add_argument("--calm", type=float, default=1.0, help="minutes of the undisturbed phase (default: 1)")
    ap.add_argument("--every", type=float, default=10.0, help="seconds between node kills (default: 10)")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--clients", type=int, default=4, help="concurrent streaming clients (default: 4)")
    ap.add_argument("--hang", type=float, default=120.0, help="seconds without a byte that count as a hang")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-coordinator-restart", action="store_true")
    args = ap.parse_args()
    rng = random.Random(args.seed)

    state_dir = Path(tempfile.mkdtemp(prefix="hetnode-chaos-"))
    r = subprocess.run([*HETNODE, "testnet", "up", "--detach", "--nodes", str(args.nodes), "--state-dir",
                        str(state_dir)], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"testnet up failed:\n{r.stdout}{r.stderr}")
    state = json.loads((state_dir / "state.json").read_text())
    api = state["api"]
    nodes = [p["name"] for p in state["procs"] if p["role"] == "node"]
    try:
        wait_serving(api, 300)
        want = {}
        for p in PROMPTS:
            kind, text = stream_once(api, p, args.hang)
            if kind != "completed":
                raise SystemExit(f"the undisturbed run of {p!r} did not complete: {text}")
            want[p] = text
        outcomes: list[Outcome] = []
        lock = threading.Lock()
        phase = ["calm"]
        stop = threading.Event()

        def client(i: int) -> None:
            crng = random.Random(args.seed * 1000 + i)
            while not stop.is_set():
                prompt = crng.choice(PROMPTS)
                began, current = time.monotonic(), phase[0]
                kind, text = stream_once(api, prompt, args.hang)
                if kind == "completed" and text != want[prompt]:
                    kind, text = "wrong", f"{text!r} != {want[prompt]!r}"
                with lock:
                    outcomes.append(Outcome(current, began, time.monotonic(), kind,
                                            "" if kind == "completed" else text))
                if kind == "failed":
                    time.sleep(0.5)  # a client backs off after an error rather than spinning on a 503

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
        for t in threads:
            t.start()
        time.sleep(args.calm * 60)  # the undisturbed phase runs for its length, by design
        phase[0] = "chaos"
        chaos_began = time.monotonic()
        chaos_end = chaos_began + args.minutes * 60
        coordinator_down: tuple[float, float] | None = None
        kills = 0
        next_kill = chaos_began
        coordinator_due = None if args.no_coordinator_restart else chaos_began + args.minutes * 30
        while time.monotonic() < chaos_end:
            now = time.monotonic()
            if coordinator_due is not None and now >= coordinator_due:
                coordinator_due = None
                t0 = time.monotonic()
                took = restart(state_dir, "coordinator")
                wait_serving(api, 300)
                coordinator_down = (t0, time.monotonic())
                print(f"[{now - chaos_began:6.1f} s] coordinator restarted ({took:.1f} s to start, serving "
                      f"{coordinator_down[1] - t0:.1f} s after the kill)", flush=True)
            elif now >= next_kill:
                victim = rng.choice(nodes)
                took = restart(state_dir, victim)
                kills += 1
                print(f"[{now - chaos_began:6.1f} s] {victim} killed and restarted ({took:.1f} s)", flush=True)
                next_kill = now + args.every
            else:
                time.sleep(min(next_kill, coordinator_due or next_kill, chaos_end) - now)
        stop.set()
        for t in threads:
            t.join(args.hang + 30)

        # The dead coordinator's sessions expire on the nodes (30 s leases); then nothing may be held.
        leak_deadline = time.monotonic() + 120
        leaked: list[str] = []
        expired: dict[str, float] = {}
        while True:
            view = held(api)
            leaked = [f"{k} {v:g}" for k, v in sorted(view.items()) if v and not k.endswith("leases_expired")]
            expired = {k: v for k, v in view.items() if k.endswith("leases_expired")}
            if not leaked or time.monotonic() > leak_deadline:
                break
            time.sleep(1)

        def counts(sel: list[Outcome]) -> dict[str, int]:
            return {k: sum(o.kind == k for o in sel) for k in ("completed", "failed", "wrong", "hung")}

        calm = [o for o in outcomes if o.phase == "calm"]
        chaos = [o for o in outcomes if o.phase == "chaos"]
        coord_up = [o for o in chaos if coordinator_down is None
                    or o.ended < coordinator_down[0] or o.started > coordinator_down[1]]
        lat_calm = [o.ended - o.started for o in calm if o.kind == "completed"]
        lat_chaos = [o.ended - o.started for o in chaos if o.kind == "completed"]
        print()
        print(f"testnet: {args.nodes} nodes, {args.clients} streaming clients, {MAX_TOKENS} tokens a request; "
              f"{kills} node kills in {args.minutes:g} min (every {args.every:g} s), coordinator restarts: "
              f"{0 if coordinator_down is None else 1}")
        print(f"undisturbed: {counts(calm)}")
        print(f"chaos:       {counts(chaos)}")
        share = counts(coord_up)["completed"] / max(1, len(coord_up))
        print(f"completed while the coordinator was up: {share:.1%} of {len(coord_up)} (target >= 99%)")
        print(f"latency p50/p99: undisturbed {percentile(lat_calm, 0.5):.2f}/{percentile(lat_calm, 0.99):.2f} s, "
              f"chaos {percentile(lat_chaos, 0.5):.2f}/{percentile(lat_chaos, 0.99):.2f} s; ratio p50 "
              f"{percentile(lat_chaos, 0.5) / percentile(lat_calm, 0.5):.2f}x, p99 "
              f"{percentile(lat_chaos, 0.99) / percentile(lat_calm, 0.99):.2f}x")
        if lat_calm and lat_chaos:
            print(f"mean latency: undisturbed {statistics.mean(lat_calm):.2f} s, "
                  f"chaos {statistics.mean(lat_chaos):.2f} s")
        reasons: dict[str, int] = {}
        for o in chaos:
            if o.kind != "completed":
                key = f"{o.kind}: {o.detail[:90]}"
                reasons[key] = reasons.get(key, 0) + 1
        for why, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:10]:
            print(f"  {n:4d} x {why}")
        state = "none held" if not leaked else "LEAKED: " + "; ".join(leaked)
        print(f"KV after the run (coordinator /metrics): {state}; leases expired by the nodes: "
              f"{sum(expired.values()):g}")
        bad = counts(outcomes)["wrong"] + counts(outcomes)["hung"] + len(leaked)
        return 1 if bad else 0
    finally:
        subprocess.run([*HETNODE, "testnet", "down", "--state-dir", str(state_dir)], capture_output=True,
                       timeout=120)


if __name__ == "__main__":
    sys.exit(main())
