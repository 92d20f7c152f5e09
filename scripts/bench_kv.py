#!/usr/bin/env python
"""KV codecs for the hand-off between phases: their size, their speed on this CPU, and what they cost in quality.

Codec section: for SmolLM2-135M's KV (every layer, `--tokens` tokens; its shape read from the packaged GGUF)
and for one LLaMA-2 70B layer (2,048 tokens, 8 KV heads, head dim 128), the bytes of each codec against fp16
(scales included) and its pack and unpack rate, in GB of fp16 KV per second (best of `--repeats`).

Quality section: SmolLM2 (float32, CPU) prefills `--prefix` tokens of English text from the papers in
../shared/papers/; its KV is taken out of the engine's paged cache, round-tripped through each codec and
written back; then `--continuation` tokens of the same text are scored teacher-forced (perplexity change
against the unquantized KV, and how often the greedy choice agrees), and `--continuation` tokens are generated
greedily from the prefix (how many equal the unquantized run's, position by position).

Transfer section (Splitwise §IV-C, Fig. 14): two in-process hop servers, a prefill node and a decode node each
holding all of SmolLM2, with the link between them shaped to `--mbps` (100 Mbit/s) and 1 ms; a raw coordinator
installs a phase-split route and sends a prompt of 128, 512, 1024 and 2048 tokens. For each prompt the KV goes
whole after the prefill step (serialized) and layer-wise from inside it (the transfer policy's groups), and the
time from the prefill's end (its first token at the coordinator) to the decode side's KV being complete is
measured side by side, median of `--transfer-repeats`: the fraction of the serialized time that layer-wise
hides. A prefill step runs up to `--chunk` tokens (the engine's max_batch_tokens, 8192 by default: each prompt
is one step); with `--chunk 512` a longer prompt runs in steps, and the whole transfer of one step already
overlaps the next step's compute, so only the last step's transfer is left to hide.

Threshold section: the same rig with small prompts (2 to 128 tokens), timing from the prompt's send to decode
ready, whole and layer-wise (median of `--threshold-repeats`): layer-wise wins where the decode side is ready
sooner by more than the first token loses to it; the smallest transfer from which it wins, in seconds on the
link, is `KVTransferPolicy`'s default (`--mbps 1000` for a faster link).

    .venv/bin/python scripts/bench_kv.py [--quick] [--json] [--threads 1] [--windows 5]
        [--section codecs --section quality --section transfer --section threshold]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# Before torch loads: an OpenMP pool that spin-waits steals the core another process needs on a shared machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetnode.ids import NodeId, SessionId
from hetnode.kv.codecs import CODECS, GroupQuantCodec, KVCodec
from hetnode.models import load_config, resolve_model
from hetnode.models.tokenizer import load_tokenizer
from hetnode.node.engine import EngineConfig, SamplingParams, TorchEngine
from hetnode.node.engine.base import StepItem
from hetnode.node.engine.model import apply_rope
from hetnode.node.engine.rope import Rotary
from hetnode.node.hops import HopServer
from hetnode.policy import KVTransferPolicy
from hetnode.protocol.link_conditions import LinkSpec
from hetnode.protocol.mailbox import Mailbox
from hetnode.protocol.memory import MemoryNetwork
from hetnode.protocol.messages import (
    INFER_PROTOCOL,
    Assignment,
    AssignmentStatus,
    Failed,
    Hop,
    Install,
    Item,
    Items,
    KVLink,
    Phase,
    Ready,
    Release,
    Route,
    Sampling,
    Tokens,
    infer_decoder,
)
from hetnode.protocol.shaping import shaped_transport
from hetnode.protocol.tensors import to_wire

PAPERS = Path(__file__).resolve().parents[2] / "shared" / "papers"
LLAMA70B_LAYER = (1, 2048, 8, 128)  # one of LLaMA-2 70B's 80 layers: [L, T, KVH, D]
TARGET_INT4_RATIO = 3.5
TARGET_GBPS = 1.0
TARGET_PPL = {"int8": 0.5, "int4": 3.0}  # percent
FP16 = CODECS["fp16"]


# -- codec section ----------------------------------------------------------------------------------------


def _best(fn: Callable[[], object], repeats: int) -> float:
    """Best wall time of `repeats` runs: on a shared machine the minimum is the run least disturbed."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def codec_rows(
    name: str, shape: tuple[int, int, int, int], dtype: torch.dtype, repeats: int
) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    fp16_bytes = CODECS["fp16"].packed_size(*shape)
    rows = []
    for codec_name, codec in CODECS.items():
        data = codec.pack(k, v)
        codec.unpack(data, *shape, dtype=dtype)  # warm-up
        pack_s = _best(lambda c=codec: c.pack(k, v), repeats)
        unpack_s = _best(lambda c=codec, d=data: c.unpack(d, *shape, dtype=dtype), repeats)
        rows.append({
            "shape": name, "dims": list(shape), "dtype": str(dtype).removeprefix("torch."), "codec": codec_name,
            "bytes": data.nbytes, "fp16_bytes": fp16_bytes, "ratio": fp16_bytes / data.nbytes,
            "pack_gbps": fp16_bytes / pack_s / 1e9, "unpack_gbps": fp16_bytes / unpack_s / 1e9,
        })
    return rows


# -- quality section ----------------------------------------------------------------------------------------


def english_windows(tokenizer: Any, papers: Path, count: int, length: int) -> list[list[int]]:
    """`count` windows of `length` tokens of prose, one per paper: paragraphs only (no tables, headings, maths)."""
    windows = []
    for path in sorted(papers.glob("*.md"))[:count]:
        prose = [
            line.strip() for line in path.read_text().splitlines()
            if len(line) > 200 and not line.lstrip().startswith(("|", "#", "!", "<")) and line.count("$") < 4
        ]
        ids = tokenizer.encode(" ".join(prose))
        if len(ids) < length:
            raise SystemExit(f"{path.name}: only {len(ids)} tokens of prose, need {length}")
        windows.append(ids[:length])
    if len(windows) < count:
        raise SystemExit(f"need {count} papers in {papers}, found {len(windows)}")
    return windows


@dataclass(frozen=True)
class Variant:
    """What the KV goes through: the keys' codec, the values' codec, the most recent tokens sent as fp16
    (KIVI's full-precision residual: the nearest tokens are the ones the continuation attends to most), and
    whether keys are quantized before RoPE (KVQuant's idea: the sender undoes the rotation, the receiver redoes
    it, so a channel's values do not swing with the position)."""

    keys: KVCodec
    values: KVCodec
    recent: int = 0
    pre_rope: bool = False

    def round_trip(self, k: torch.Tensor, v: torch.Tensor, rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor, int]:
        """K and V (of positions 0 .. T-1) after the wire, and the bytes they took on it."""
        if self.pre_rope:
            tokens = k.shape[1]
            cos, sin = rotary.cos_sin(torch.arange(tokens), [(tokens, tokens)], torch.float32)
            cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # [1, T, 1, D] against [L, T, KVH, D]
            k2, v2, total = replace(self, pre_rope=False).round_trip(apply_rope(k, cos, -sin), v, rotary)
            return apply_rope(k2, cos, sin), v2, total
        cut = k.shape[1] - self.recent
        parts = [(k[:, :cut], v[:, :cut], self.keys, self.values), (k[:, cut:], v[:, cut:], FP16, FP16)]
        ks, vs, total = [], [], 0
        for kp, vp, kc, vc in parts:
            if kp.shape[1] == 0:
                continue
            # A codec packs K and V together; a variant that treats them differently takes each from its own.
            k_data, v_data = kc.pack(kp, vp), vc.pack(kp, vp)
            ks.append(kc.unpack(k_data, *kp.shape, dtype=kp.dtype)[0])
            vs.append(vc.unpack(v_data, *vp.shape, dtype=vp.dtype)[1])
            total += (k_data.nbytes + v_data.nbytes) // 2  # each codec's K and V halves are the same size
        return torch.cat(ks, 1), torch.cat(vs, 1), total


def variants(quick: bool) -> dict[str, Variant | None]:
    """The codecs, and the ideas tried on top of them (measured, so that the README can say what they buy)."""
    out: dict[str, Variant | None] = {"unquantized": None}
    out |= {name: Variant(CODECS[name], CODECS[name]) for name in ("fp16", "int8", "int4", "int2")}
    if quick:
        return out
    int4 = CODECS["int4"]
    int4_32, int2_32 = GroupQuantCodec(4, 32), GroupQuantCodec(2, 32)
    return out | {
        "int4 keys, fp16 values": Variant(int4, FP16),  # where int4's loss comes from
        "fp16 keys, int4 values": Variant(FP16, int4),
        "int4 g32": Variant(int4_32, int4_32),
        "int4 +128 recent fp16": Variant(int4, int4, recent=128),
        "int2 g32 +128 recent fp16": Variant(int2_32, int2_32, recent=128),  # KIVI's own 2-bit recipe
        "int4, keys before RoPE": Variant(int4, int4, pre_rope=True),
    }


def continuation(engine: TorchEngine, session: SessionId, start: int, tokens: list[int], forced: bool) -> list[Any]:
    """Decode from position `start`: feed `tokens` one by one (teacher-forced) or each greedy choice (free
    running, starting from tokens[0]). Returns the logits [V] after each fed token."""
    params = SamplingParams(return_logits=True)
    out, token = [], tokens[0]
    for i in range(len(tokens)):
        [result] = engine.step([StepItem(session, start + i, token_ids=[token], sampling=params)])
        out.append(result.logits)
        if i + 1 < len(tokens):
            token = tokens[i + 1] if forced else int(result.token)
    return out


@dataclass
class _Tally:
    nll: float = 0.0
    scored: int = 0
    kv_bytes: int = 0
    top1: list[torch.Tensor] = field(default_factory=list)  # per window: the greedy choice, teacher-forced
    free: list[torch.Tensor] = field(default_factory=list)  # per window: the free-running greedy tokens


def quality(
    engine: TorchEngine, windows: list[list[int]], prefix: int, variants: dict[str, Variant | None]
) -> dict[str, dict[str, Any]]:
    tallies: dict[str, _Tally] = {name: _Tally() for name in variants}
    for w, window in enumerate(windows):
        session = SessionId(f"bench-kv-{w}")
        engine.step([StepItem(session, 0, token_ids=window[:prefix])])
        # The prefix's KV, as the prefill left it in the paged cache: [L, prefix, KVH, D] for K and V.
        slots = engine.pool.lease(session).slots(0, prefix)
        with torch.inference_mode():
            index, keys, values = engine.kv.save(slots)
        forced = window[prefix:]  # c0 .. cN: the model predicts c1 .. cN after feeding c0 .. cN-1
        targets = torch.tensor(forced[1:])
        for name, variant in variants.items():
            if variant is None:
                k2, v2, nbytes = keys, values, FP16.packed_size(*keys.shape)
            else:
                k2, v2, nbytes = variant.round_trip(keys, values, engine.rotary)
            with torch.inference_mode():
                engine.kv.load((index, k2, v2))  # the decode steps below rewind the session to `prefix` first
            logits = torch.stack(continuation(engine, session, prefix, forced[:-1], forced=True))  # [N, V]
            free = torch.stack(continuation(engine, session, prefix, forced[:-1], forced=False)).argmax(-1)
            t = tallies[name]
            t.nll += float(-torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).sum())
            t.scored += len(targets)
            t.kv_bytes += nbytes
            t.top1.append(logits.argmax(-1))
            t.free.append(free)
        engine.release(session)
    ref = tallies["unquantized"]
    ppl_ref = math.exp(ref.nll / ref.scored)
    result = {}
    for name, t in tallies.items():
        ppl = math.exp(t.nll / t.scored)
        pairs = list(zip(t.free, ref.free, strict=True))
        # Tokens up to the first difference, averaged over windows: one early flip changes the rest of a run.
        same_prefix = [int((a != b).int().argmax()) if bool((a != b).any()) else len(a) for a, b in pairs]
        result[name] = {
            "ppl": ppl,
            "ppl_change_pct": 100 * (ppl / ppl_ref - 1),
            "scored_tokens": t.scored,
            "top1_agreement": sum(int((a == b).sum()) for a, b in zip(t.top1, ref.top1, strict=True)) / t.scored,
            "greedy_agreement": sum(int((a == b).sum()) for a, b in pairs) / t.scored,
            "greedy_same_prefix": sum(same_prefix) / len(same_prefix),
            "kv_bytes": t.kv_bytes // len(windows),
            "ratio": ref.kv_bytes / t.kv_bytes,
        }
    return result


# -- transfer and threshold sections ------------------------------------------------------------------------

WHOLE = KVTransferPolicy(min_layerwise_s=math.inf)
LAYERWISE = KVTransferPolicy(min_layerwise_s=0)  # the policy's own groups, at any size
TRANSFER_PROMPTS = (128, 512, 1024, 2048)
THRESHOLD_PROMPTS = (2, 4, 8, 16, 32, 64, 128)
TARGET_HIDDEN = 0.8  # of the serialized transfer, for prompts of >= 1024 tokens


class _Coordinator:
    """The coordinator's side of a hand-off as raw messages: Install, the prompt, and what comes back."""

    def __init__(self, transport: Any) -> None:
        self.mailbox = Mailbox(transport, INFER_PROTOCOL, infer_decoder, self._on_message, lambda peer: True)
        self.mailbox.install()
        self._send, self._inbox = trio.open_memory_channel[Any](1024)

    async def _on_message(self, peer: NodeId, msg: object, payload: bytes | None) -> None:
        await self._send.send(msg)

    async def next_of(self, kind: type) -> Any:
        while True:
            msg = await self._inbox.receive()
            if isinstance(msg, Failed):
                raise RuntimeError(f"session {msg.session} failed: {msg.reason}")
            if isinstance(msg, kind):
                return msg


@dataclass
class _Rig:
    coord: _Coordinator
    p: HopServer
    d: HopServer
    layers: int
    codec: str
    runs: int = 0


@asynccontextmanager
async def _rig(path: Path, link: LinkSpec, codec: str, chunk: int) -> AsyncIterator[_Rig]:
    """A prefill node and a decode node, each with all of the model, the link between them shaped to `link`."""
    layers = load_config(path).num_layers
    net = MemoryNetwork()

    def link_for(a: str, b: str) -> LinkSpec | None:
        return link if {a, b} == {"p", "d"} else None

    async def report(status: AssignmentStatus) -> None:
        if status.state == "failed":
            raise RuntimeError(status.detail)

    async with trio.open_nursery() as nursery, net.transport("coord") as ct, \
            net.transport("p") as pt, shaped_transport(pt, link_for) as ps, \
            net.transport("d") as dt, shaped_transport(dt, link_for) as ds:
        servers = []
        for t in (ps, ds):
            config = EngineConfig(kv_cache_bytes=512 << 20, max_batch_tokens=chunk)
            hops = HopServer(t, lambda peer: True, engine_config=config)
            hops.is_coordinator = lambda peer: peer == "coord"
            await nursery.start(hops.run)
            await hops.assign(Assignment(plan_version=1, model=str(path), first_layer=0, last_layer=layers,
                                         role="mixed"), report)
            hops.link_mbps = lambda peer: link.bandwidth_mbps  # as a node's probes would have measured it
            servers.append(hops)
        yield _Rig(_Coordinator(ct), servers[0], servers[1], layers, codec)
        nursery.cancel_scope.cancel()


async def _hand_off_once(rig: _Rig, tokens: int, policy: KVTransferPolicy) -> dict[str, float]:
    """One request of `tokens` prompt tokens and 2 output tokens: the prefill's time (to its first token at the
    coordinator), and the time from then until the decode side holds all of the prompt's KV."""
    rig.runs += 1
    sid = f"bench-{rig.runs}"
    rig.p.kv_transfer = policy
    route = Route(phases=[
        Phase(kind="prefill", hops=[Hop(peer="p", first_layer=0, last_layer=rig.layers)],
              kv_links=[KVLink(src="p", dst="d", codec=rig.codec)]),  # type: ignore[arg-type]
        Phase(kind="decode", hops=[Hop(peer="d", first_layer=0, last_layer=rig.layers)]),
    ])
    install = Install(session=sid, route=route, sampling=Sampling(), prefill_end=tokens, max_tokens=2, lease_s=600)
    coord = rig.coord
    await coord.mailbox.send(NodeId("d"), install)
    await coord.next_of(Ready)
    await coord.mailbox.send(NodeId("p"), install)
    prompt = torch.randint(0, 10_000, (tokens,), generator=torch.Generator().manual_seed(rig.runs))
    meta, raw = to_wire(prompt)
    done = rig.d.sessions[SessionId(sid)].kv_done
    frames = rig.p.kv_frames_sent
    with trio.fail_after(600):
        start = trio.current_time()
        await coord.mailbox.send(NodeId("p"), Items(items=[Item(sid, 0, tokens)], tensor=meta), raw)
        tokens_msg = await coord.next_of(Tokens)
        first = trio.current_time()
        await done.wait()
        ready = trio.current_time()
        while not any(t.last for t in tokens_msg.tokens):  # the decode side's token: the session is over
            tokens_msg = await coord.next_of(Tokens)
    for peer in ("p", "d"):
        await coord.mailbox.send(NodeId(peer), Release(session=sid))
    return {"prefill_s": first - start, "exposed_s": ready - first, "ready_s": ready - start,
            "frames": rig.p.kv_frames_sent - frames}


async def _compare(rig: _Rig, prompts: tuple[int, ...], repeats: int, modes: dict[str, KVTransferPolicy],
                   progress: bool) -> dict[int, dict[str, dict[str, float]]]:
    """Median of `repeats` runs of each mode for each prompt length, the modes interleaved run by run so that a
    change in the machine's load falls on all of them alike."""
    await _hand_off_once(rig, 16, WHOLE)  # warm-up: streams opened, first-step costs paid
    out: dict[int, dict[str, dict[str, float]]] = {}
    for tokens in prompts:
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in modes}
        for _ in range(repeats):
            for name, policy in modes.items():
                runs[name].append(await _hand_off_once(rig, tokens, policy))
        out[tokens] = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
                       for name, rs in runs.items()}
        if progress:
            print(f"  {tokens} tokens: " + ", ".join(f"{name} {cell['exposed_s'] * 1e3:.0f} ms"
                                                   for name, cell in out[tokens].items()), file=sys.stderr)
    return out


def transfer_section(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    cfg = load_config(path)
    link = LinkSpec(bandwidth_mbps=args.mbps, latency_ms=1.0)

    def wire(tokens: int) -> int:  # the whole transfer's bytes (an int codec's scales come per 64 tokens)
        return CODECS[args.codec].packed_size(cfg.num_layers, tokens, cfg.num_kv_heads, cfg.head_dim)

    policy = KVTransferPolicy()

    async def main() -> dict[str, Any]:
        async with _rig(path, link, args.codec, args.chunk) as rig:
            result: dict[str, Any] = {}
            if "transfer" in args.section:
                cells = await _compare(rig, args.transfer_prompts, args.transfer_repeats,
                                       {"whole": WHOLE, "layerwise": LAYERWISE}, not args.json)
                result["transfer"] = [
                    {"tokens": tokens, "wire_bytes": wire(tokens), "whole": c["whole"],
                     "layerwise": c["layerwise"],
                     "hidden": 1 - c["layerwise"]["exposed_s"] / c["whole"]["exposed_s"]}
                    for tokens, c in cells.items()]
            if "threshold" in args.section:
                cells = await _compare(rig, args.threshold_prompts, args.threshold_repeats,
                                       {"whole": WHOLE, "layerwise": LAYERWISE}, not args.json)
                rows = [{"tokens": tokens, "wire_bytes": wire(tokens), "whole": c["whole"],
                         "layerwise": c["layerwise"], "streamed": c["layerwise"]["frames"] > 1,
                         "policy": policy.choose(tokens, cfg.num_layers, wire(tokens) / (cfg.num_layers * tokens),
                                                 link.bandwidth_mbps).mode,
                         "gain_s": c["whole"]["ready_s"] - c["layerwise"]["ready_s"],
                         "ttft_cost_s": c["layerwise"]["prefill_s"] - c["whole"]["prefill_s"]}
                        for tokens, c in cells.items()]
                # Layer-wise wins where the decode side is ready sooner by more than the first token loses to
                # it; the threshold is the smallest transfer from which it wins at every larger size measured.
                wins = [r["streamed"] and r["gain_s"] > max(0.0, r["ttft_cost_s"]) for r in rows]
                first = next((i for i in range(len(rows)) if all(wins[i:])), None)
                measured = rows[first]["wire_bytes"] if first is not None else None
                result["threshold"] = {
                    "rows": rows, "measured_bytes": measured,
                    "measured_s": measured * 8 / (link.bandwidth_mbps * 1e6) if measured is not None else None,
                    # The bytes from which the default policy streams on this link.
                    "policy_bytes": policy.min_layerwise_s * link.bandwidth_mbps * 1e6 / 8,
                    "policy_s": policy.min_layerwise_s,
                }
            return result

    torch.set_num_threads(args.threads)
    result = trio.run(main)
    result["link"] = {"mbps": link.bandwidth_mbps, "latency_ms": link.latency_ms, "codec": args.codec,
                      "model": path.name, "layers": cfg.num_layers, "chunk": args.chunk}
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    config = load_config(path)
    result: dict[str, Any] = {
        "threads": args.threads, "cores": len(os.sched_getaffinity(0)), "load_avg_1m": os.getloadavg()[0],
        "model": path.name, "sections": list(args.section),
    }
    if "codecs" in args.section:
        smol_shape = (config.num_layers, args.tokens, config.num_kv_heads, config.head_dim)
        rows = codec_rows(f"{path.stem} x{args.tokens} tokens", smol_shape, torch.float16, args.repeats)
        rows += codec_rows("LLaMA-2 70B, 1 layer x2048 tokens", LLAMA70B_LAYER, torch.float16, args.repeats)
        if not args.quick:  # what a CPU node's float32 cache packs
            rows += codec_rows(f"{path.stem} x{args.tokens} (float32 cache)", smol_shape, torch.float32,
                               args.repeats)
        result["codecs"] = rows
    if "quality" in args.section:
        tokenizer = load_tokenizer(path, progress=False)
        windows = english_windows(tokenizer, Path(args.papers), args.windows, args.prefix + args.continuation + 1)
        engine = TorchEngine.load(path, dtype=torch.float32, engine_config=EngineConfig(kv_cache_bytes=64 << 20))
        start = time.perf_counter()
        result["quality"] = quality(engine, windows, args.prefix, variants(args.quick))
        result["quality_settings"] = {
            "prefix": args.prefix, "continuation": args.continuation, "windows": len(windows),
            "seconds": time.perf_counter() - start,
        }
        engine.close()
    if {"transfer", "threshold"} & set(args.section):
        result |= transfer_section(path, args)
    result["load_avg_1m_end"] = os.getloadavg()[0]
    return result


def report(result: dict[str, Any]) -> None:
    print(f"{result['model']}  threads={result['threads']} of {result['cores']} cores  "
          f"load average {result['load_avg_1m']:.2f} -> {result['load_avg_1m_end']:.2f}")
    if "codecs" in result:
        report_codecs(result)
    if "quality" in result:
        report_quality(result)
    if "transfer" in result or "threshold" in result:
        link = result["link"]
        print(f"\nKV hand-off over {link['mbps']:g} Mbit/s, {link['latency_ms']:g} ms, {link['codec']}: "
              f"{link['model']} prefill node -> decode node, prefill steps of up to {link['chunk']} tokens, medians")
    if "transfer" in result:
        print(f"{'prompt':>7} {'KV bytes':>11} {'prefill s':>9} | {'prefill end -> decode ready, ms':>31} "
              f"{'hidden':>7} | {'prefill s':>9} {'frames':>6}")
        print(f"{'':>7} {'':>11} {'whole':>9} | {'whole':>15} {'layer-wise':>15} {'':>7} | "
              f"{'layer-wise':>9} {'':>6}")
        for r in result["transfer"]:
            w, lw = r["whole"], r["layerwise"]
            print(f"{r['tokens']:>7} {r['wire_bytes']:>11,} {w['prefill_s']:>9.2f} | {w['exposed_s'] * 1e3:>15.0f} "
                  f"{lw['exposed_s'] * 1e3:>15.0f} {r['hidden']:>7.1%} | {lw['prefill_s']:>9.2f} "
                  f"{lw['frames']:>6.0f}")
        big = [r["hidden"] for r in result["transfer"] if r["tokens"] >= 1024]
        if big:
            print(f"target: layer-wise hides >= {TARGET_HIDDEN:.0%} of the serialized transfer for >= 1024 tokens: "
                  f"{min(big):.1%} {'met' if min(big) >= TARGET_HIDDEN else 'MISSED'}")
    if "threshold" in result:
        th = result["threshold"]
        print(f"\n{'prompt':>7} {'KV bytes':>11} | {'send -> decode ready, ms':>25} {'gain ms':>8} | "
              f"{'prefill (first token), ms':>32} | {'frames':>6} {'policy':>10}")
        print(f"{'':>7} {'':>11} | {'whole':>12} {'layer-wise':>12} {'':>8} | {'whole':>10} {'layer-wise':>10} "
              f"{'cost':>10} |")
        for r in th["rows"]:
            w, lw = r["whole"], r["layerwise"]
            print(f"{r['tokens']:>7} {r['wire_bytes']:>11,} | {w['ready_s'] * 1e3:>12.1f} {lw['ready_s'] * 1e3:>12.1f} "
                  f"{r['gain_s'] * 1e3:>8.1f} | {w['prefill_s'] * 1e3:>10.1f} {lw['prefill_s'] * 1e3:>10.1f} "
                  f"{r['ttft_cost_s'] * 1e3:>10.1f} | {lw['frames']:>6.0f} {r['policy']:>10}")
        measured = th["measured_bytes"]
        print(f"layer-wise gains more than the first token loses from {measured:,} bytes "
              f"({th['measured_s'] * 1e3:.1f} ms whole on this link) on; the policy streams from "
              f"{th['policy_bytes']:,.0f} bytes ({th['policy_s'] * 1e3:.0f} ms)" if measured is not None
              else "layer-wise never gains more than the first token loses at every larger size measured")


def report_codecs(result: dict[str, Any]) -> None:
    print("\nCodecs: bytes against fp16 (scales included); GB/s of fp16 KV, best run")
    print(f"{'KV':<40} {'input':>8} {'codec':>6} {'bytes':>11} {'x smaller':>9} {'pack GB/s':>9} {'unpack GB/s':>11}")
    for r in result["codecs"]:
        print(f"{r['shape']:<40} {r['dtype']:>8} {r['codec']:>6} {r['bytes']:>11,} {r['ratio']:>9.2f} "
              f"{r['pack_gbps']:>9.2f} {r['unpack_gbps']:>11.2f}")
    int4 = [r for r in result["codecs"] if r["codec"] == "int4"]
    print(f"targets: int4 >= {TARGET_INT4_RATIO}x smaller: {min(r['ratio'] for r in int4):.2f}x; "
          f"pack and unpack >= {TARGET_GBPS} GB/s: int4 slowest pack {min(r['pack_gbps'] for r in int4):.2f}, "
          f"unpack {min(r['unpack_gbps'] for r in int4):.2f}")


def report_quality(result: dict[str, Any]) -> None:
    qs = result["quality_settings"]
    print(f"\nQuality: {qs['windows']} windows of paper prose, {qs['prefix']}-token prefix through the codec, "
          f"{qs['continuation']} tokens scored ({qs['seconds']:.0f} s)")
    print(f"{'KV':<28} {'x smaller':>9} {'ppl':>8} {'ppl change':>10} {'top-1 agree':>11} {'greedy agree':>12} "
          f"{'same prefix':>11}")
    for name, q in result["quality"].items():
        print(f"{name:<28} {q['ratio']:>9.2f} {q['ppl']:>8.3f} {q['ppl_change_pct']:>9.2f}% "
              f"{q['top1_agreement']:>11.1%} {q['greedy_agreement']:>12.1%} {q['greedy_same_prefix']:>11.1f}")
    for name, target in TARGET_PPL.items():
        change = result["quality"][name]["ppl_change_pct"]
        print(f"target {name} ppl change < {target}%: {change:+.2f}% {'met' if abs(change) < target else 'MISSED'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=512, help="tokens of SmolLM2 KV in the codec section")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: on a shared 2-core machine a second thread waits on the other load)")
    parser.add_argument("--papers", default=str(PAPERS), help="folder of .md papers to take English text from")
    parser.add_argument("--windows", type=int, default=5, help="text windows (one per paper)")
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument("--continuation", type=int, default=64)
    parser.add_argument("--section", action="append", choices=("codecs", "quality", "transfer", "threshold"),
                        help="what to measure (repeat for several; default: codecs and quality)")
    parser.add_argument("--mbps", type=float, default=100.0, help="transfer, threshold: the emulated link")
    parser.add_argument("--codec", default="fp16", choices=sorted(CODECS), help="transfer, threshold: the link's codec")
    parser.add_argument("--chunk", type=int, default=EngineConfig().max_batch_tokens,
                        help="transfer, threshold: the most tokens a prefill step runs (longer prompts go in chunks)")
    parser.add_argument("--transfer-prompts", type=int, nargs="+", default=TRANSFER_PROMPTS)
    parser.add_argument("--transfer-repeats", type=int, default=3)
    parser.add_argument("--threshold-prompts", type=int, nargs="+", default=THRESHOLD_PROMPTS)
    parser.add_argument("--threshold-repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="a smoke run: small sizes, one window, no extras")
    parser.add_argument("--json", action="store_true", help="print the result as JSON only")
    args = parser.parse_args()
    args.section = args.section or ["codecs", "quality"]
    if args.quick:
        args.tokens, args.repeats, args.windows, args.prefix, args.continuation = 64, 2, 1, 96, 8
        args.transfer_prompts, args.transfer_repeats = (64, 256), 1
        args.threshold_prompts, args.threshold_repeats = (4, 64), 1
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        report(result)


if __name__ == "__main__":
    main()
