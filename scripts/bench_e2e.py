#!/usr/bin/env python
"""End to end, in one run: our engine vs transformers, and a 3-node testnet vs the whole model in one process.

Part 1 (engine): `bench_engine.run_benchmark` -- greedy tokens/s of our single-process engine and of
transformers.generate on the same prompts, at batch 1 and 8, same thread count (EOS ignored by both).

Part 2 (serving): the same prompts (the chat-templated token ids of part 1, sent as token-id prompts), greedy,
`max_tokens` each, through one path for both sides: OpenAI-compatible /v1/completions with stream=true, the
same Starlette routes (`openai_routes`) on hypercorn, the same httpx streaming client in this process.

  * single process: a child process of this script serves `LocalGenerator` (every layer in one engine, one
    dynamic batch loop), once at 1 torch thread (as each testnet process runs) and once at one thread per core;
  * testnet: `launcher.start` as `hetnode testnet up --nodes 3` (unshaped links on 127.0.0.1): a coordinator
    and 3 node processes, each node holding a third of the layers, OMP_NUM_THREADS=1 in every process.

All of them run at once and are measured in turns (round-robin, `--repeats` rounds), so that load from other
processes on the machine falls on every side alike. Batch 1 sends the prompts one at a time; batch 8 sends 8
concurrent requests. Per request: TTFT (send -> first streamed chunk), TPOT ((last chunk - first chunk) /
(completion tokens - 1)); aggregate decode tokens/s = decode tokens (after each request's first) / the time
decoding took (per round: first chunk of the earliest request -> last chunk of the latest); CPU ms/token = user +
system time of the side's server processes (psutil) per completion token. Each side is warmed up first (the
testnet's first request waits for the nodes to load their layers). Texts must match (greedy). Unlike part 1,
requests stop at EOS (the API has no ignore-EOS), so some end before max_tokens -- on both sides alike.

Every process runs with OMP_WAIT_POLICY=PASSIVE, as the launcher sets for the testnet's: with more runnable
threads than cores, spin-waiting OpenMP threads starve everything else (our engine at 2 threads drops to a few
tokens/s on a busy 2-core machine without it).

    .venv/bin/python scripts/bench_e2e.py [--quick] [--json] [--max-tokens 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

# Every process here runs with the testnet launcher's OpenMP setting: no spin-waiting after a parallel region
# (on a shared 2-core machine a spinning pool starves whatever runs next). It must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import QUESTIONS, default_threads, run_benchmark

from hetnode.models.tokenizer import chat_prompt_ids, load_tokenizer

MODEL = "smollm2-135m"
SCRIPT = str(Path(__file__).resolve())
TESTNET_NODES = 3
ENGINE_TARGET = 1.0
# testnet / single process (1 thread), aggregate decode tokens/s, by batch: three pipelined processes can keep
# both cores busy where one thread cannot; at batch 1 the hops' network time is what is left to pay.
TESTNET_TARGETS = {8: 1.0, 1: 0.85}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- the client: one streaming completion --------------------------------------------------------------------


@dataclass
class Stream:
    prompt: int  # index into the prompt list
    text: str
    tokens: int  # completion tokens (a final stop token included: it took a step)
    finish: str
    start: float
    first: float  # first streamed chunk (the first token's text)
    end: float  # the chunk with the finish reason

    @property
    def ttft(self) -> float:
        return self.first - self.start

    @property
    def tpot(self) -> float | None:
        return (self.end - self.first) / (self.tokens - 1) if self.tokens > 1 else None


async def stream_completion(client: httpx.AsyncClient, prompt_ids: list[int], index: int, max_tokens: int) -> Stream:
    body = {"model": MODEL, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = end = None
    texts: list[str] = []
    tokens, finish = 0, ""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:500]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"error mid-stream: {chunk['error']}")
            for choice in chunk.get("choices", []):
                first = first or now
                texts.append(choice.get("text", ""))
                if choice.get("finish_reason"):
                    finish, end = choice["finish_reason"], now
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if first is None or end is None:
        raise RuntimeError("stream ended without tokens or without a finish reason")
    return Stream(index, "".join(texts), tokens, finish, start, first, end)


async def run_round(client: httpx.AsyncClient, prompts: list[list[int]], indices: list[int],
                    max_tokens: int) -> list[Stream]:
    """The requests of `indices` all at once."""
    out: list[Stream | None] = [None] * len(indices)

    async def one(slot: int, index: int) -> None:
        out[slot] = await stream_completion(client, prompts[index], index, max_tokens)

    async with trio.open_nursery() as nursery:
        for slot, index in enumerate(indices):
            nursery.start_soon(one, slot, index)
    return [s for s in out if s is not None]


def summarize(rounds: list[list[Stream]]) -> dict[str, Any]:
    streams = [s for r in rounds for s in r]
    decode_tokens = sum(max(0, s.tokens - 1) for s in streams)
    decode_span = sum(max(s.end for s in r) - min(s.first for s in r) for r in rounds)
    wall = sum(max(s.end for s in r) - min(s.start for s in r) for r in rounds)
    tpots = [t for s in streams if (t := s.tpot) is not None]

    def round_rate(r: list[Stream]) -> float:
        span = max(s.end for s in r) - min(s.first for s in r)
        return sum(max(0, s.tokens - 1) for s in r) / span if span > 0 else 0.0

    return {
        "requests": len(streams),
        "completion_tokens": sum(s.tokens for s in streams),
        "decode_tok_s": decode_tokens / decode_span if decode_span > 0 else 0.0,
        # The best single round: what the side does when the machine's other load leaves it alone.
        "best_round_decode_tok_s": max(round_rate(r) for r in rounds),
        "e2e_tok_s": sum(s.tokens for s in streams) / wall if wall > 0 else 0.0,
        "ttft_median_s": statistics.median(s.ttft for s in streams),
        "tpot_median_s": statistics.median(tpots) if tpots else None,
        "finish": sorted({s.finish for s in streams}),
    }


# -- the single-process server (a child process of this script) ---------------------------------------------


async def serve_local(model: str, threads: int) -> None:
    """Child: LocalGenerator behind the OpenAI routes on hypercorn; prints its URL, serves until stdin closes."""
    import torch
    from starlette.applications import Starlette

    from hetnode.coordinator.api import serve_api
    from hetnode.coordinator.local import LocalGenerator
    from hetnode.coordinator.openai_api import openai_routes
    from hetnode.node.engine import EngineConfig

    torch.set_num_threads(threads)
    # The same KV budget as a node's default (--kv-cache-mb 256).
    async with LocalGenerator.open(model, name=model, engine_config=EngineConfig(kv_cache_bytes=256 << 20)) as gen:
        app = Starlette(routes=openai_routes(gen))
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_api, app, "127.0.0.1", 0)
            print(json.dumps({"api": url, "threads": torch.get_num_threads(), "pid": os.getpid()}), flush=True)
            await trio.to_thread.run_sync(sys.stdin.buffer.read, abandon_on_cancel=True)  # EOF: the parent left
            nursery.cancel_scope.cancel()


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


@asynccontextmanager
async def local_server(model: str, threads: int, log_path: Path) -> AsyncIterator[dict[str, Any]]:
    # The launcher's environment for its processes, with this side's thread count.
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE")
    cmd = [sys.executable, SCRIPT, "--serve-local", "--model", model, "--threads", str(threads)]
    with open(log_path, "ab") as log_file:  # noqa: ASYNC230 (a local append-open is instant)
        proc = await trio.lowlevel.open_process(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                stderr=log_file, env=env)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = b""
        with trio.move_on_after(300):
            while not line.endswith(b"\n"):
                chunk = await proc.stdout.receive_some(4096)
                if not chunk:
                    break
                line += chunk
        if not line.endswith(b"\n"):
            raise RuntimeError(f"the single-process server did not start; see {log_path}:\n"
                               + _tail(log_path))
        yield json.loads(line)
    finally:
        with trio.CancelScope(shield=True):
            if proc.stdin is not None:
                await proc.stdin.aclose()
            with trio.move_on_after(10):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


# -- the testnet -----------------------------------------------------------------------------------------------


@asynccontextmanager
async def testnet(model: str, state_dir: Path) -> AsyncIterator[Any]:
    from hetnode.testnet import launcher

    args = argparse.Namespace(
        cluster=None, nodes=TESTNET_NODES, model=model, detach=False, state_dir=state_dir, api="127.0.0.1:0",
        api_key=None, token=None, heartbeat_deadline=5.0, ready_timeout=180.0, log_level="info")
    running = await launcher.start(args)
    try:
        yield running
    finally:
        await launcher.stop(running)


# -- part 2 --------------------------------------------------------------------------------------------------


@dataclass
class Side:
    key: str
    label: str
    api: str
    pids: dict[str, int]  # the processes serving this side (not the client), for CPU accounting
    client: httpx.AsyncClient | None = None


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU time of each process so far."""
    import psutil

    out = {}
    for name, pid in pids.items():
        times = psutil.Process(pid).cpu_times()
        out[name] = times.user + times.system
    return out


async def warm_up(side: Side, prompts: list[list[int]], batch: int) -> float:
    """One request (the testnet's waits for the nodes to load their layers; retried while the plan is not
    ready), then one batch, so that first-call allocations and thread pools are behind us."""
    assert side.client is not None
    t0 = time.perf_counter()
    for attempt in range(10):
        try:
            await stream_completion(side.client, prompts[0], 0, 4)
            break
        except RuntimeError as exc:
            if attempt == 9 or "HTTP 503" not in str(exc):
                raise
            log(f"  not ready yet ({str(exc)[:160]}); retrying")
            await trio.sleep(2)
    await run_round(side.client, prompts, [i % len(prompts) for i in range(batch)], 4)
    return time.perf_counter() - t0


async def serving_benchmark(model: str, threads: list[int], batches: list[int], max_tokens: int, repeats: int,
                            b1_prompts: int, work_dir: Path) -> dict[str, Any]:
    tokenizer = load_tokenizer(model, progress=False)
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    result: dict[str, Any] = {"max_tokens": max_tokens, "repeats": repeats, "prompt_tokens": [len(p) for p in prompts],
                              "sides": {}}
    sides: list[Side] = []
    async with trio.open_nursery() as nursery:
        stop = trio.Event()
        started: dict[str, Any] = {}

        async def hold(cm: Any, key: str, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            async with cm as value:
                started[key] = value
                task_status.started()
                await stop.wait()

        # Started side by side: the servers load the model while the testnet's nodes join and probe.
        ups: dict[str, float] = {}

        async def bring_up(cm: Any, key: str) -> None:
            t0 = time.perf_counter()
            await nursery.start(hold, cm, key)
            ups[key] = time.perf_counter() - t0

        async with trio.open_nursery() as starting:
            for n in threads:
                starting.start_soon(bring_up, local_server(model, n, work_dir / f"local-{n}t.log"), f"local{n}")
            starting.start_soon(bring_up, testnet(model, work_dir / "testnet"), "testnet")
        for n in threads:
            info = started[f"local{n}"]
            log(f"single process, {info['threads']} thread(s): {info['api']} (pid {info['pid']}, "
                f"up in {ups[f'local{n}']:.1f} s)")
            sides.append(Side(f"local_{n}t", f"single process, {n} thread{'s' if n > 1 else ''}", info["api"],
                              {"server": info["pid"]}))
        running = started["testnet"]
        log(f"testnet up in {ups['testnet']:.1f} s: {running.state.api}, logs in "
            f"{work_dir / 'testnet' / 'logs'}; pids " + ", ".join(f"{p.name}={p.pid}" for p in running.state.procs))
        sides.append(Side("testnet", f"testnet, {TESTNET_NODES} nodes x 1 thread", running.state.api,
                          {p.name: p.pid for p in running.state.procs}))
        result["pids"] = {p.name: p.pid for p in running.state.procs}

        try:
            for side in sides:
                side.client = httpx.AsyncClient(base_url=side.api, timeout=httpx.Timeout(600.0))
            # Every node up and every link measured (n * (n + 1) directed links), so no first probe round runs
            # during the measurement; then the first request makes the nodes load their layers.
            view = (await sides[-1].client.get("/v1/cluster", params={  # type: ignore[union-attr]
                "min_up": TESTNET_NODES, "min_links": TESTNET_NODES * (TESTNET_NODES + 1), "timeout": 60})).json()
            log(f"testnet: {view['up']} nodes up, {len(view['links'])} links measured")
            for side in sides:
                log(f"warming up {side.label} ...")
                log(f"  warm in {await warm_up(side, prompts, max(batches)):.1f} s")
            plan = (await sides[-1].client.get("/v1/plan")).json().get("plan")  # type: ignore[union-attr]
            if plan:
                # The plan's shards, not a pipeline: Helix may make them replicas (each [0, L)) or stages.
                result["plan"] = ", ".join(f"{s['name']}[{s['first_layer']},{s['last_layer']})"
                                             for s in plan["shards"])
                log(f"testnet plan's shards: {result['plan']}")

            rounds: dict[tuple[str, int], list[list[Stream]]] = {(s.key, b): [] for s in sides for b in batches}
            cpu: dict[tuple[str, int], dict[str, float]] = {(s.key, b): {} for s in sides for b in batches}
            for rep in range(repeats):
                for batch in batches:
                    for side in sides:
                        assert side.client is not None
                        t0, cpu0 = time.perf_counter(), cpu_seconds(side.pids)
                        if batch == 1:
                            got = [await run_round(side.client, prompts, [i], max_tokens)
                                   for i in range(b1_prompts)]
                        else:
                            got = [await run_round(side.client, prompts,
                                                   [i % len(prompts) for i in range(batch)], max_tokens)]
                        rounds[(side.key, batch)].extend(got)
                        used = cpu[(side.key, batch)]
                        for name, seconds in cpu_seconds(side.pids).items():
                            used[name] = used.get(name, 0.0) + seconds - cpu0[name]
                        s = summarize(got)
                        log(f"round {rep + 1}/{repeats} batch {batch} {side.label}: "
                            f"{s['decode_tok_s']:.1f} decode tok/s, TTFT {s['ttft_median_s']:.3f} s, "
                            f"TPOT {(s['tpot_median_s'] or 0) * 1000:.1f} ms ({time.perf_counter() - t0:.1f} s)")
        finally:
            for side in sides:
                if side.client is not None:
                    await side.client.aclose()
            stop.set()
            log("stopping the servers and the testnet ...")

    reference = sides[0].key
    for side in sides:
        entry: dict[str, Any] = {"label": side.label}
        for batch in batches:
            cell = entry[f"batch{batch}"] = summarize(rounds[(side.key, batch)])
            # CPU time of the side's processes per completion token (the prefill's share included).
            used = cpu[(side.key, batch)]
            cell["cpu_ms_per_token"] = 1000 * sum(used.values()) / max(1, cell["completion_tokens"])
            cell["cpu_ms_per_token_by_process"] = {n: 1000 * c / max(1, cell["completion_tokens"])
                                                   for n, c in used.items()}
        result["sides"][side.key] = entry
    # Identical texts (greedy): every request of every side against the reference side's text for its prompt.
    texts: dict[tuple[str, int], set[str]] = {}
    for (key, _batch), rs in rounds.items():
        for r in rs:
            for s in r:
                texts.setdefault((key, s.prompt), set()).add(s.text)
    identity: dict[str, Any] = {}
    for side in sides:
        prompts_seen = sorted(p for k, p in texts if k == side.key)
        same = [p for p in prompts_seen if texts[(side.key, p)] == texts[(reference, p)]]
        identity[side.key] = {"identical_prompts": len(same), "prompts": len(prompts_seen),
                              "differing": [p for p in prompts_seen if p not in same]}
    result["identical_to"] = reference
    result["identical"] = identity
    result["sample_texts"] = {str(p): sorted(texts[(reference, p)]) for p in range(len(prompts))
                              if (reference, p) in texts}
    for batch in batches:
        tn = result["sides"]["testnet"][f"batch{batch}"]["decode_tok_s"]
        for n in threads:
            ref = result["sides"][f"local_{n}t"][f"batch{batch}"]["decode_tok_s"]
            result.setdefault("ratios", {})[f"batch{batch}_vs_{n}t"] = tn / ref if ref > 0 else 0.0
            tn_best = result["sides"]["testnet"][f"batch{batch}"]["best_round_decode_tok_s"]
            ref_best = result["sides"][f"local_{n}t"][f"batch{batch}"]["best_round_decode_tok_s"]
            result.setdefault("best_round_ratios", {})[f"batch{batch}_vs_{n}t"] = (
                tn_best / ref_best if ref_best > 0 else 0.0)
    return result


# -- output --------------------------------------------------------------------------------------------------


def print_engine(r: dict[str, Any]) -> None:
    print(f"\n== 1. engine: ours vs transformers.generate ({r['model']}, {r['dtype']}, greedy, "
          f"{r['new_tokens']} new tokens, EOS ignored, torch threads={r['threads']}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, in this process) ==")
    print(f"{'batch':>5}  {'ours tok/s':>10}  {'transformers tok/s':>18}  {'ours/transformers':>17}  identical")
    for key in sorted(k for k in r if k.startswith("batch")):
        b = r[key]
        ok = "ok" if b["ratio"] >= ENGINE_TARGET else "MISSED"
        print(f"{key[5:]:>5}  {b['ours_tok_s']:>10.1f}  {b['transformers_tok_s']:>18.1f}  {b['ratio']:>16.2f}x"
              f"  {b['identical_outputs']:>9}   target >= {ENGINE_TARGET:.1f}x: {ok}")


def print_serving(r: dict[str, Any], batches: list[int], threads: list[int]) -> None:
    print(f"\n== 2. serving: {TESTNET_NODES}-node testnet vs single process (LocalGenerator), same HTTP path ==")
    print(f"   /v1/completions stream=true via hypercorn + httpx; greedy; max_tokens={r['max_tokens']} (stops at "
          f"EOS); {r['repeats']} round(s) per cell, sides measured in turns")
    print("   every testnet process (coordinator, nodes) runs with OMP_NUM_THREADS=1; the single process with the "
          "torch threads shown")
    if "plan" in r:
        print(f"   testnet plan's shards: {r['plan']}")
    print(f"{'side':<34} {'batch':>5} {'reqs':>4} {'tokens':>6} {'decode tok/s':>12} {'(best round)':>12} "
          f"{'e2e tok/s':>9} {'TTFT p50':>9} {'TPOT p50':>9} {'CPU ms/token':>12}")
    for side in r["sides"].values():
        for batch in batches:
            s = side[f"batch{batch}"]
            tpot = f"{s['tpot_median_s'] * 1000:7.1f}ms" if s["tpot_median_s"] is not None else "      -"
            print(f"{side['label']:<34} {batch:>5} {s['requests']:>4} {s['completion_tokens']:>6} "
                  f"{s['decode_tok_s']:>12.1f} {s['best_round_decode_tok_s']:>12.1f} {s['e2e_tok_s']:>9.1f} "
                  f"{s['ttft_median_s'] * 1000:>7.0f}ms {tpot:>9} "
                  f"{s['cpu_ms_per_token']:>12.1f}")
    print("   (decode tok/s: tokens after each request's first / decoding time, all rounds pooled, and the best round;"
          "\n    e2e: all tokens / send -> last chunk; CPU: user+system time of the side's server processes per "
          "completion token)")
    for batch in batches:
        by = r["sides"]["testnet"][f"batch{batch}"]["cpu_ms_per_token_by_process"]
        print(f"   testnet CPU ms/token at batch {batch}: " + ", ".join(f"{n} {v:.1f}" for n, v in sorted(by.items())))
    print("\n   testnet / single process (aggregate decode tok/s, all rounds pooled; best round vs best round):")
    for batch in batches:
        parts = []
        for n in threads:
            ratio = r["ratios"][f"batch{batch}_vs_{n}t"]
            best = r["best_round_ratios"][f"batch{batch}_vs_{n}t"]
            verdict = ""
            target = TESTNET_TARGETS.get(batch)
            if target is not None and n == 1:
                verdict = f" (target >= {target:.2f}x: {'met' if ratio >= target else 'MISSED'})"
            parts.append(f"vs {n} thread{'s' if n > 1 else ''}: {ratio:.2f}x; best {best:.2f}x{verdict}")
        print(f"   batch {batch}: " + "  |  ".join(parts))
    print(f"\n   identical texts (greedy), against {r['sides'][r['identical_to']]['label']}:")
    for key, ident in r["identical"].items():
        extra = f" (differ: prompts {ident['differing']})" if ident["differing"] else ""
        print(f"   {r['sides'][key]['label']:<34} {ident['identical_prompts']}/{ident['prompts']} prompts"
              f" identical{extra}")


# -- main ----------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default 48; quick 12)")
    parser.add_argument("--repeats", type=int, default=None, help="rounds per cell (default 3; quick 1)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--b1-prompts", type=int, default=None,
                        help="prompts sent one at a time per batch-1 round (default 4; quick 2)")
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="torch threads of the single-process server(s) (default: 1 and one per core)")
    parser.add_argument("--engine-threads", type=int, default=None, help="part 1's threads (default: one per core)")
    parser.add_argument("--skip-engine", action="store_true", help="skip part 1 (engine vs transformers)")
    parser.add_argument("--quick", action="store_true", help="a fast smoke run: few tokens, one round")
    parser.add_argument("--json", action="store_true", help="print the results as JSON only (progress: stderr)")
    parser.add_argument("--keep-logs", type=Path, default=None, help="keep servers' and testnet logs in DIR")
    parser.add_argument("--serve-local", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_local:
        trio.run(serve_local, args.model, (args.threads or [1])[0])
        return

    quick = args.quick
    max_tokens = args.max_tokens or (12 if quick else 48)
    repeats = args.repeats or (1 if quick else 3)
    b1_prompts = min(args.b1_prompts or (2 if quick else 4), len(QUESTIONS))
    cores = default_threads()
    threads = args.threads or sorted({1, cores})
    results: dict[str, Any] = {"model": args.model, "cores": cores, "quick": quick,
                               "machine_load_before": os.getloadavg()}
    t_start = time.perf_counter()

    if not args.skip_engine:
        log("part 1: our engine vs transformers.generate ...")
        results["engine"] = run_benchmark(args.model, tuple(args.batch), max_tokens, args.engine_threads,
                                          repeats=1 if quick else 3)
        if not args.json:
            print_engine(results["engine"])
        gc.collect()  # part 1's models go before the servers start

    log("part 2: testnet vs single process ...")

    def run_serving(work_dir: Path) -> dict[str, Any]:
        return trio.run(serving_benchmark, args.model, threads, args.batch, max_tokens, repeats, b1_prompts, work_dir)

    if args.keep_logs is not None:
        args.keep_logs.mkdir(parents=True, exist_ok=True)
        results["serving"] = run_serving(args.keep_logs.resolve())
    else:
        with tempfile.TemporaryDirectory(prefix="hetnode-bench-e2e-") as tmp:
            results["serving"] = run_serving(Path(tmp))
    results["machine_load_after"] = os.getloadavg()
    results["elapsed_s"] = time.perf_counter() - t_start
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print_serving(results["serving"], args.batch, threads)
    load = results["machine_load_before"]
    print(f"\n{cores} cores; load average before {load[0]:.2f}, after {results['machine_load_after'][0]:.2f}; "
          f"{results['elapsed_s']:.0f} s in all")


if __name__ == "__main__":
    main()
