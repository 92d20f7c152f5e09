#!/usr/bin/env python
"""Validate the simulator against the real system: one small cluster, run on the testnet and in the simulator.

The same cluster (`demo`: an emulated A100 and L4 in `us`, an L4 and a T4 in `eu`, shaped links; SmolLM2-135M)
serves the same requests twice, and the script prints throughput and TTFT/TPOT side by side, with the ratio and
a check against a 10% target (Helix reports under 5% for its simulator):

1. Testnet. `launcher.start` as `hetnode testnet up --cluster demo --compute-dilation D`: a coordinator and four
   node processes planning with Helix and routing with IWRR. D (default 1000) makes each emulated step (D x the
   device's roofline time) longer than the real CPU step on this machine, which pacing can only stretch: a
   30-layer SmolLM2 step with up to 48 prompt tokens or 32 decodes takes 35-160 ms of real time here, an A100's
   paced step ~200 ms and an L4's or T4's ~1 s. The profile table reports the margin (real / paced).

2. Profiles, measured on the testnet. For every layer range of the coordinator's plan, a worker process loads
   the node's shard (`TorchEngine.load`: the node's model, dtype and KV pool) and times steps exactly as a node's
   batch loop does (`BatchLoop._run_step`): t0, the engine step in a worker thread under a one-step limiter,
   then `trio.sleep_until(t0 + pace(items))` with the node's own pace function (`pace_factory(device, D)`), in
   the launcher's environment (OMP_NUM_THREADS=1, OMP_WAIT_POLICY=PASSIVE), on this machine while the testnet
   runs. A measured step therefore holds what a node's step holds: the real compute where it exceeds the pace,
   the thread hand-off, the timer's lateness. Prefill of n tokens, decode of b sequences at two contexts (their
   difference gives the cost per context token) and mixed steps (a prompt with decodes) are timed; the profile
   (`DeviceProfile` curves per layer) is written with `save_profile_table` (--out). The mixed steps decide how
   the simulator prices them (`SimOptions.mixed_steps`): as prefill + decode (Helix's additive model) or as one
   pass over all the step's tokens, whichever predicts the measured mixed steps better.

3. Links: the coordinator's measurements (GET /v1/cluster: bandwidth, and the minimum RTT of 15 pings per
   directed link; a pair gets the slower bandwidth and half the longer RTT, as the planner combines them). They
   include py-libp2p's per-message cost and the shaper's timer lateness beside the emulated latency. The
   simulator also runs with the cluster file's emulated links, as a variant.

4. The plan: GET /v1/plan, converted to a `PlacementPlan` over peer ids (as the coordinator's scheduler sees it);
   the simulator routes with a fresh instance of the coordinator's scheduler (`make_scheduler`, its options).

5. Requests, on one timeline that the simulator replays whole: a burst of warm-up requests (every node's first
   request opens the long-lived streams, paying protocol negotiation that later requests do not), calibration
   requests sent one at a time, then the workload: Poisson arrivals at --rate for --duration seconds, each a
   prompt of random token ids (length uniform in --input) with `max_tokens` uniform in --output, greedy,
   streamed. The API has no ignore-EOS, so every request's actual completion length is recorded and replayed.
   Per request: TTFT (sent -> first streamed chunk) and TPOT ((last chunk - first chunk) / (tokens - 1));
   decode throughput = tokens generated inside the window [warm-up, duration) of the workload per second (token
   times from the per-token logprob entries of each chunk), as the simulator counts it. The script also records
   each process's CPU time and how late a 50 ms sleep wakes in its own process (the machine's scheduling delay).

6. The coordinator's own time: each calibration request ran alone, so its TTFT and TPOT beyond the simulator's
   prediction for it (steps and links only) is software time: per request (HTTP, routing, first message) and per
   token (streaming it to the client; the decode loop itself runs on the nodes). The simulator models it as the
   coordinator's service times
   (`SimOptions.coordinator_request_s`, `coordinator_token_s`: one server in arrival order).

7. Simulator: `simulate()` with the measured profiles, the plan, the links, the same arrivals and lengths, the
   runtime's batch limit (8192 tokens, under which the nodes chunk prompts) and KV block (16), each node's KV
   pool as the node reports it (blocks x 16 tokens), and the coordinator's measured time. The table compares the
   medians (and P90s) over all requests; variants without the coordinator's time, with additive mixed steps and with the
   emulated links show what each part of the model contributes, and a split into fast and slow requests (one
   TPOT threshold applied to each side) compares like with like.

8. Phase-split (`--placement split`): the coordinator plans prefill and decode replicas (`split_placement`) and
   routes by CLS; the simulator runs the same plan with a fresh CLS scheduler (the nodes' regions), the KV
   hand-offs at the codec rates the profile worker measures (`hetnode.kv.codec_rates.measure`, as each node
   does when it loads its shard), the runtime's codec choice (`--kv-codec`, default auto) and, by default, the
   runtime's whole-or-layer-wise choice per link (`KVTransferPolicy`; `--kv-transfer`). The report adds the KV the
   coordinator logged per codec (its "hands over the KV" lines) beside the simulator's.

    .venv/bin/python scripts/validate_sim.py                 # full run, ~9 minutes
    .venv/bin/python scripts/validate_sim.py --quick         # a short smoke run, ~3 minutes
    .venv/bin/python scripts/validate_sim.py --placement split   # the phase-split run
    .venv/bin/python scripts/validate_sim.py --json out.json --out profiles.toml --keep-logs logs/
    .venv/bin/python scripts/validate_sim.py --replay out.json   # simulate an earlier run's requests again
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = "smollm2-135m"
CLUSTER = "demo"
TARGET = 0.10  # relative difference allowed between the simulator and the testnet
CALIBRATION_INPUT = 32  # prompt tokens of each calibration request
CALIBRATION_OUTPUT = 6  # tokens each calibration request generates
SCRIPT = str(Path(__file__).resolve())
# The launcher's environment for every testnet process (hetnode/testnet/launcher.py).
LAUNCHER_ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# -- 2. the profile worker (a child process) ------------------------------------------------------------------


def paced_timer(engine: Any, limiter: trio.CapacityLimiter, pace: Any) -> Any:
    """A step timed as `hetnode.node.batcher.BatchLoop._run_step` runs it, step for step: t0, the engine step in a
    worker thread under the loop's one-step limiter, then sleep until t0 + pace(items). Returns (the step's
    duration, the real compute time, the pace)."""

    async def timed(items: list[Any]) -> tuple[float, float, float]:
        t0 = trio.current_time()
        await trio.to_thread.run_sync(engine.step, items, limiter=limiter)
        real = trio.current_time() - t0
        paced = pace(items)
        await trio.sleep_until(t0 + paced)
        return trio.current_time() - t0, real, paced

    return timed


async def profile_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """Child: time paced steps of each layer range's shard the way a node's batch loop times them."""
    import torch

    from hetnode.kv import codec_rates
    from hetnode.models.resolve import load_config

    out: dict[str, Any] = {"threads": torch.get_num_threads(), "ranges": [], "concurrent": False}
    # The KV codecs' pack and unpack rates, measured as a node measures them when it loads a shard.
    model_cfg = load_config(cfg["model"])
    out["codec_rates"] = {c: list(r) for c, r in codec_rates.measure(model_cfg.num_kv_heads,
                                                                     model_cfg.head_dim).items()}
    for part in cfg["ranges"]:
        entries, concurrent = await measure_range(cfg, part)
        out["ranges"].extend(entries)
        out["concurrent"] = out["concurrent"] or concurrent
    return out


async def measure_range(cfg: dict[str, Any], part: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    """One layer range's shard, timed with the pace of every device type that holds it."""
    import torch

    from hetnode.ids import SessionId
    from hetnode.node.emulation import pace_factory
    from hetnode.node.engine import SamplingParams, StepItem, TorchEngine

    greedy = SamplingParams(temperature=0.0)
    rng = random.Random(1)
    reps = int(cfg["reps"])
    first, last = int(part["first"]), int(part["last"])
    engine = await trio.to_thread.run_sync(lambda: TorchEngine.load(cfg["model"], first, last))
    limiter = trio.CapacityLimiter(1)  # the batch loop's: one engine step at a time
    hidden = engine.config.hidden_size

    def item(session: SessionId, start: int, n: int) -> StepItem:
        sampling = greedy if engine.is_last else None
        if engine.is_first:
            return StepItem(session, start, token_ids=[rng.randrange(1000, 40000) for _ in range(n)],
                            sampling=sampling)
        return StepItem(session, start, hidden=torch.randn(n, hidden) * 0.1, sampling=sampling)

    # Decode sessions, prefilled once (unpaced) to the longest context; a decode item at `start` rewinds the
    # session's KV to it, so every measurement runs at exactly its context.
    contexts = sorted(int(c) for c in cfg["contexts"])
    bmax = max(int(b) for b in cfg["decode"])
    sessions = [SessionId(f"dec-{i}") for i in range(bmax)]
    for i in range(0, bmax, 8):
        await trio.to_thread.run_sync(engine.step, [item(s, 0, contexts[-1]) for s in sessions[i:i + 8]],
                                      limiter=limiter)
    counter = [0]
    paces = {d: pace_factory(d, float(cfg["dilation"]))(engine) for d in part["devices"]}
    timers = {d: paced_timer(engine, limiter, pace) for d, pace in paces.items()}
    entries = {d: {"device": d, "first": first, "last": last, "prefill": [], "decode": [], "mixed": []}
               for d in part["devices"]}

    async def prefill(device: str) -> None:
        for n in cfg["prefill"]:
            runs = []
            for _ in range(reps):
                counter[0] += 1
                s = SessionId(f"pf-{counter[0]}")
                runs.append(await timers[device]([item(s, 0, int(n))]))
                engine.release(s)
            entries[device]["prefill"].append({"tokens": int(n), "runs": runs})

    def decode(ctx: int) -> Any:
        async def run(device: str) -> None:
            for b in cfg["decode"]:
                runs = [await timers[device]([item(s, ctx, 1) for s in sessions[:int(b)]]) for _ in range(reps)]
                entries[device]["decode"].append({"batch": int(b), "context_per_item": ctx + 1, "runs": runs})
        return run

    async def mixed(device: str) -> None:
        # Mixed steps (one prompt and b decodes), to see how a profile's model prices them.
        for n, b in cfg["mixed"]:
            runs = []
            for _ in range(reps):
                counter[0] += 1
                s = SessionId(f"mx-{counter[0]}")
                runs.append(await timers[device]([item(s, 0, int(n))] + [item(x, contexts[0], 1)
                                                                          for x in sessions[:int(b)]]))
                engine.release(s)
            entries[device]["mixed"].append({"tokens": int(n), "batch": int(b),
                                             "context_per_item": contexts[0] + 1, "runs": runs})

    # The device with the shortest paced step is timed alone. The others are timed together (one engine,
    # the batch loop's limiter: a step may wait while another device's step computes) only when each of
    # their paced steps outlasts all of them computing at once, with room to spare, so that the waiting
    # cannot stretch a step; otherwise one after the other too.
    probe = [StepItem(SessionId("probe"), contexts[0], token_ids=[1])]
    order = sorted(part["devices"], key=lambda d: paces[d](probe))
    fastest, rest = order[0], order[1:]
    # Longest context first: a decode item rewinds its session's KV, so later phases only ever shorten it.
    concurrent = False
    for phase in (prefill, *(decode(ctx) for ctx in reversed(contexts)), mixed):
        await phase(fastest)
        real = max(r[1] for e in entries.values() for kind in ("prefill", "decode", "mixed")
                   for m in e[kind] for r in m["runs"])
        if rest and min(paces[d](probe) for d in rest) >= 2 * len(rest) * real:
            async with trio.open_nursery() as nursery:
                for d in rest:
                    nursery.start_soon(phase, d)
            concurrent = True
        else:
            for d in rest:
                await phase(d)
    await trio.to_thread.run_sync(engine.close)
    return list(entries.values()), concurrent


def profile_worker_main() -> None:
    cfg = json.loads(sys.stdin.read())
    print(json.dumps(trio.run(profile_worker, cfg)), flush=True)


async def measure_profiles(cfg: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **LAUNCHER_ENV)
    proc = await trio.run_process([sys.executable, SCRIPT, "--profile-worker"], stdin=json.dumps(cfg).encode(),
                                  capture_stdout=True, capture_stderr=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the profile worker failed:\n{proc.stderr.decode(errors='replace')[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def _median(runs: Sequence[Sequence[float]], k: int = 0) -> float:
    return statistics.median(r[k] for r in runs)


def build_profiles(measured: dict[str, Any], spec: Any, memory: dict[str, int]) -> tuple[Any, list[dict[str, Any]]]:
    """A ProfileTable (one entry per device type, or per node where a type's nodes hold different ranges) from
    the worker's timings, and per-entry notes on how well the profile's model fits them."""
    from hetnode.planner.profile import (
        DeviceProfile,
        ProfileTable,
        Workload,
        interpolate,
        max_layers_for,
        with_throughput,
    )

    profiles: dict[str, DeviceProfile] = {}
    notes: list[dict[str, Any]] = []
    for e in measured["ranges"]:
        layers = e["last"] - e["first"]
        prompt = tuple((float(p["tokens"]), _median(p["runs"]) / layers) for p in e["prefill"])
        by_batch: dict[int, list[tuple[int, float]]] = {}
        for d in e["decode"]:
            b = d["batch"]
            by_batch.setdefault(b, []).append((b * d["context_per_item"], _median(d["runs"])))
        # Seconds per context token (per layer): the slope between the two contexts, the median over batches.
        slopes = []
        for pts in by_batch.values():
            (c0, t0), (c1, t1) = min(pts), max(pts)
            if c1 > c0:
                slopes.append((t1 - t0) / (c1 - c0))
        context_s = max(0.0, statistics.median(slopes)) / layers if slopes else 0.0
        decode = tuple((float(b), max(1e-9, statistics.mean(t - context_s * layers * c for c, t in pts) / layers))
                       for b, pts in sorted(by_batch.items()))
        key = ", ".join(e["keys"])
        mem = memory[e["device"]]
        base = DeviceProfile(name=e["keys"][0], memory_bytes=mem, max_layers=max_layers_for(mem, spec, 0.5),
                             prompt_curve=prompt, decode_curve=decode, decode_context_s=context_s,
                             source=f"measured on the testnet: {e['device']} layers [{e['first']}, {e['last']}), "
                                    f"paced steps as the node's batch loop runs them")
        for k in e["keys"]:
            profiles[k] = replace(with_throughput(base, spec, Workload()), name=k)
        # How far real compute stays below the pace (pacing can only stretch a step), and the mixed steps.
        all_runs = [r for p in e["prefill"] for r in p["runs"]] + [r for d in e["decode"] for r in d["runs"]]
        worst = max(all_runs, key=lambda r: r[1] / r[2])
        mixed = []
        prof = profiles[e["keys"][0]]
        for m in e["mixed"]:
            n, b, ctx = m["tokens"], m["batch"], m["batch"] * m["context_per_item"]
            one_pass = (layers * max(interpolate(prof.prompt_curve, n + b), interpolate(prof.decode_curve, b))
                        + layers * prof.decode_context_s * ctx)
            mixed.append({"tokens": n, "batch": b, "measured_s": _median(m["runs"]),
                          "profile_sum_s": prof.prefill_time(n, layers) + prof.decode_time(b, layers, ctx),
                          "profile_batched_s": one_pass})
        late = [r[0] - max(r[1], r[2]) for r in all_runs]
        notes.append({
            "key": key, "device": e["device"], "layers": layers,
            "prefill_s": {int(p["tokens"]): _median(p["runs"]) for p in e["prefill"]},
            "decode_s": {f"b{d['batch']}@ctx{d['context_per_item']}": _median(d["runs"]) for d in e["decode"]},
            "decode_context_s_per_layer": context_s,
            "max_real_over_paced": worst[1] / worst[2],
            "timer_lateness_ms_median": 1e3 * statistics.median(late),
            "mixed": mixed,
        })
    return ProfileTable(model=spec.name, profiles=profiles, source="measured on the testnet (validate_sim.py)"), notes


# -- 5. the workload -------------------------------------------------------------------------------------------


@dataclass
class Request:
    index: int
    at: float  # planned arrival, seconds after the start of the workload
    prompt: list[int]
    max_tokens: int
    sent: float = math.nan  # seconds after the start
    first: float = math.nan
    end: float = math.nan
    tokens: int = 0  # completion tokens (usage), a final stop token included
    finish: str = ""
    error: str = ""
    token_times: list[float] = field(default_factory=list)  # one per generated token

    @property
    def ok(self) -> bool:
        return not self.error and self.tokens > 0 and not math.isnan(self.end)

    @property
    def ttft(self) -> float:
        return self.first - self.sent

    @property
    def tpot(self) -> float:
        return (self.end - self.first) / (self.tokens - 1) if self.tokens > 1 else math.nan

    @property
    def e2e(self) -> float:
        return self.end - self.sent


def make_workload(rate: float, duration: float, inputs: tuple[int, int], outputs: tuple[int, int],
                  seed: int) -> list[Request]:
    rng = random.Random(seed)
    out: list[Request] = []
    t = rng.expovariate(rate)
    while t < duration:
        n = rng.randint(*inputs)
        out.append(Request(len(out), t, [rng.randrange(1000, 40000) for _ in range(n)], rng.randint(*outputs)))
        t += rng.expovariate(rate)
    return out


async def send_one(client: httpx.AsyncClient, r: Request, t0: float) -> None:
    body = {"model": MODEL, "prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": 0, "stream": True,
            "logprobs": 0, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                now = trio.current_time() - t0
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    r.error = f"error mid-stream: {chunk['error']}"
                    return
                for choice in chunk.get("choices", []):
                    if math.isnan(r.first):
                        r.first = now
                    lp = choice.get("logprobs") or {}
                    r.token_times.extend([now] * len(lp.get("tokens") or []))
                    if choice.get("finish_reason"):
                        r.finish, r.end = choice["finish_reason"], now
                if chunk.get("usage"):
                    r.tokens = chunk["usage"]["completion_tokens"]
    except (httpx.HTTPError, OSError, ValueError) as exc:
        r.error = f"{type(exc).__name__}: {exc}"
        return
    # A final stop token has no text and no logprob entry; every token was generated by the end.
    r.token_times.extend([r.end] * max(0, r.tokens - len(r.token_times)))
    del r.token_times[r.tokens:]


async def drive(client: httpx.AsyncClient, requests: list[Request], t0: float, drain_s: float) -> None:
    """Send every request at t0 + its time."""
    with trio.move_on_at(t0 + requests[-1].at + drain_s):
        async with trio.open_nursery() as nursery:
            for r in requests:
                await trio.sleep_until(t0 + r.at)
                r.sent = trio.current_time() - t0
                nursery.start_soon(send_one, client, r, t0)
    for r in requests:
        if not r.ok and not r.error:
            r.error = "unfinished when the drain time ran out"


async def warm_up(client: httpx.AsyncClient, count: int, t0: float, seed: int) -> list[Request]:
    """A burst of short requests, so that every node has served one: a coordinator opens its long-lived stream
    to a node, and the node its stream back, on first use (protocol negotiation: round trips that later
    requests do not pay)."""
    rng = random.Random(seed + 2)
    out = [Request(i, 0.0, [rng.randrange(1000, 40000) for _ in range(16)], 2) for i in range(count)]
    async with trio.open_nursery() as nursery:
        for r in out:
            r.sent = r.at = trio.current_time() - t0
            nursery.start_soon(send_one, client, r, t0)
    await trio.sleep(0.5)
    return out


async def calibrate(client: httpx.AsyncClient, count: int, t0: float, seed: int) -> list[Request]:
    """Requests one at a time, each alone on the testnet: what they take beyond their steps and links is the
    software's own time per request and per token (compared with the simulator's prediction later)."""
    rng = random.Random(seed + 1)
    out = []
    for i in range(count):
        r = Request(i, 0.0, [rng.randrange(1000, 40000) for _ in range(CALIBRATION_INPUT)], CALIBRATION_OUTPUT)
        r.sent = r.at = trio.current_time() - t0
        await send_one(client, r, t0)
        out.append(r)
        await trio.sleep(0.3)  # the Releases go out before the next request
    return out


async def lag_probe(lags: list[float], period: float = 0.05) -> None:
    """How late a sleep wakes in this process: the machine's scheduling delay, as every testnet process sees it
    too (a step's pacing, a message's delivery, the coordinator's answer)."""
    while True:
        t = trio.current_time()
        await trio.sleep(period)
        lags.append(trio.current_time() - t - period)


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    import psutil

    out = {}
    for name, pid in pids.items():
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        out[name] = t.user + t.system
    return out


def percentiles(values: Sequence[float], ps: Sequence[int] = (50, 90)) -> dict[str, float | None]:
    import numpy as np

    xs = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    if xs.size == 0:
        return {"count": 0, "mean": None, **{f"p{p}": None for p in ps}, "max": None}
    return {"count": int(xs.size), "mean": float(xs.mean()),
            **{f"p{p}": float(v) for p, v in zip(ps, np.percentile(xs, list(ps)), strict=True)},
            "max": float(xs.max())}


def testnet_summary(requests: list[Request], window: tuple[float, float]) -> dict[str, Any]:
    lo, hi = window
    measured = [r for r in requests if lo <= r.sent < hi]
    done = [r for r in measured if r.ok]
    tokens = sum(1 for r in requests if r.ok for t in r.token_times if lo <= t < hi)
    return {
        "requests": {"sent": len(requests), "measured": len(measured), "finished": len(done),
                     "failed": sum(1 for r in measured if not r.ok)},
        "decode_throughput": tokens / (hi - lo),
        "latency": {"ttft": percentiles([r.ttft for r in done]), "tpot": percentiles([r.tpot for r in done]),
                    "e2e": percentiles([r.e2e for r in done])},
        "finish_reasons": dict(sorted({f: sum(1 for r in done if r.finish == f)
                                       for f in {r.finish for r in done}}.items())),
    }


def handoffs_logged(path: Path) -> dict[str, Any]:
    """The KV the coordinator handed over, per codec, from its log ("session ... hands over the KV of N tokens:
    a>b layers [x,y) int8 123 bytes, ..."), and how many sessions it re-prefilled on the decode side instead."""
    import re

    text = path.read_text(errors="replace") if path.exists() else ""
    moved: dict[str, float] = {}
    transfers: dict[str, int] = {}
    sessions = 0
    for line in text.splitlines():
        if "hands over the KV" not in line:
            continue
        sessions += 1
        for codec, size in re.findall(r"layers \[\d+,\d+\) (\w+) (\d+) bytes", line):
            moved[codec] = moved.get(codec, 0.0) + float(size)
            transfers[codec] = transfers.get(codec, 0) + 1
    return {"sessions": sessions, "bytes_by_codec": dict(sorted(moved.items())),
            "links_by_codec": dict(sorted(transfers.items())), "reprefilled": text.count("re-prefilling")}


# -- 3./4. links and plan from the coordinator ----------------------------------------------------------------


def plan_from_api(plan: dict[str, Any], spec: Any) -> Any:
    from hetnode.planner.plan import SINK, SOURCE, NodePlacement, PlacementPlan, Replica

    peer = {s["name"]: s["peer_id"] for s in plan["shards"]}
    peer.update({SOURCE: SOURCE, SINK: SINK})
    return PlacementPlan(
        cluster="testnet", model=spec.name, num_layers=spec.num_layers, method=plan["method"],
        placements=tuple(NodePlacement(s["peer_id"], s["first_layer"], s["last_layer"]) for s in plan["shards"]),
        flows={(peer.get(f["from"], f["from"]), peer.get(f["to"], f["to"])): float(f["flow"]) for f in plan["flows"]},
        max_flow=float(plan["max_flow"]), upper_bound=math.inf if plan.get("upper_bound") is None
        else float(plan["upper_bound"]), status=plan.get("status", ""), partial_inference=False,
        replicas=tuple(Replica(r["role"], tuple(peer[n] for n in r["nodes"])) for r in plan.get("replicas", ())))


def sim_cluster(view: dict[str, Any], coordinator: str, home_region: str, links: str, emulated: Any) -> Any:
    """The cluster over peer ids (as the coordinator plans it), with measured or emulated links."""
    from hetnode.planner.cluster import COORDINATOR, ClusterSpec, LinkSpec, NodeSpec

    up = [n for n in view["nodes"] if n["state"] == "up"]
    nodes = tuple(NodeSpec(n["peer_id"], n["profile"]["device_type"], n["region"],
                           n["profile"]["memory_bytes"] / 2**30) for n in up)
    names = {n["peer_id"]: n["name"] for n in up}
    names[coordinator] = COORDINATOR
    ends = [*(n["peer_id"] for n in up), coordinator]
    key = {p: (COORDINATOR if p == coordinator else p) for p in ends}
    pairs: dict[frozenset[str], LinkSpec] = {}
    for i, a in enumerate(ends):
        for b in ends[i + 1:]:
            if links == "emulated":
                pairs[frozenset((key[a], key[b]))] = emulated.link(names[a], names[b])
                continue
            found = [lk for lk in view["links"] if {lk["src"], lk["dst"]} == {a, b} and lk["bandwidth_mbps"] > 0]
            if not found:
                raise RuntimeError(f"no measured link between {names[a]} and {names[b]}")
            pairs[frozenset((key[a], key[b]))] = LinkSpec(
                bandwidth_mbps=min(lk["bandwidth_mbps"] for lk in found),
                latency_ms=max(lk["rtt_ms"] for lk in found) / 2)
    return ClusterSpec(name=f"testnet-{links}", nodes=nodes, coordinator_region=home_region, pair_links=pairs,
                       description=f"the testnet's nodes with {links} links")


def link_rows(view: dict[str, Any], emulated: Any) -> list[dict[str, Any]]:
    rows = []
    for lk in sorted(view["links"], key=lambda x: (x["src_name"], x["dst_name"])):
        spec = emulated.link(lk["src_name"], lk["dst_name"])
        rows.append({"link": f"{lk['src_name']}->{lk['dst_name']}", "mbps": lk["bandwidth_mbps"],
                     "rtt_ms": lk["rtt_ms"], "emulated_mbps": spec.bandwidth_mbps,
                     "emulated_rtt_ms": 2 * spec.latency_ms})
    return rows


# -- the experiment --------------------------------------------------------------------------------------------


async def experiment(args: argparse.Namespace, work_dir: Path) -> dict[str, Any]:
    from hetnode.coordinator.deployment import PLAN_BYTES_PER_PARAM
    from hetnode.models.resolve import load_config
    from hetnode.planner.cluster import load_cluster
    from hetnode.planner.model import from_model_config
    from hetnode.planner.profile_sources import profile_table_to_dict, save_profile_table
    from hetnode.testnet import launcher

    result: dict[str, Any] = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                              "cores": os.cpu_count(), "load_before": load_avg()}
    cfg = load_config(args.model)
    plan_spec = from_model_config(args.model, cfg, bytes_per_param=PLAN_BYTES_PER_PARAM)  # the coordinator's
    cluster_file = launcher.resolve_cluster_file(args.cluster)
    emulated = load_cluster(cluster_file)
    ns = argparse.Namespace(
        cluster=args.cluster, nodes=None, model=args.model, detach=False, state_dir=work_dir / "testnet",
        api="127.0.0.1:0", api_key=None, token=None, heartbeat_deadline=5.0, ready_timeout=300.0,
        log_level="info", compute_dilation=args.dilation, placement=args.placement, scheduler="iwrr",
        plan_time_limit=10.0, kv_codec=args.kv_codec)
    t_up = time.perf_counter()
    log(f"starting the testnet: cluster {args.cluster}, {args.model}, compute dilation {args.dilation:g}, "
        f"placement {args.placement} (load {load_avg()})")
    running = await launcher.start(ns)
    coordinator = next(p.peer_id for p in running.state.procs if p.role == "coordinator")
    coordinator_log = Path(next(p.log for p in running.state.procs if p.role == "coordinator"))
    log(f"testnet up in {time.perf_counter() - t_up:.1f} s: {running.state.api}")
    try:
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
        async with httpx.AsyncClient(base_url=running.state.api, timeout=httpx.Timeout(900.0), limits=limits) as c:
            n = len(emulated.nodes)
            view = (await c.get("/v1/cluster", params={"min_up": n, "min_links": n * (n + 1), "timeout": 60})).json()
            for _ in range(2):  # GET /v1/plan's long-poll waits a minute at most
                answer = (await c.get("/v1/plan", params={"ready": "true", "min_nodes": n, "timeout": 60})).json()
                if answer["satisfied"]:
                    break
            plan: dict[str, Any] | None = answer.get("plan")
            if not answer["satisfied"] or not plan:
                raise RuntimeError(f"no ready plan of all {n} nodes within 120 s: {plan}")
            stages = [f"{s['name']}[{s['first_layer']},{s['last_layer']})" for s in plan["shards"]]
            log(f"plan {plan['version']} ({plan['method']}, max flow {plan['max_flow']:.0f} tokens/s): "
                + ", ".join(stages) + "; flows " + ", ".join(f"{f['from']}->{f['to']} {f['flow']:.0f}"
                                                           for f in plan["flows"]))
            result["plan"] = plan

            # 2. Profiles: every layer range of the plan, with the pace of each device type that holds it.
            device_of = {nd["peer_id"]: nd["profile"]["device_type"] for nd in view["nodes"]}
            memory = {nd["profile"]["device_type"]: nd["profile"]["memory_bytes"] for nd in view["nodes"]}
            ranges: dict[tuple[int, int], list[str]] = {}
            for s in plan["shards"]:
                devs = ranges.setdefault((s["first_layer"], s["last_layer"]), [])
                if device_of[s["peer_id"]] not in devs:
                    devs.append(device_of[s["peer_id"]])
            profile_cfg = {
                "model": args.model, "dilation": args.dilation, "reps": args.profile_reps,
                "prefill": args.prefill_points, "decode": args.decode_points, "contexts": args.contexts,
                "mixed": [[args.input[1], 4], [args.input[1], 16]] if not args.quick else [[args.input[1], 4]],
                "ranges": [{"first": f, "last": la, "devices": sorted(d)} for (f, la), d in sorted(ranges.items())],
            }
            log(f"measuring profiles on the testnet (worker process, {LAUNCHER_ENV}; load {load_avg()}) ...")
            t_prof = time.perf_counter()
            raw = await measure_profiles(profile_cfg)
            holders: dict[tuple[int, int, str], list[str]] = {}
            for s in plan["shards"]:
                holders.setdefault((s["first_layer"], s["last_layer"], device_of[s["peer_id"]]), []).append(s["name"])
            for e in raw["ranges"]:  # a device type's profile, or its nodes' where the type holds several ranges
                several = sum(1 for devs in ranges.values() if e["device"] in devs) > 1
                e["keys"] = sorted(holders[(e["first"], e["last"], e["device"])]) if several else [e["device"]]
            profiles, notes = build_profiles(raw, plan_spec, memory)
            result["profiles"] = {"worker_threads": raw["threads"], "notes": notes, "concurrent": raw["concurrent"],
                                  "seconds": time.perf_counter() - t_prof}
            result["codec_rates"] = raw["codec_rates"]
            result["profile_table"] = profile_table_to_dict(profiles)
            if args.out:
                save_profile_table(profiles, args.out)
            for note in notes:
                pf = ", ".join(f"{k}: {v * 1e3:.0f}" for k, v in note["prefill_s"].items())
                dc = ", ".join(f"{k}: {v * 1e3:.0f}" for k, v in note["decode_s"].items())
                log(f"  {note['key']} ({note['layers']} layers) prefill ms {{{pf}}}; decode ms {{{dc}}}; "
                    f"real/paced at most {note['max_real_over_paced']:.2f}")
            log(f"profiles measured in {result['profiles']['seconds']:.0f} s")

            # 3. Links, as the coordinator measured them just before the run (and the nodes' KV pools).
            view = (await c.get("/v1/cluster")).json()
            result["links_before"] = link_rows(view, emulated)
            kv_pool = {nd["peer_id"]: (nd["load"]["kv_blocks_used"] + nd["load"]["kv_blocks_free"]) * 16
                       for nd in view["nodes"] if nd["state"] == "up"}

            # 5. Calibration (requests alone on the testnet), then the workload. One timeline from t0: the
            # simulator replays both, so its scheduler sees every request the coordinator's saw.
            t0 = trio.current_time()
            warm = await warm_up(c, 3 * len(plan["shards"]), t0, args.seed)
            log(f"calibration: {args.calibration} requests one at a time ({CALIBRATION_INPUT} prompt tokens, "
                f"{CALIBRATION_OUTPUT} new), after {len(warm)} warm-up requests at once ...")
            calibration = await calibrate(c, args.calibration, t0, args.seed)
            bad = [r for r in warm + calibration if not r.ok]
            if bad:
                raise RuntimeError(f"a warm-up or calibration request failed: {bad[0].error}")
            for i, r in enumerate(calibration):
                r.index = len(warm) + i
            start = trio.current_time() - t0 + 1.0
            requests = make_workload(args.rate, args.duration, tuple(args.input), tuple(args.output), args.seed)
            for r in requests:
                r.index += len(warm) + len(calibration)
                r.at += start
            log(f"workload: {len(requests)} requests, Poisson at {args.rate:g} req/s for {args.duration:g} s "
                f"(warm-up {args.warmup:g} s), input {args.input[0]}-{args.input[1]}, max_tokens "
                f"{args.output[0]}-{args.output[1]}; load {load_avg()}")
            result["load_workload_start"] = load_avg()
            pids = {p.name: p.pid for p in running.state.procs} | {"client (this script)": os.getpid()}
            cpu0 = cpu_seconds(pids)
            t_run = time.perf_counter()
            lags: list[float] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lag_probe, lags)
                await drive(c, requests, t0, args.drain)
                nursery.cancel_scope.cancel()
            result["lag_ms"] = {k: v if v is None or k == "count" else v * 1e3
                                for k, v in percentiles(lags, (50, 90, 99)).items()}
            result["workload_wall_s"] = wall = time.perf_counter() - t_run
            cpu1 = cpu_seconds(pids)
            result["load_workload_end"] = load_avg()
            tokens = sum(r.tokens for r in requests if r.ok)
            result["cpu"] = {name: {"cores": (cpu1[name] - cpu0[name]) / wall,
                                    "ms_per_token": 1e3 * (cpu1[name] - cpu0[name]) / max(1, tokens)}
                             for name in cpu1 if name in cpu0}
            failed = [r for r in requests if not r.ok]
            log(f"testnet done in {wall:.0f} s: {len(requests) - len(failed)} finished, {len(failed)} failed; "
                f"load {load_avg()}; CPU (cores): " + ", ".join(f"{k} {v['cores']:.2f}"
                                                                 for k, v in result["cpu"].items()))
            for r in failed[:5]:
                log(f"  request {r.index}: {r.error}")
            view_after = (await c.get("/v1/cluster")).json()
            result["links_after"] = link_rows(view_after, emulated)
            plan_after = (await c.get("/v1/plan")).json().get("plan")
            if plan_after and plan_after["version"] != plan["version"]:
                log(f"WARNING: the plan changed during the run (version {plan['version']} -> "
                    f"{plan_after['version']})")
            result["plan_version_after"] = plan_after["version"] if plan_after else None
    finally:
        log("stopping the testnet ...")
        await launcher.stop(running)

    result["workload_start_s"] = start
    window = (start + args.warmup, start + args.duration)
    result["testnet"] = testnet_summary(requests, window)
    result["testnet"]["kv_handoff"] = handoffs_logged(coordinator_log)
    result["requests"] = [{"phase": phase, "at": r.at, "sent": r.sent, "input": len(r.prompt),
                           "max_tokens": r.max_tokens, "tokens": r.tokens, "finish": r.finish, "ttft": r.ttft,
                           "tpot": r.tpot, "e2e": r.e2e, "error": r.error}
                          for phase, rs in (("warm-up", warm), ("calibration", calibration), ("workload", requests))
                          for r in rs]

    result["sim_inputs"] = {"plan": plan, "view": view, "coordinator": coordinator, "kv_pool": kv_pool}
    return result


def simulate_all(result: dict[str, Any], args: argparse.Namespace) -> None:
    """6. The simulator: the testnet's plan, scheduler, links, arrivals and lengths, measured profiles and KV
    pools; with measured and emulated links, and both ways of pricing mixed steps."""
    from hetnode.coordinator.deployment import PLAN_BYTES_PER_PARAM, PlanningConfig
    from hetnode.coordinator.routing import make_scheduler, scheduler_for
    from hetnode.models.resolve import load_config
    from hetnode.planner.cluster import load_cluster
    from hetnode.planner.model import from_model_config
    from hetnode.planner.profile import kv_tokens
    from hetnode.planner.profile_sources import parse_profile_table
    from hetnode.testnet import launcher
    from hetnode.testnet.sim import SimOptions, Workload, simulate

    inputs = result["sim_inputs"]
    plan, view, coordinator = inputs["plan"], inputs["view"], inputs["coordinator"]
    codec_rates = {c: tuple(r) for c, r in result.get("codec_rates", {}).items()} or None
    plan_spec = from_model_config(args.model, load_config(args.model), bytes_per_param=PLAN_BYTES_PER_PARAM)
    table = parse_profile_table(result["profile_table"], plan_spec, "measured on the testnet")
    # Entries by node name (a type whose nodes hold different layer ranges) serve the node's peer id here.
    by_peer = {nd["peer_id"]: table.profiles[nd["name"]] for nd in view["nodes"] if nd["name"] in table.profiles}
    profiles = replace(table, profiles={**table.profiles, **by_peer})
    emulated = load_cluster(launcher.resolve_cluster_file(args.cluster))
    placement = plan_from_api(plan, plan_spec)
    pc = PlanningConfig()
    sim_spec = replace(plan_spec, bytes_per_activation=4.0)  # nodes send fp32 hidden states
    mem_by_peer = {nd["peer_id"]: nd["profile"]["memory_bytes"] for nd in view["nodes"]}
    start = result["workload_start_s"]
    replayed = [r for r in result["requests"] if not r["error"]]
    link_modes = ("measured", "emulated") if args.links == "both" else (args.links,)
    clusters = {links: sim_cluster(view, coordinator, emulated.coordinator_region, links, emulated)
                for links in link_modes}

    def run_sim(links: str, mixed: str, request_s: float, token_s: float, requests: list[dict[str, Any]],
                duration: float, warmup: float) -> Any:
        # A fresh instance of the coordinator's scheduler, with the coordinator's options.
        # A split plan is routed by CLS with the nodes' regions, as the coordinator's deployment routes it. The
        # KV capacities are the nodes' real pools, which replace the planner's estimate in the coordinator's
        # scheduler at their first heartbeat after loading (Deployment.on_load), long before any request.
        live = {"regions": {nd["peer_id"]: nd["region"] for nd in view["nodes"]}} if placement.replicas else {}
        scheduler = make_scheduler(
            scheduler_for(placement, pc.scheduler), placement, seed=plan["version"], high_water=pc.high_water,
            queue_limit=pc.queue_limit,
            kv_capacity={p.node: inputs["kv_pool"].get(p.node) or kv_tokens(mem_by_peer[p.node], plan_spec, p.layers)
                         for p in placement.placements},
            **live)
        workload = Workload(name="testnet-replay", inputs=tuple(r["input"] for r in requests),
                            outputs=tuple(r["tokens"] for r in requests), arrivals=tuple(r["sent"] for r in requests),
                            description="the testnet run's requests: send times and completion lengths")
        options = SimOptions(kv_capacity=inputs["kv_pool"], drain_s=args.drain, mixed_steps=mixed,
                             coordinator_request_s=request_s, coordinator_token_s=token_s,
                             kv_codec=getattr(args, "kv_codec", "auto"),
                             kv_transfer=getattr(args, "kv_transfer", "policy"), kv_codec_rates=codec_rates)
        return simulate(clusters[links], sim_spec, profiles, placement, workload=workload, scheduler=scheduler,
                        duration_s=duration, warmup_s=warmup, options=options)

    # Mixed steps: the pricing that the measured mixed steps support (the profile worker timed some).
    errors: dict[str, list[float]] = {mode: [] for mode in ("sum", "batched")}
    for note in result["profiles"]["notes"]:
        for m in note["mixed"]:
            for mode in errors:
                errors[mode].append(abs(m[f"profile_{mode}_s"] / m["measured_s"] - 1))
    mixed = "sum" if not errors["sum"] else min(errors, key=lambda mode: statistics.mean(errors[mode]))
    result["mixed_steps"] = {"chosen": mixed, "mean_abs_error": {k: statistics.mean(v) if v else None
                                                                  for k, v in errors.items()}}

    # The coordinator's time: what each calibration request took beyond the simulator's prediction for it
    # (alone, so nothing queues: the prediction is its steps and links) is software time per request and
    # per token. The simulator gets it as the coordinator's service times.
    before = [r for r in replayed if r["phase"] != "workload"]  # warm-up and calibration: the same routing
    alone = run_sim(link_modes[0], mixed, 0.0, 0.0, before, start, 0.0)
    names = {nd["peer_id"]: nd["name"] for nd in view["nodes"]}
    rows = []
    for r, rec in zip(before, alone.requests, strict=True):
        if r["phase"] == "calibration":
            rows.append({"path": _named(rec.path, names), "ttft": r["ttft"], "sim_ttft": rec.ttft,
                         "tpot": r["tpot"], "sim_tpot": rec.tpot})
    warmed = sorted({_named(rec.path, names) for r, rec in zip(before, alone.requests, strict=True)
                     if r["phase"] == "warm-up"})
    token_s = max(0.0, statistics.median(q["tpot"] - q["sim_tpot"] for q in rows))
    request_s = max(0.0, statistics.median(q["ttft"] - q["sim_ttft"] for q in rows) - token_s)
    result["coordinator_time"] = {"request_s": request_s, "token_s": token_s, "calibration": rows,
                                  "warmed_up": warmed}

    sims: dict[tuple[str, str, str], Any] = {}
    window = (start + args.warmup, start + args.duration)
    for links in link_modes:
        for mode in ("sum", "batched"):
            for overhead in ("none", "measured"):
                req, tok = (request_s, token_s) if overhead == "measured" else (0.0, 0.0)
                sims[(links, mode, overhead)] = run_sim(links, mode, req, tok, replayed, window[1], window[0])
    key = (link_modes[0], mixed, "measured")
    primary = sims[key]
    result["primary"] = {"links": key[0], "mixed_steps": key[1], "coordinator_time": key[2],
                         "kv_transfer": getattr(args, "kv_transfer", "policy")}
    result["sim"] = {"summary": primary.summary, "nodes": [asdict(n) for n in primary.nodes]}
    if "kv_handoff" in primary.summary:
        result["sim"]["kv_handoff"] = primary.summary["kv_handoff"]
    result["compare"] = compare(result["testnet"], primary)
    result["variants"] = {"/".join(k): compare(result["testnet"], sim) for k, sim in sims.items()}
    for r, rec in zip(replayed, primary.requests, strict=True):
        r["sim_ttft"], r["sim_tpot"], r["sim_e2e"], r["sim_path"] = rec.ttft, rec.tpot, rec.e2e, _named(rec.path,
                                                                                                            names)
    result["classes"] = classes(result, window)


def _named(path: str, names: dict[str, str]) -> str:
    for peer, name in names.items():
        path = path.replace(peer, name)
    return path


def classes(result: dict[str, Any], window: tuple[float, float]) -> dict[str, Any]:
    """Fast and slow requests, by one TPOT threshold applied to each side's own TPOTs: the testnet does not say
    which node served a request, and the replayed scheduler's choices drift from the coordinator's once
    requests finish in a different order (its running mean of output lengths weighs later choices)."""
    done = [r for r in result["requests"] if r["phase"] == "workload" and window[0] <= r["sent"] < window[1]
            and r.get("sim_tpot") is not None and r.get("tpot") is not None]
    by_path: dict[str, list[float]] = {}
    for r in done:
        by_path.setdefault(r["sim_path"], []).append(r["sim_tpot"])
    medians = [statistics.median(v) for v in by_path.values()]
    if len(medians) < 2 or max(medians) < 2 * min(medians):
        return {}
    cut = math.sqrt(min(medians) * max(medians))
    out: dict[str, Any] = {"tpot_threshold_s": cut, "sim_paths": {p: len(v) for p, v in by_path.items()}}
    for label, test in (("fast", lambda x: x < cut), ("slow", lambda x: x >= cut)):
        tn = [r for r in done if test(r["tpot"])]
        sm = [r for r in done if test(r["sim_tpot"])]
        out[label] = {side: {"requests": len(rs), "ttft_p50": statistics.median(r[k + "ttft"] for r in rs),
                             "tpot_p50": statistics.median(r[k + "tpot"] for r in rs)} if rs else None
                      for side, rs, k in (("testnet", tn, ""), ("sim", sm, "sim_"))}
    return out


ROWS = (("decode throughput (tok/s)", ("decode_throughput",), 1.0),
        ("TTFT p50 (ms)", ("latency", "ttft", "p50"), 1e3), ("TTFT p90 (ms)", ("latency", "ttft", "p90"), 1e3),
        ("TPOT p50 (ms)", ("latency", "tpot", "p50"), 1e3), ("TPOT p90 (ms)", ("latency", "tpot", "p90"), 1e3),
        ("E2E p50 (s)", ("latency", "e2e", "p50"), 1.0))
HEADLINE = {"decode throughput (tok/s)", "TTFT p50 (ms)", "TPOT p50 (ms)"}


def _get(d: dict[str, Any], path: Sequence[str]) -> float | None:
    for k in path:
        if d is None:
            return None
        d = d.get(k)  # type: ignore[assignment]
    return d  # type: ignore[return-value]


def compare(testnet: dict[str, Any], sim: Any) -> list[dict[str, Any]]:
    rows = []
    for label, path, scale in ROWS:
        a, b = _get(testnet, path), _get(sim.summary, path)
        ratio = b / a if a and b is not None else None
        rows.append({"metric": label, "testnet": None if a is None else a * scale,
                     "sim": None if b is None else b * scale, "sim_over_testnet": ratio,
                     "within_target": None if ratio is None else abs(ratio - 1) <= TARGET,
                     "headline": label in HEADLINE})
    return rows


def _table(rows: list[dict[str, Any]]) -> None:
    print(f"{'metric':<27} {'testnet':>10} {'simulator':>10} {'sim/testnet':>12}  within {TARGET:.0%}")
    for row in rows:
        if row["testnet"] is None or row["sim"] is None:
            print(f"{row['metric']:<27} {'-':>10} {'-':>10}")
            continue
        mark = "✓" if row["within_target"] else "✗"
        print(f"{row['metric']:<27} {row['testnet']:>10.1f} {row['sim']:>10.1f} {row['sim_over_testnet']:>11.3f}x"
              f"  {mark}{'' if row['headline'] else ' (not a target)'}")


def _per_codec(kv: dict[str, Any] | None, counts: str) -> str:
    if not kv:
        return "-"
    return ", ".join(f"{c} {b / 1e6:.2f} MB ({kv[counts][c]})" for c, b in kv["bytes_by_codec"].items()) or "none"


def _kv_report(r: dict[str, Any]) -> None:
    """Split runs: the KV the coordinator logged per codec beside the simulator's, and the simulated hand-off."""
    kv_sim, kv_net = r.get("sim", {}).get("kv_handoff"), r.get("testnet", {}).get("kv_handoff")
    if not kv_sim and not (kv_net and kv_net["sessions"]):
        return
    print(f"KV handed over (all requests; transfers in brackets): testnet {_per_codec(kv_net, 'links_by_codec')} "
          f"in {kv_net['sessions'] if kv_net else 0} sessions, {kv_net['reprefilled'] if kv_net else 0} "
          f"re-prefilled; simulator {_per_codec(kv_sim, 'transfers_by_codec')} "
          f"({r['primary'].get('kv_transfer', 'policy')})")
    gap = kv_sim["prefill_end_to_decode_s"] if kv_sim else {"count": 0}
    if gap["count"]:
        rates = ", ".join(f"{c} {pk / 1e9:.2f}/{up / 1e9:.2f}" for c, (pk, up) in kv_sim["codec_rates"].items())
        print(f"  simulator: prefill end -> first decode step mean {gap['mean'] * 1e3:.1f} ms, p50 "
              f"{gap['p50'] * 1e3:.1f} ms; codec rates (GB/s, pack/unpack) {rates}")


def print_report(r: dict[str, Any]) -> None:
    s = r["settings"]
    print(f"\n== simulator vs testnet: cluster {s['cluster']} ({s['model']}), compute dilation {s['dilation']:g}, "
          f"plan {r['plan']['method']} v{r['plan']['version']} ==")
    print("plan: " + ", ".join(f"{st['name']}[{st['first_layer']},{st['last_layer']})" for st in r["plan"]["shards"])
          + "; flows " + ", ".join(f"{f['from']}->{f['to']} {f['flow']:.0f}" for f in r["plan"]["flows"]
                                   if f["from"] == "source" or f["to"] != "sink"))
    print(f"profiles (measured on the testnet in {r['profiles']['seconds']:.0f} s"
          f"{', slower devices timed together' if r['profiles'].get('concurrent') else ''}; whole step, ms):")
    for n in r["profiles"]["notes"]:
        pf = "  ".join(f"{k}: {v * 1e3:.0f}" for k, v in n["prefill_s"].items())
        dc = "  ".join(f"{k}: {v * 1e3:.0f}" for k, v in n["decode_s"].items())
        print(f"  {n['key']:<6} prefill {pf}")
        print(f"  {'':<6} decode  {dc}")
        print(f"  {'':<6} real compute / paced step at most {n['max_real_over_paced']:.2f}; wake-up lateness "
              f"median {n['timer_lateness_ms_median']:.1f} ms")
        for m in n["mixed"]:
            print(f"  {'':<6} mixed step {m['tokens']} prompt tokens + {m['batch']} decodes: measured "
                  f"{m['measured_s'] * 1e3:.0f}; priced as prefill + decode {m['profile_sum_s'] * 1e3:.0f}, "
                  f"as one pass {m['profile_batched_s'] * 1e3:.0f}")
    ms = r["mixed_steps"]
    print(f"mixed steps priced \"{ms['chosen']}\" (mean error on the measured mixed steps: "
          + ", ".join(f"{k} {v:.0%}" for k, v in ms["mean_abs_error"].items() if v is not None) + ")")
    print("links (the coordinator's probes before the run; emulated in brackets):")
    for lk in r["links_before"]:
        print(f"  {lk['link']:<24} {lk['mbps']:7.1f} Mbit/s [{lk['emulated_mbps']:g}]  RTT {lk['rtt_ms']:6.1f} ms "
              f"[{lk['emulated_rtt_ms']:g}]")
    ct = r["coordinator_time"]
    print(f"coordinator time (calibration: {len(ct['calibration'])} requests alone, testnet minus the simulator's "
          f"prediction): {ct['request_s'] * 1e3:.1f} ms per request, {ct['token_s'] * 1e3:.1f} ms per token "
          f"(warm-up requests reached {', '.join(ct['warmed_up'])})")
    for q in ct["calibration"]:
        print(f"  {q['path']:<16} TTFT {q['ttft'] * 1e3:7.1f} ms (sim {q['sim_ttft'] * 1e3:7.1f})   TPOT "
              f"{q['tpot'] * 1e3:7.1f} ms (sim {q['sim_tpot'] * 1e3:7.1f})")
    t = r["testnet"]
    print(f"workload: {t['requests']['sent']} requests, {t['requests']['measured']} in the window "
          f"[{s['warmup']:g}, {s['duration']:g}) s of the workload, {t['requests']['finished']} finished, "
          f"{t['requests']['failed']} failed; finish reasons {t['finish_reasons']}")
    if r.get("lag_ms"):
        lag = r["lag_ms"]
        print(f"scheduling delay (a 50 ms sleep's lateness in this process during the workload): median "
              f"{lag['p50']:.1f} ms, p90 {lag['p90']:.1f}, p99 {lag['p99']:.1f}, max {lag['max']:.0f}")
    if r.get("cpu"):
        print("CPU during the workload (cores; ms per generated token): " + ", ".join(
            f"{k} {v['cores']:.2f} ({v['ms_per_token']:.1f})" for k, v in r["cpu"].items()))
    p = r["primary"]
    print(f"\nsimulator: {p['links']} links, mixed steps \"{p['mixed_steps']}\", "
          f"coordinator time {p['coordinator_time']}")
    _table(r["compare"])
    _kv_report(r)
    print("\nvariants (links/mixed steps/coordinator time; sim/testnet for throughput, TTFT p50, TPOT p50):")
    for name, rows in r["variants"].items():
        got = {row["metric"]: row["sim_over_testnet"] for row in rows}
        print(f"  {name:<28} " + "  ".join(f"{got[k]:.3f}x" if got[k] is not None else "-"
                                           for k in ("decode throughput (tok/s)", "TTFT p50 (ms)", "TPOT p50 (ms)")))
    cl = r.get("classes")
    if cl:
        print(f"by class (TPOT below or above {cl['tpot_threshold_s'] * 1e3:.0f} ms on each side; the simulator "
              f"routed " + ", ".join(f"{k}: {v}" for k, v in cl["sim_paths"].items()) + "):")
        for label in ("fast", "slow"):
            a, b = cl[label]["testnet"], cl[label]["sim"]
            if a and b:
                print(f"  {label}: {a['requests']} vs {b['requests']} requests; TTFT p50 {a['ttft_p50'] * 1e3:.0f} "
                      f"vs {b['ttft_p50'] * 1e3:.0f} ms ({b['ttft_p50'] / a['ttft_p50']:.3f}x); TPOT p50 "
                      f"{a['tpot_p50'] * 1e3:.0f} vs {b['tpot_p50'] * 1e3:.0f} ms "
                      f"({b['tpot_p50'] / a['tpot_p50']:.3f}x)")
    if "load_workload_start" in r:
        print(f"\n{r['cores']} cores; load average before {r['load_before']}, at the workload's start "
              f"{r['load_workload_start']}, at its end {r['load_workload_end']}; {r.get('elapsed_s', 0):.0f} s in all")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--cluster", default=CLUSTER, help="cluster file or shipped name (default: demo)")
    parser.add_argument("--placement", default="helix",
                        help="the coordinator's placement method (default: helix; split: phase-split replicas)")
    parser.add_argument("--kv-codec", default="auto", choices=["auto", "fp16", "int8", "int4"],
                        help="split: the coordinator's and the simulator's KV codec choice (default: auto)")
    parser.add_argument("--kv-transfer", default="policy", choices=["policy", "whole", "layerwise"],
                        help="split: how the simulator sends KV (default: policy, as the runtime's hops choose)")
    parser.add_argument("--dilation", type=float, default=1000.0, help="nodes' --compute-dilation (default 1000)")
    parser.add_argument("--rate", type=float, default=None, help="requests/s (default 1.5; quick 1.0)")
    parser.add_argument("--duration", type=float, default=None, help="seconds of arrivals (default 240; quick 40)")
    parser.add_argument("--warmup", type=float, default=None, help="seconds not measured (default 30; quick 10)")
    parser.add_argument("--drain", type=float, default=240.0, help="most seconds to wait for the last requests")
    parser.add_argument("--input", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                        help="prompt tokens, uniform (default 16 48)")
    parser.add_argument("--output", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                        help="max_tokens, uniform (default 16 64; quick 8 24)")
    parser.add_argument("--links", choices=["measured", "emulated", "both"], default="both",
                        help="links for the simulator: the coordinator's measurements, the cluster file's, or both "
                             "(the table then shows the measured ones; default: both)")
    parser.add_argument("--calibration", type=int, default=None, metavar="N",
                        help="requests sent alone before the workload, to measure the coordinator's time per request "
                             "and per token (default 8; quick 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write every result to OUT")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="write the measured profile table (TOML, or JSON for .json)")
    parser.add_argument("--keep-logs", type=Path, default=None, metavar="DIR", help="keep the testnet's logs in DIR")
    parser.add_argument("--replay", type=Path, default=None, metavar="JSON",
                        help="no testnet: simulate again from a --json file of an earlier run (its measured "
                             "profiles, plan, links and requests) and print the comparison")
    parser.add_argument("--profile-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.profile_worker:
        profile_worker_main()
        return
    if args.replay is not None:
        result = json.loads(args.replay.read_text())
        saved = argparse.Namespace(**{**result["settings"], "links": args.links, "kv_transfer": args.kv_transfer})
        simulate_all(result, saved)
        print_report(result)
        if args.json is not None:
            args.json.write_text(json.dumps(_finite(result), indent=2, default=str))
        return
    q = args.quick
    args.rate = args.rate or (1.0 if q else 1.5)
    args.calibration = args.calibration or (4 if q else 8)
    args.duration = args.duration or (40.0 if q else 240.0)
    args.warmup = args.warmup if args.warmup is not None else (10.0 if q else 30.0)
    args.input = args.input or [16, 48]
    args.output = args.output or ([8, 24] if q else [16, 64])
    args.prefill_points = [8, 32, 64] if q else [8, 16, 32, 48, 64, 96]
    args.decode_points = [1, 8] if q else [1, 2, 4, 8, 16, 32]
    args.contexts = [32, 96]
    args.profile_reps = 1 if q else 2
    if not 0 <= args.warmup < args.duration:
        parser.error("need 0 <= --warmup < --duration")

    t0 = time.perf_counter()
    if args.keep_logs is not None:
        args.keep_logs.mkdir(parents=True, exist_ok=True)
        result = trio.run(experiment, args, args.keep_logs.resolve())
    else:
        with tempfile.TemporaryDirectory(prefix="hetnode-validate-sim-") as tmp:
            result = trio.run(experiment, args, Path(tmp))
    if args.json is not None:  # the testnet's side first: --replay can simulate it again
        args.json.write_text(json.dumps(_finite(result), indent=2, default=str))
    simulate_all(result, args)
    result["elapsed_s"] = time.perf_counter() - t0
    print_report(result)
    if args.json is not None:
        args.json.write_text(json.dumps(_finite(result), indent=2, default=str))
        log(f"results in {args.json}")


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


if __name__ == "__main__":
    main()
