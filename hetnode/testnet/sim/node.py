"""A simulated compute node: the runtime's batch policy, step times from a profile table, KV memory.

Batching is not imitated here: the node runs `hetnode.policy.BatchPolicy`, the object the runtime's
`BatchLoop` runs, on its queue of `SimRequest`s (which carry the fields the policy reads: session, start,
num_tokens, prefill_end). When the node is idle and work is waiting it starts a step at once (no waiting for
more) with what the policy picks: arrival order, one item per session, at most `max_batch_tokens`, a prompt
chunk that does not fit split into a piece that runs now (a clone of the request that travels on) and the rest
that keeps its place (the request itself, so the coordinator acts only when the chunk's last piece arrives).

Step time follows the profile's per-layer model, summed over the layers the step runs:

    step = prefill_time(prompt tokens, L) + decode_time(decode items, L, context tokens)

with context = the sum over decode items of the tokens each attends to (its position + 1); with
`mixed_steps="batched"` a step that mixes prompt tokens and decode items runs them in one pass instead (one read
of the weights, as the runtime's engine and the testnet's roofline pace do): L x max(prefill(prompt tokens +
decode items), decode(decode items)) plus the same context cost. With partial
inference a request may run only part of the node's layers ([a, b) inside the node's [first, last)); the
node then splits its layers at every a and b of the ranges its requests run, and each slice of layers costs
the per-layer time of the items that run it. This is exact under the profiles' per-layer model (a layer's
time depends on the tokens that pass through that layer); what it leaves out is any fixed per-step cost
outside the layers, which Helix's tables do not measure either.

KV memory is the policy's `KVLedger`, sized the way the runtime's paged pool (`hetnode.kv`, vLLM) and the
scheduler's estimate count it: blocks of `block_size` tokens, each a slot in every layer the node holds (so a
request that runs only part of the node's layers still takes whole slots), against `profile.kv_tokens(memory,
model, layers held)`. A session's first item here reserves its whole prefill; when that does not fit it waits
(first come, first admitted) while admitted sessions run; decode growth takes a block at each block boundary,
and waits when none is free. When nothing can run and a decode waits to grow, the policy preempts the youngest
such session and the coordinator restarts it (`SimCoordinator.on_failed`); a prompt larger than the whole pool
is refused, unless `admit_oversized` lets a node holding nothing overcommit for it (the simulator's old rule;
off by default, as in the runtime). Released sessions free their blocks when the coordinator's Release arrives.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from operator import attrgetter
from typing import Any

from hetnode.planner.profile import DeviceProfile, interpolate
from hetnode.policy import MIN_CHUNK, PREEMPTED, BatchConfig, BatchPolicy, Cause, KVLedger, StepRate

# How a step that mixes prompt tokens and decode items is priced: "sum" (prefill + decode, as Helix's
# artifact does with its separately measured curves) or "batched" (one pass over every token of the step).
MIXED_STEPS = ("sum", "batched")

_POS = attrgetter("start")
_PF = attrgetter("pf")
_NTOK = attrgetter("num_tokens")


def add_to_bins(bins: list[float], bin_s: float, t0: float, t1: float) -> None:
    """Add the interval [t0, t1) to time bins of width bin_s, splitting it at bin edges."""
    b = int(t0 / bin_s)
    while True:
        if b >= len(bins):
            bins.extend([0.0] * (b + 1 - len(bins)))
        edge = (b + 1) * bin_s
        if t1 <= edge:
            bins[b] += t1 - t0
            return
        bins[b] += edge - t0
        t0 = edge
        b += 1


class SimNode:
    __slots__ = (
        "batch",
        "bin_s",
        "block_size",
        "budget",
        "busy_bins",
        "busy_s",
        "context_s",
        "copy_s",
        "decode_curve",
        "decode_memo",
        "device",
        "down",
        "failed",
        "first_layer",
        "index",
        "items",
        "kv_area",
        "kv_capacity",
        "kv_coming",
        "kv_first",
        "kv_held",
        "kv_out",
        "kv_peak",
        "kv_pending",
        "kv_t",
        "kv_used",
        "kv_wait_s",
        "kv_waits",
        "last_layer",
        "ledger",
        "max_batch_items",
        "mixed_batched",
        "name",
        "only_next",
        "pack_free",
        "policy",
        "prefill_memo",
        "prefill_rate",
        "prompt_curve",
        "prompt_tokens",
        "queue",
        "range_slot",
        "ranges",
        "rate",
        "segments",
        "single",
        "single_len",
        "solo_beside",
        "solo_factor",
        "steps",
        "tokens",
        "track_throughput",
        "unpack_free",
        "window",
        "window_busy_s",
    )

    def __init__(self, index: int, name: str, device: str, profile: DeviceProfile, first_layer: int,
                 last_layer: int, *, kv_capacity_tokens: int, block_size: int, max_batch_tokens: int,
                 window: tuple[float, float], bin_s: float, mixed_steps: str = "sum",
                 min_chunk: int = MIN_CHUNK, admit_oversized: bool = False, max_prompts: int | None = None,
                 max_decodes: int | None = None, prompt_tokens: int | None = None,
                 solo_decode_factor: float = 1.0, first_layer_copy_s: float = 0.0,
                 solo_beside_prompts: bool = False, copy_every_node: bool = False,
                 policy: Callable[[KVLedger, BatchConfig], BatchPolicy] = BatchPolicy) -> None:
        if not 0 <= first_layer <= last_layer:
            raise ValueError(f"node {name}: bad layer range [{first_layer}, {last_layer})")
        self.index = index
        self.name = name
        self.device = device
        self.down = False  # lost, or its shard dropped for a re-plan: what reaches it is lost (replan.py)
        self.first_layer = first_layer
        self.last_layer = last_layer
        self.prompt_curve = profile.prompt_curve
        self.decode_curve = profile.decode_curve
        self.context_s = profile.decode_context_s
        self.prefill_memo: dict[int, float] = {}  # prompt tokens -> seconds per layer
        self.decode_memo: dict[int, float] = {}  # decode batch -> seconds per layer
        if mixed_steps not in MIXED_STEPS:
            raise ValueError(f"mixed_steps must be one of {', '.join(MIXED_STEPS)}, not {mixed_steps!r}")
        self.mixed_batched = mixed_steps == "batched"
        self.budget = max_batch_tokens
        self.block_size = block_size
        self.kv_capacity = kv_capacity_tokens // block_size  # blocks (each a slot in every layer held)
        self.ledger = KVLedger(self.kv_capacity, block_size)
        # The runtime's batch policy, or another design's (the same factory `BatchLoop` takes).
        self.policy = policy(self.ledger, BatchConfig(max_batch_tokens=max_batch_tokens, min_chunk=min_chunk,
                                                      admit_oversized=admit_oversized, max_prompts=max_prompts,
                                                      max_decodes=max_decodes, prompt_tokens=prompt_tokens))
        # Costs outside the per-layer tables that Helix's simulator charges (1.0 and 0.0 charge nothing): a decode
        # step of one item costs `solo_factor` times the table's, and the node holding layer 0 copies each token
        # of a step in for `copy_s` seconds (its host-to-device input). Helix's artifact charges both more widely
        # than that reading: `ModelLayer.get_inference_statistics` doubles the decode part of any layer's batch
        # with exactly one decode item, a prompt beside it or not (`solo_beside_prompts`), and
        # `ComputeNode.get_inference_statistics` adds the copy at each node's own first layer, every node
        # copying the input it received (`copy_every_node`).
        if not solo_decode_factor > 0 or not first_layer_copy_s >= 0:
            raise ValueError(f"node {name}: solo_decode_factor must be > 0 and first_layer_copy_s >= 0")
        self.solo_factor = solo_decode_factor
        self.solo_beside = solo_beside_prompts
        self.copy_s = first_layer_copy_s if first_layer == 0 or copy_every_node else 0.0
        # (request, reason, cause) refused or preempted, for the coordinator's lifecycle policy
        self.failed: list[tuple[Any, str, Cause]] = []
        self.kv_pending = 0  # queued items waiting for KV (their kv_since is set)
        self.kv_used = 0  # the ledger's blocks at the last look, for the statistics
        self.kv_peak = 0
        self.kv_area = 0.0  # integral of kv_used over time, for the mean
        self.kv_t = 0.0
        self.kv_waits = 0  # prompts that found the memory full
        self.kv_wait_s = 0.0
        self.queue: list[Any] = []
        self.batch: list[Any] | None = None  # the step under way ([] while the node packs KV: not idle either)
        # KV hand-offs (handoff.py). In: the sessions whose handed-over KV is still coming (layer-tokens left),
        # their items that arrived meanwhile, and those whose first decode step has not run here. Out: whether
        # some route hands KV on from here. When the packer and unpacker beside the compute are next free.
        self.kv_coming: dict[Any, int] = {}
        self.kv_held: dict[Any, list[Any]] = {}
        self.kv_first: set[Any] = set()
        self.kv_out = False
        self.pack_free = 0.0
        self.unpack_free = 0.0
        # The layer ranges requests run here; the usual case is one, the node's whole range.
        self.ranges: list[tuple[int, int]] = []
        self.range_slot: dict[tuple[int, int], int] = {}
        self.segments: list[tuple[int, list[int]]] = []
        self.single = True
        self.single_len = last_layer - first_layer
        # Statistics.
        self.window = window
        self.bin_s = bin_s
        self.busy_bins: list[float] = []
        self.steps = 0
        self.items = 0
        self.tokens = 0
        self.prompt_tokens = 0
        self.max_batch_items = 0
        self.busy_s = 0.0
        self.window_busy_s = 0.0
        self.rate = StepRate(profile.tokens_per_s(last_layer - first_layer))  # T_j, then an EMA of steps
        self.track_throughput = False  # keep the EMA (only SWARM's scheduler reads it)
        # tokens/s of the steps that prefill, as a node reports it: what a re-prefill here is weighed by
        self.prefill_rate = StepRate()
        self.only_next = -2  # the one next hop of every route through here; -1 once there are several

    @property
    def layers(self) -> int:
        return self.last_layer - self.first_layer

    def add_next_hop(self, hop: int) -> None:
        if self.only_next == -2:
            self.only_next = hop
        elif self.only_next != hop:
            self.only_next = -1

    def slot(self, first: int, last: int) -> int:
        """The index of the layer range [first, last) among those requests run here."""
        found = self.range_slot.get((first, last))
        if found is not None:
            return found
        if not self.first_layer <= first < last <= self.last_layer:
            raise ValueError(f"node {self.name} holds [{self.first_layer}, {self.last_layer}), "
                             f"not [{first}, {last})")
        k = len(self.ranges)
        self.range_slot[(first, last)] = k
        self.ranges.append((first, last))
        self.single = k == 0
        self.single_len = last - first if k == 0 else 0
        points = sorted({a for a, _ in self.ranges} | {b for _, b in self.ranges})
        self.segments = []
        for x, y in pairwise(points):
            active = [i for i, (a, b) in enumerate(self.ranges) if a <= x and b >= y]
            if active:
                self.segments.append((y - x, active))
        return k

    # -- per-layer costs ----------------------------------------------------------------------------------

    def prefill_per_layer(self, tokens: int) -> float:
        t = self.prefill_memo.get(tokens)
        if t is None:
            t = self.prefill_memo[tokens] = interpolate(self.prompt_curve, tokens) if tokens > 0 else 0.0
        return t

    def decode_per_layer(self, batch: int) -> float:
        t = self.decode_memo.get(batch)
        if t is None:
            t = self.decode_memo[batch] = interpolate(self.decode_curve, batch) if batch > 0 else 0.0
        return t

    # -- a step ---------------------------------------------------------------------------------------------

    def form_batch(self, now: float) -> float:
        """Take the next step's batch from the queue into `batch`; the step's duration, or -1.0 when nothing
        can run (every waiting item waits for KV memory). Refused and preempted requests go to `failed`."""
        step = self.policy.form(self.queue)
        self.queue = step.waiting
        if step.refused or step.dropped:
            self._failed(step)
        if step.blocked or self.kv_pending:
            self._kv_waits(step, now)
        if self.ledger.used != self.kv_used:
            self.kv_note(now)
        batch = step.batch
        if not batch:
            return -1.0
        if step.split is not None:
            batch = [r.piece(step.split_tokens) if r is step.split else r for r in batch]
        self.batch = batch
        n = len(batch)
        if self.single and not any(map(_PF, batch)):
            # The usual step: decode items only, one layer range.
            t = self.decode_memo.get(n)
            if t is None:
                t = self.decode_per_layer(n)
            dur: float = self.single_len * (t + self.context_s * (sum(map(_POS, batch)) + n))
            if n == 1:
                dur *= self.solo_factor
            dur += self.copy_s * n
            self._account(now, dur, n, n, 0)
            return dur
        prompts = [r for r in batch if r.pf]
        ptok = sum(map(_NTOK, prompts))
        if self.single:
            dur = self._cost(self.single_len, ptok, n - len(prompts), batch, prompts)
        else:
            ni = self.index
            slots = [r.seg[ni] for r in batch]
            k = slots[0]
            if slots.count(k) == n:  # every item runs the same range here
                a, b = self.ranges[k]
                dur = self._cost(b - a, ptok, n - len(prompts), batch, prompts)
            else:
                dur = self._segmented(batch, slots)
        if n == 1 and not ptok and not self.solo_beside:  # solo_beside: _cost priced the one decode already
            dur *= self.solo_factor
        dur += self.copy_s * step.tokens
        self._account(now, dur, n, step.tokens, ptok)
        return dur

    def _failed(self, step: Any) -> None:
        reasons = {r: self.policy.refusal(r) for r in step.refused}
        self.failed += ([(r, reasons[r], "refused") for r in step.refused]
                        + [(r, PREEMPTED, "preempted") for r in step.dropped])

    def _kv_waits(self, step: Any, now: float) -> None:
        """Time items spend waiting for KV memory: from the step that first held one back to the one it runs in."""
        for r in step.blocked:
            if r.kv_since < 0:
                r.kv_since = now
                self.kv_waits += 1
        for r in step.batch:
            if r.kv_since >= 0:
                waited = now - r.kv_since
                r.origin.kv_wait += waited
                self.kv_wait_s += waited
                r.kv_since = -1.0
        self.kv_pending = sum(1 for r in step.waiting if r.kv_since >= 0)

    def _cost(self, layers: int, ptok: int, decodes: int, batch: list[Any], prompts: list[Any]) -> float:
        """prefill_time(ptok, layers) + decode_time(decodes, layers, context of the batch's decode items)."""
        if decodes and ptok and self.mixed_batched:
            context = sum(map(_POS, batch)) - sum(map(_POS, prompts)) + decodes
            return layers * self._batched(ptok, decodes, context)
        dur = layers * self.prefill_per_layer(ptok) if ptok else 0.0
        if decodes:
            context = sum(map(_POS, batch)) - sum(map(_POS, prompts)) + decodes
            d = self.decode_per_layer(decodes)
            if decodes == 1 and self.solo_beside:
                d *= self.solo_factor
            dur += layers * (d + self.context_s * context)
        return dur

    def _batched(self, ptok: int, decodes: int, context: int) -> float:
        """Seconds per layer of a mixed step (ptok prompt tokens and `decodes` decode items attending to
        `context` tokens) under mixed_steps="batched": the step runs its prompt and decode tokens in one pass,
        as the runtime's engine does, so it reads the weights once: max(prefill(ptok + decodes),
        decode(decodes)) plus the decode items' context."""
        return (max(self.prefill_per_layer(ptok + decodes), self.decode_per_layer(decodes))
                + self.context_s * context)

    def _segmented(self, batch: list[Any], slots: list[int]) -> float:
        """Items running different layer ranges: per slice of layers, the cost of the items that run it."""
        nr = len(self.ranges)
        prompt = [0] * nr
        decode = [0] * nr
        context = [0] * nr
        for r, k in zip(batch, slots, strict=True):
            if r.pf:
                prompt[k] += r.num_tokens
            else:
                decode[k] += 1
                context[k] += r.start + 1
        return self._sum_segments(prompt, decode, context)

    def _sum_segments(self, prompt: list[int], decode: list[int], context: list[int]) -> float:
        dur = 0.0
        ctx_s = self.context_s
        for length, active in self.segments:
            p = d = c = 0
            for k in active:
                p += prompt[k]
                d += decode[k]
                c += context[k]
            if p and d and self.mixed_batched:
                dur += length * self._batched(p, d, c)
                continue
            if p:
                dur += length * self.prefill_per_layer(p)
            if d:
                t = self.decode_per_layer(d)
                if d == 1 and self.solo_beside:
                    t *= self.solo_factor
                dur += length * (t + ctx_s * c)
        return dur

    def _account(self, now: float, dur: float, items: int, tokens: int, prompt_tokens: int) -> None:
        self.steps += 1
        self.items += items
        self.tokens += tokens
        self.prompt_tokens += prompt_tokens
        if items > self.max_batch_items:
            self.max_batch_items = items
        self.busy_s += dur
        end = now + dur
        lo, hi = self.window
        if end > lo and now < hi:
            self.window_busy_s += (end if end < hi else hi) - (now if now > lo else lo)
        if dur > 0:
            bins = self.busy_bins
            b = int(now / self.bin_s)
            if b < len(bins) and end <= (b + 1) * self.bin_s:
                bins[b] += dur
            else:
                add_to_bins(bins, self.bin_s, now, end)
            if self.track_throughput:
                self.rate.step(tokens, dur)
            if prompt_tokens:
                self.prefill_rate.step(tokens, dur)

    # -- KV memory ------------------------------------------------------------------------------------------

    def release(self, session: int, now: float) -> None:
        """The coordinator's Release (or a prefill hop's own, once its KV has gone): the session's blocks go back
        to the pool, and KV still coming for it is no longer awaited."""
        if self.ledger.release(session):
            self.kv_note(now)
        if self.kv_coming or self.kv_first:
            self.kv_coming.pop(session, None)
            self.kv_held.pop(session, None)
            self.kv_first.discard(session)

    def occupy(self, now: float, dur: float) -> None:
        """Busy for `dur` seconds outside a step (packing KV to hand on)."""
        self.busy_s += dur
        end = now + dur
        lo, hi = self.window
        if end > lo and now < hi:
            self.window_busy_s += (end if end < hi else hi) - (now if now > lo else lo)
        add_to_bins(self.busy_bins, self.bin_s, now, end)

    def kv_note(self, now: float) -> None:
        """Follow the ledger's blocks in use (peak and time integral); also closes the integral at the end."""
        self.kv_area += self.kv_used * (now - self.kv_t)
        self.kv_t = now
        self.kv_used = self.ledger.used
        if self.kv_used > self.kv_peak:
            self.kv_peak = self.kv_used

    def queued_tokens(self) -> int:
        """Tokens waiting for a step (what join-the-shortest-queue compares)."""
        return sum(map(_NTOK, self.queue))
