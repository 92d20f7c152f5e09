"""The SLO attainment of one pair of replicas, D_ij of §3.3: a fast estimate.

ThunderServe estimates D with DistServe's simulator; this is its stand-in, fast enough to run for every pair of
every deployment the tabu search looks at:

- Prefill replica i serves prompts first come first served at each station of its pipeline: a sample of
  requests of the traffic's length mix arrives at rate lambda_i (`first_token`, DistServe's simulator in the
  small: a prompt waits behind every longer one ahead of it at every stage).
- The KV of the prompt then moves to decode replica j: every prefill stage sends the layers it shares with a
  decode stage over the link between them, all stages at once, each at the codec that link would use
  (KVCodecPolicy.choose on the exact packed sizes of hetnode.protocol.kv_wire: one policy for the runtime,
  the simulator and the planner), alpha + bytes / beta (Eq. 1), at the mean prompt and in proportion for others.
- Replica j decodes at the batch its load keeps in flight (Little: lambda_j x output_len x TPOT), and its TPOT
  at that batch is the layout's decode cycle. Its KV holds each request longer than that, from admission to the
  last token (`decode_residency`), which bounds the rate it sustains.

A request attains the SLO when its end-to-end time, first token + KV + its output length x TPOT, is within the
E2E SLO (the paper's objective, `ThunderServeOptions.objective` "e2e"); with objective "all" it must also have
its first token within the TTFT SLO and TPOT within the TPOT SLO. D_ij is the share of the sample that attains.
A replica loaded at or past its capacity attains nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from hetnode.planner.costmodel import step_time
from hetnode.planner.devices import parse_device
from hetnode.planner.model import ModelSpec
from hetnode.planner.thunderserve.first_token import Array, LengthSample, fifo_departures
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
    # the seconds each of `transfers` takes for a prompt of the mean length, in the same order: each is a FIFO
    # queue of its own (the simulator's links), so a pair's hand-offs wait on the busiest of them
    link_seconds: tuple[float, ...] = ()


def kv_handoff(pool: GpuPool, prefill: Layout, decode: Layout, model: ModelSpec,
               options: ThunderServeOptions) -> Handoff:
    """What moving one prompt's KV from a prefill replica to a decode replica costs (module docstring)."""
    tokens = max(1, round(options.traffic.input_len))
    policy = KVCodecPolicy(options.kv_codec)
    names = sorted(set(AUTO_CODECS) | ({options.kv_codec} - {"auto"}))
    slowest = 0.0
    codecs: list[str] = []
    transfers: list[tuple[int, int, float]] = []
    link_seconds: list[float] = []
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
            link_seconds.append(choice.seconds)
            slowest = max(slowest, choice.seconds)
    return Handoff(slowest, tuple(codecs), tuple(transfers), tuple(link_seconds))


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


@dataclass(frozen=True, eq=False)
class Moved:
    """The requests a pair takes (`LengthSample.picked`) and, for each of them, the seconds from its first token
    to its KV's arrival on the decode replica, the queues on the pair's links included."""

    picked: npt.NDArray[np.bool_]
    seconds: Array


def moved(first_token: Array, sample: LengthSample, share: float, prefill_load: float, handoff: Handoff) -> Moved:
    """The hand-offs of the `share` of the sample's requests a pair takes from a prefill replica loaded at
    `prefill_load` requests/s, whose first tokens are `first_token` (`first_token.first_token_s`)."""
    picked = sample.picked(share)
    if not (picked.any() and prefill_load > 0 and math.isfinite(handoff.seconds)):
        return Moved(picked, np.full(int(picked.sum()), math.inf))
    ready = first_token[picked] + sample.arrivals[picked] / prefill_load  # when each prompt's KV is ready to leave
    return Moved(picked, link_queues(ready, sample.input_ratio[picked], handoff) - ready)


def attainment(prefill_rate: float, prefill_load: float, decode: Performance, decode_load: float, handoff: Handoff,
               slo: Slo, output_len: float, first_token: Array, sample: LengthSample, move: Moved,
               decode_wait: Array | None = None, decode_capacity: float | None = None,
               objective: str = "e2e") -> float:
    """D_ij: the share of requests through this pair that attain, at these loads (requests/s): within the E2E SLO
    (objective "e2e"), or within the TTFT, TPOT and E2E SLOs all three ("all"). The requests are `sample`'s, with
    `first_token` their times to the prefill replica's last stage at `prefill_load` (`first_token.first_token_s`);
    `move` says which the pair takes and how long their hand-offs take (`moved`), and they then wait `decode_wait`
    for room on the decode replica (`decode_queue.room_at`; None: none).
    decode_capacity: the requests/s the decode replica's KV sustains at the mix it serves (`decode_rate` divided by
    the mix's residency ratio); None: its decode_rate."""
    nu = decode.decode_rate if decode_capacity is None else decode_capacity
    if prefill_load >= prefill_rate or decode_load >= nu or not math.isfinite(handoff.seconds):
        return 0.0
    tpot = decode_tpot(decode, decode_load, output_len)
    if objective == "all" and tpot > slo.tpot_s:
        return 0.0
    picked = move.picked
    if not picked.any():
        return 0.0
    ttft = first_token[picked]
    after = move.seconds if decode_wait is None else move.seconds + decode_wait[picked]
    met = ttft + after + sample.outputs[picked] * tpot <= slo.e2e_s
    if objective == "all":
        met &= ttft <= slo.ttft_s
    return float(met.mean())


def link_queues(ready: Array, ratio: Array, handoff: Handoff) -> Array:
    """When each hand-off, its KV ready at `ready` (rising: prompts leave a pipeline in the order they came) and
    `ratio` times the mean prompt long, has crossed every link of the pair, each link first come first served."""
    done = ready.copy()
    for seconds in handoff.link_seconds:
        done = np.maximum(done, fifo_departures(ready, seconds * ratio))
    return done
