"""The SLO attainment of one pair of replicas, D_ij of §3.3: a fast analytical estimate, no simulation.

ThunderServe estimates D with DistServe's simulator; this is its closed-form stand-in, fast enough to run for
every pair of every deployment the tabu search looks at:

- Prefill replica i serves prompts first come first served at `prefill_rate` (its slowest stage), each in
  `prefill_s`; at arrival rate lambda_i its queue is taken as M/M/1, so a request waits longer than t with
  probability rho exp(-(mu - lambda_i) t).
- The KV of the prompt then moves to decode replica j: every prefill stage sends the layers it shares with a
  decode stage over the link between them, all stages at once, each at the codec that link would use
  (KVCodecPolicy.choose on the exact packed sizes of hetnode.protocol.kv_wire: one policy for the runtime,
  the simulator and the planner), alpha + bytes / beta (Eq. 1).
- Replica j decodes at the batch its load keeps in flight (Little: lambda_j x output_len x TPOT), and its TPOT
  at that batch is the layout's decode cycle. Its KV holds each request longer than that, from admission to the
  last token (`decode_residency`), which bounds the rate it sustains.

A request attains the SLO when its end-to-end time, wait + prefill_s + KV + output_len x TPOT, is within the
E2E SLO (the paper's objective, `ThunderServeOptions.objective` "e2e"); with objective "all" it must also have
TTFT = wait + prefill_s within the TTFT SLO and TPOT within the TPOT SLO. With TPOT deterministic here, D_ij is
the probability that the wait is within the slack (the tighter of the two under "all"). A replica loaded at or
past its capacity attains nothing. Lengths are the traffic's means: the variance of real lengths is not
modelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hetnode.planner.costmodel import step_time
from hetnode.planner.devices import parse_device
from hetnode.planner.model import ModelSpec
from hetnode.planner.thunderserve.gpus import GpuPool
from hetnode.planner.thunderserve.parallel import Layout, Performance
from hetnode.planner.thunderserve.settings import ThunderServeOptions
from hetnode.policy.decode_booking import ADMISSION, HANDOFF
from hetnode.policy.kv_codec import AUTO_CODECS, CodecOption, KVCodecPolicy, LinkEstimate
from hetnode.protocol.kv_wire import packed_size

REFERENCE_DEVICE = "2xa100-80g"  # the paper's in-house replica of LLaMA-30B: two A100-80GB, tensor parallel


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float
    e2e_s: float


def slo_for(model: ModelSpec, options: ThunderServeOptions) -> Slo:
    """The SLOs: the options' scales times the model's latencies on REFERENCE_DEVICE (roofline), or the options'
    absolute ones (end to end: TTFT + output_len x TPOT)."""
    traffic = options.traffic
    if options.slo_s is not None:
        ttft_s, tpot_s = options.slo_s
        return Slo(ttft_s=ttft_s, tpot_s=tpot_s, e2e_s=ttft_s + traffic.output_len * tpot_s)
    device = parse_device(REFERENCE_DEVICE)
    s_in = max(1, round(traffic.input_len))
    bpe = round(model.bytes_per_param)
    ttft = step_time(device, model.shape, model.num_layers, s_in, s_in, attended_pairs=s_in * (s_in + 1) // 2,
                     bytes_per_elem=bpe)
    tpot = step_time(device, model.shape, model.num_layers, 1, round(traffic.input_len + traffic.output_len / 2),
                     bytes_per_elem=bpe)
    e2e = ttft + traffic.output_len * tpot
    return Slo(ttft_s=options.ttft_scale * ttft, tpot_s=options.tpot_scale * tpot, e2e_s=options.e2e_scale * e2e)


@dataclass(frozen=True)
class Handoff:
    seconds: float  # the slowest stage pair's transfer (inf: some pair has no link)
    codecs: tuple[str, ...]  # the codec of each stage pair that shares layers, prefill stage order
    # (from GPU, to GPU, bytes on the wire at that link's codec) of each stage pair whose KV crosses a link: what
    # the orchestration's link-capacity rows charge one request for
    transfers: tuple[tuple[int, int, float], ...] = ()


def kv_handoff(pool: GpuPool, prefill: Layout, decode: Layout, model: ModelSpec,
               options: ThunderServeOptions) -> Handoff:
    """What moving one prompt's KV from a prefill replica to a decode replica costs (module docstring)."""
    tokens = max(1, round(options.traffic.input_len))
    policy = KVCodecPolicy(options.kv_codec)
    names = sorted(set(AUTO_CODECS) | ({options.kv_codec} - {"auto"}))
    slowest = 0.0
    codecs: list[str] = []
    transfers: list[tuple[int, int, float]] = []
    for p in prefill.stages:
        for d in decode.stages:
            shared = min(p.last_layer, d.last_layer) - max(p.first_layer, d.first_layer)
            if shared <= 0:
                continue
            a, b = p.gpus[0], d.gpus[0]
            if a == b:  # the same GPU holds both: nothing moves
                codecs.append("fp16")
                continue
            bw = pool.bandwidth[a][b]
            if bw <= 0:
                return Handoff(math.inf, ())
            sizes = {n: packed_size(n, shared, tokens, model.num_kv_heads, model.head_dim) for n in names}
            options_ = [CodecOption(n, sizes[n], options.codec_rate, options.codec_rate) for n in names]
            choice = policy.choose(sizes["fp16"], options_, LinkEstimate(bw, pool.latency[a][b]))
            codecs.append(choice.codec)
            transfers.append((a, b, float(choice.wire_bytes)))
            slowest = max(slowest, choice.seconds)
    return Handoff(slowest, tuple(codecs), tuple(transfers))


def decode_tpot(perf: Performance, rate: float, output_len: float) -> float:
    """TPOT at the batch that `rate` requests per second keep in flight (a few rounds of Little's law)."""
    tpot = perf.tpot_at(1)
    for _ in range(8):
        batch = min(float(perf.max_batch), max(1.0, rate * output_len * tpot))
        tpot = perf.tpot_at(batch)
    return tpot


def decode_residency(prefill: Performance, handoff_s: float, decode: Performance, output_len: float,
                     booking: str = ADMISSION) -> float:
    """r_ij: how many times its decode alone a request through this pair holds the decode replica's KV.

    Booked at admission (the scheduler's default, CLS in coordinator/split_scheduler.py), the KV is held through
    the prefill (`prefill_s`) and the hand-off (`handoff_s`) before the decode (output_len x TPOT at the batch
    `decode_rate` assumes, its largest). The prefill queue is left out: a request waits for a pair with room
    before it is admitted, not after. Booked at the hand-off (ThunderServe's KV queues on the prefill replicas,
    Appendix E: the decode replica takes a prompt's KV when it has room), it is held from the hand-off on.
    inf: the pair cannot hand its KV over."""
    decode_s = output_len * decode.tpot[-1][1]
    if not math.isfinite(handoff_s):
        return math.inf
    before = handoff_s if booking == HANDOFF else prefill.prefill_s + handoff_s
    return (before + decode_s) / decode_s if decode_s > 0 else 1.0


def attainment(prefill: Performance, prefill_load: float, decode: Performance, decode_load: float,
               handoff_s: float, slo: Slo, output_len: float, decode_capacity: float | None = None,
               objective: str = "e2e") -> float:
    """D_ij: the share of requests through this pair that attain, at these loads (requests/s): within the E2E SLO
    (objective "e2e"), or within the TTFT, TPOT and E2E SLOs all three ("all").
    decode_capacity: the requests/s the decode replica's KV sustains at the mix it serves (`decode_rate` divided by
    the mix's residency ratio); None: its decode_rate."""
    mu = prefill.prefill_rate
    nu = decode.decode_rate if decode_capacity is None else decode_capacity
    if prefill_load >= mu or decode_load >= nu or not math.isfinite(handoff_s):
        return 0.0
    tpot = decode_tpot(decode, decode_load, output_len)
    slack = slo.e2e_s - prefill.prefill_s - handoff_s - output_len * tpot
    if objective == "all":
        if tpot > slo.tpot_s:
            return 0.0
        slack = min(slack, slo.ttft_s - prefill.prefill_s)
    return waits_within(mu, prefill_load, slack)


def waits_within(rate: float, load: float, slack: float) -> float:
    """The share of prompts whose wait at a prefill replica serving `rate` requests/s, offered `load`, is at most
    `slack` seconds (an M/M/1 queue's waiting time); 0 when the replica cannot keep up or there is no slack."""
    if load >= rate or slack < 0:
        return 0.0
    return 1.0 - load / rate * math.exp(-(rate - load) * slack)
