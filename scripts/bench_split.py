"""Phase-split serving against mixed serving on the same two nodes of a testnet, over a slow cross-region link.

    python scripts/bench_split.py                # all modes, prompts of 128 to 2048 tokens
    python scripts/bench_split.py --quick        # a smoke run: two modes, short prompts
    python scripts/bench_split.py --modes "mixed,split fp16,split fp16 handoff" --lengths 256 \
        --burst 12 --kv-cache-mb 64               # the decode KV booked at admission against at the hand-off

Two emulated nodes in two regions (an L4 in "us", where the coordinator is, and an A100 in "eu"), joined by
the issue's cross-region link (100 Mbit/s, 50 ms one way). Under `--placement split` the L4 prefills (the most
compute per byte of memory bandwidth) and the A100 decodes, so every request's KV crosses the link; under
`--placement helix` each node serves requests whole. The modes: mixed; split with the fp16, int8 and int4
codecs; split fp16 with every transfer sent whole after the prefill step (`--kv-transfer whole`), beside the
hops' own choice, which streams long ones layer by layer; and split with `--kv-codec auto`, which may re-prefill
on the decode side instead. For each mode and prompt length, greedy streaming requests one at a time measure:

- TTFT, and the gap from the first token (the end of the prefill) to the second (the first decode step after
  it): under split it holds the KV transfer (pack, send, unpack), under mixed one decode step;
- TPOT over the tokens after the second;
- the KV bytes each hand-off moved (from the coordinator's per-session log line).

"split fp16 handoff" books the decode replica's KV when the hand-off starts (`--decode-booking handoff`,
ThunderServe's KV queues) instead of at admission: one request at a time, that costs the hand-off a round trip
(Reserve, Ready, SendKV) and the layer-wise overlap with the prefill (the KV is sent from the cache after it).
What it is for shows under load: with `--burst N`, N requests of each length go at once, each mode's nodes' KV
pools cut to `--kv-cache-mb` so that the decode replica holds fewer than N (by the scheduler's estimate: the
prompt and the average output it starts from, 240 tokens). Booked at admission, the requests the decode side
cannot take wait before their prefill; booked at the hand-off, they are prefilled (their first token streams) and
wait with their KV on the prefill node. Per mode: TTFT (median and 90th percentile), the first gap, the time to
the last token, output tokens per second over the burst, and how many hand-offs waited for room.

Ratios are side by side in one run (this machine is shared: absolute times drift). Compute is real (SmolLM2 on
this CPU, `--compute-dilation 1`): both nodes share its cores, so a node's step also waits for the other's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

HETNODE = [sys.executable, "-m", "hetnode"]
MODEL = "smollm2-135m"
CLUSTER = """
name = "split-bench"
description = "an L4 in us and an A100 in eu, 100 Mbit/s and 50 ms between them"

[coordinator]
region = "us"

[[nodes]]
name = "l4-us"
device = "l4"
region = "us"

[[nodes]]
name = "a100-eu"
device = "a100"
region = "eu"

[links.intra_region]
bandwidth_mbps = 1000
latency_ms = 1

[[links.regions]]
a = "us"
b = "eu"
bandwidth_mbps = 100
latency_ms = 50
"""
MODES = {  # name: testnet up arguments
    "mixed": ["--placement", "helix"],
    "split fp16": ["--placement", "split", "--kv-codec", "fp16"],
    "split fp16 whole": ["--placement", "split", "--kv-codec", "fp16", "--kv-transfer", "whole"],
    "split int8": ["--placement", "split", "--kv-codec", "int8"],
    "split int4": ["--placement", "split", "--kv-codec", "int4"],
    "split auto": ["--placement", "split", "--kv-codec", "auto"],
    "split fp16 handoff": ["--placement", "split", "--kv-codec", "fp16", "--decode-booking", "handoff"],
}
WAITED = re.compile(r'^hetnode_kv_queue_handoffs_total\{start="waited"\} (\S+)$', re.M)
HANDOFF = re.compile(r"hands over the KV of (\d+) tokens: .* (\w+) (\d+) bytes")


def english(tokens: int) -> str:
    """About `tokens` tokens of English (a paper's text, repeated as needed)."""
    papers = Path(__file__).resolve().parents[2] / "shared" / "papers"
    text = " ".join(p.read_text() for p in sorted(papers.glob("*.md"))) if papers.exists() else "The cat sat. "
    words = text.split()
    return " ".join(words[i % len(words)] for i in range(int(tokens * 0.7)))


def stream(api: str, prompt: str, max_tokens: int) -> tuple[float, list[float], int]:
    """Seconds to each streamed token, and the prompt's token count."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    times: list[float] = []
    prompt_tokens = 0
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{api}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                prompt_tokens = event["usage"]["prompt_tokens"]
            if event.get("choices") and event["choices"][0].get("text") is not None:
                times.append(time.perf_counter() - t0)
    return t0, times, prompt_tokens


def burst(api: str, prompt: str, n: int, max_tokens: int) -> dict[str, Any]:
    """`n` streaming requests at once: each one's TTFT, first gap and time to its last token, and the output
    tokens per second from the first request sent to the last token received."""
    from concurrent.futures import ThreadPoolExecutor

    waited = WAITED.search(httpx.get(f"{api}/metrics", timeout=30).text)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        runs = list(pool.map(lambda _: stream(api, prompt, max_tokens), range(n)))
    wall = max(start + times[-1] for start, times, _ in runs) - t0
    after = WAITED.search(httpx.get(f"{api}/metrics", timeout=30).text)
    ttft = sorted(times[0] for _, times, _ in runs)
    return {"ttft": statistics.median(ttft), "ttft_p90": ttft[int(0.9 * (n - 1))],
            "gap": statistics.median(times[1] - times[0] for _, times, _ in runs),
            "e2e": statistics.median(times[-1] for _, times, _ in runs),
            "tokens_per_s": sum(len(times) for _, times, _ in runs) / wall,
            "waited": float(after[1]) - float(waited[1]) if waited and after else 0.0}


def run_mode(name: str, args: list[str], lengths: list[int], repeats: int, max_tokens: int,
             workdir: Path, bursts: int = 0, kv_cache_mb: float | None = None) -> dict[str, Any]:
    state_dir = workdir / name.replace(" ", "-")
    cluster = workdir / "cluster.toml"
    pool = ["--kv-cache-mb", str(kv_cache_mb)] if kv_cache_mb else []
    up = subprocess.run([*HETNODE, "testnet", "up", "--cluster", str(cluster), "--detach", "--state-dir",
                         str(state_dir), "--model", MODEL, "--compute-dilation", "1", *pool, *args],
                        capture_output=True, text=True, timeout=300)
    if up.returncode != 0:
        raise SystemExit(f"testnet up failed for {name}:\n{up.stdout}\n{up.stderr}")
    api = json.loads((state_dir / "state.json").read_text())["api"]
    log = state_dir / "logs" / "coordinator.log"
    rows = []
    loads = []
    try:
        stream(api, english(64), 4)  # waits for the plan; warms both nodes
        # The scheduler counts the nodes' real pools (--kv-cache-mb) from their first heartbeats after ready.
        httpx.get(f"{api}/v1/plan", params={"kv_reported": "true", "timeout": 60}, timeout=90)
        for length in lengths:
            prompt = english(length)
            samples = []
            for _ in range(repeats):
                mark = len(log.read_text())
                _, times, tokens = stream(api, prompt, max_tokens)
                if len(times) < 3:
                    raise SystemExit(f"{name}: the model stopped after {len(times)} tokens; use other text")
                moved = [(int(c), codec, int(b)) for c, codec, b in HANDOFF.findall(log.read_text()[mark:])]
                samples.append({"tokens": tokens, "ttft": times[0], "gap": times[1] - times[0],
                                "tpot": (times[-1] - times[1]) / max(1, len(times) - 2),
                                "kv_bytes": sum(b for _, _, b in moved), "codec": moved[0][1] if moved else "-"})
            rows.append({"length": length, "tokens": samples[0]["tokens"],
                         **{k: statistics.median(s[k] for s in samples) for k in ("ttft", "gap", "tpot", "kv_bytes")},
                         "codec": samples[-1]["codec"]})
            print(f"  {name:11s} {rows[-1]['tokens']:5d} tokens: TTFT {rows[-1]['ttft'] * 1e3:7.0f} ms, "
                  f"first gap {rows[-1]['gap'] * 1e3:6.0f} ms, TPOT {rows[-1]['tpot'] * 1e3:5.0f} ms, "
                  f"KV {rows[-1]['kv_bytes'] / 1e6:6.2f} MB ({rows[-1]['codec']})", flush=True)
            if bursts:
                b = rows[-1]["burst"] = burst(api, prompt, bursts, max_tokens)
                loads.append(os.getloadavg()[0])
                print(f"  {name:11s} {bursts} at once: TTFT {b['ttft'] * 1e3:7.0f} ms (p90 {b['ttft_p90'] * 1e3:.0f}), "
                      f"first gap {b['gap'] * 1e3:6.0f} ms, last token {b['e2e'] * 1e3:7.0f} ms, "
                      f"{b['tokens_per_s']:5.1f} tokens/s, {b['waited']:.0f} hand-offs waited (load "
                      f"{loads[-1]:.2f})", flush=True)
    finally:
        subprocess.run([*HETNODE, "testnet", "down", "--state-dir", str(state_dir)], capture_output=True,
                       timeout=120)
    return {"mode": name, "rows": rows}


def report(results: list[dict[str, Any]]) -> None:
    by = {r["mode"]: {row["length"]: row for row in r["rows"]} for r in results}
    if any("burst" in row for r in results for row in r["rows"]):
        print("\nbursts (medians over the burst's requests; tokens/s over the burst):")
        print(f"{'mode':19s} {'prompt':>6s} {'TTFT':>7s} {'p90':>7s} {'1st gap':>8s} {'last':>7s} {'tok/s':>6s} "
              f"{'waited':>6s}")
        for res in results:
            for row in res["rows"]:
                b = row["burst"]
                print(f"{res['mode']:19s} {row['tokens']:6d} {b['ttft']:7.2f} {b['ttft_p90']:7.2f} {b['gap']:8.2f} "
                      f"{b['e2e']:7.2f} {b['tokens_per_s']:6.1f} {b['waited']:6.0f}")
        if "split fp16" in by and "split fp16 handoff" in by:
            print("\nbooked at the hand-off / at admission (split fp16):")
            for n, row in by["split fp16 handoff"].items():
                a, h = by["split fp16"][n]["burst"], row["burst"]
                print(f"  {row['tokens']:5d} tokens: TTFT {h['ttft'] / a['ttft']:.2f}, p90 TTFT "
                      f"{h['ttft_p90'] / a['ttft_p90']:.2f}, last token {h['e2e'] / a['e2e']:.2f}, "
                      f"throughput {h['tokens_per_s'] / a['tokens_per_s']:.2f}")
    base = {r["length"]: r for r in results[0]["rows"]}
    print("\nagainst mixed serving on the same nodes (ratio of medians; > 1: slower than mixed)")
    print(f"{'mode':19s} {'prompt':>6s} {'TTFT':>6s} {'1st gap':>8s} {'TPOT':>6s} {'KV MB':>7s}")
    for res in results[1:]:
        for row in res["rows"]:
            b = base[row["length"]]
            print(f"{res['mode']:19s} {row['tokens']:6d} {row['ttft'] / b['ttft']:6.2f} {row['gap'] / b['gap']:8.2f} "
                  f"{row['tpot'] / b['tpot']:6.2f} {row['kv_bytes'] / 1e6:7.2f}")
    if "split fp16" in by and "split fp16 whole" in by:
        # What streaming hides of the serialized transfer: the first gap beyond mixed serving's (one decode step)
        # layer-wise, against the same whole after the prefill step.
        mixed, layerwise, whole = by["mixed"], by["split fp16"], by["split fp16 whole"]
        print("\nfirst gap beyond mixed's, layer-wise (the hops' policy) / whole after the step, fp16 KV:")
        for n in layerwise:
            extra_lw = layerwise[n]["gap"] - mixed[n]["gap"]
            extra_whole = whole[n]["gap"] - mixed[n]["gap"]
            hidden = 1 - extra_lw / extra_whole if extra_whole > 0 else float("nan")
            print(f"  {layerwise[n]['tokens']:5d} tokens: {extra_lw * 1e3:6.0f} ms / {extra_whole * 1e3:6.0f} ms, "
                  f"{hidden:.0%} hidden")
    if "split fp16" in by and "split int4" in by:
        fp16, int4 = by["split fp16"], by["split int4"]
        print("\nKV bytes, fp16 / int4 per prompt length:", ", ".join(
            f"{fp16[n]['tokens']}: {fp16[n]['kv_bytes'] / max(1, int4[n]['kv_bytes']):.2f}x" for n in fp16))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="128,512,1024,2048", help="prompt lengths in tokens (about)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--modes", default=",".join(MODES), help=f"of: {', '.join(MODES)} (mixed first)")
    parser.add_argument("--quick", action="store_true", help="mixed and split fp16, prompts of 64 and 256, once")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--burst", type=int, default=0, metavar="N",
                        help="after each length's one-at-a-time requests, N of them at once (0: none)")
    parser.add_argument("--kv-cache-mb", type=float, default=None, metavar="MB",
                        help="every node's KV pool (default: the node's, 256), so that the decode side binds a burst")
    args = parser.parse_args()
    modes = ["mixed", "split fp16"] if args.quick else [m.strip() for m in args.modes.split(",")]
    lengths = [64, 256] if args.quick else [int(x) for x in args.lengths.split(",")]
    repeats = 1 if args.quick else args.repeats
    unknown = [m for m in modes if m not in MODES]
    if unknown or modes[0] != "mixed":
        raise SystemExit(f"--modes: known modes are {', '.join(MODES)}, mixed first (unknown: {unknown})")
    print(f"machine load: {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-split-") as tmp:
        workdir = Path(tmp)
        (workdir / "cluster.toml").write_text(CLUSTER)
        results = [run_mode(m, MODES[m], lengths, repeats, args.max_tokens, workdir, args.burst, args.kv_cache_mb)
                   for m in modes]
    report(results)
    print(f"machine load: {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
