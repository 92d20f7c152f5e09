"""What an instance (one whole model on its GPUs) runs next: the instance scheduler of EcoServe and its NoDG peers.

Two batching disciplines, one object (§2.2, §4.1's baselines):

- "separate" (vLLM; EcoServe's instance scheduler, §3.4): a step is all prefill or all decode, and prefills come
  first. An instance decodes until new requests arrive, switches to prefill while any are admissible, and back.
  Under EcoServe the macro-instance scheduler sends requests to one instance at a time, so each instance
  decodes undisturbed for long stretches and prefills in bursts (temporal disaggregation); under plain
  round-robin routing the same rule is vLLM's prefill-priority NoDG.
- "hybrid" (Sarathi): decode first, every step carries all decodes and fills the rest of a token budget with
  prompt chunks (chunked prefill).

The instance tracks what Algorithm 2 reads (`status`): the requests it decodes (with their output so far and
first-token time, the saved-TPOT bookkeeping of §3.2) and its free KV; the macro-instance scheduler keeps the
bursts it routed (`policy.macro_scheduler`). KV is counted in tokens: a request
holds its prompt and generated tokens; a prompt is admitted while the pool keeps `reserve` tokens per running
request for growth (vLLM's watermark); when decode growth still overflows, the youngest decode is preempted
and re-queued first with its generated tokens as prompt (vLLM's recompute preemption).

Pure: the executor (a simulated instance, a node's batch loop) says when a step ends and which requests ended.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from hetnode.policy.ecoserve import Decoding, InstanceState

SEPARATE = "separate"
HYBRID = "hybrid"
DISCIPLINES = (SEPARATE, HYBRID)
PREFILL = "prefill"
DECODE = "decode"


@dataclass(frozen=True, slots=True)
class InstanceConfig:
    discipline: str = SEPARATE
    max_batch_tokens: int = 8192  # prompt tokens one prefill step takes ("separate")
    token_budget: int = 512  # tokens per hybrid step, decodes included (Sarathi's chunk budget)
    max_decodes: int = 256  # requests running at once, so decode items per step (vLLM's max_num_seqs)
    kv_tokens: int = 100_000  # the pool
    reserve: int = 0  # tokens of growth kept free per running request when admitting a prompt

    def __post_init__(self) -> None:
        if self.discipline not in DISCIPLINES:
            raise ValueError(f"discipline must be one of {', '.join(DISCIPLINES)}, not {self.discipline!r}")
        if min(self.max_batch_tokens, self.token_budget, self.max_decodes, self.kv_tokens) < 1 or self.reserve < 0:
            raise ValueError(f"bad instance config: {self}")


@dataclass(slots=True)
class Held:
    """A request on this instance."""

    rid: int
    prompt: int  # tokens to prefill (prompt, or prompt + output so far after a preemption)
    routed_at: float
    done: int = 0  # prompt tokens prefilled
    output: int = 0  # tokens generated
    first_token_at: float = -1.0

    @property
    def tokens(self) -> int:
        return self.done + self.output


@dataclass(slots=True)
class PhaseSwitch:
    """Temporal disaggregation's one rule ("separate"): prefill while any prompt can run, else decode;
    `switched_at` is the instant a prefill phase last gave way to decoding. The PaDG simulator's instances (through
    `InstanceScheduler`) and a node's batch loop (`policy.temporal_batching`) both decide each step by it."""

    phase: str = DECODE
    switched_at: float = 0.0  # when the last prefill phase ended (its requests' decode phase starts)

    def next(self, prefill: bool, decode: bool, now: float) -> str | None:
        """The phase of the next step, given whether a prompt can run and whether a decode can; None: idle."""
        if prefill:
            self.phase = PREFILL
            return PREFILL
        if self.phase == PREFILL:
            self.phase, self.switched_at = DECODE, now
        return DECODE if decode else None


@dataclass(frozen=True, slots=True)
class Plan:
    """One step: its kind, prompt chunks (rid, prefilled before, tokens) and decode items (rid, context)."""

    kind: str  # PREFILL, DECODE, or "hybrid"
    chunks: tuple[tuple[int, int, int], ...] = ()
    decodes: tuple[tuple[int, int], ...] = ()


@dataclass
class InstanceScheduler:
    config: InstanceConfig = field(default_factory=InstanceConfig)
    waiting: deque[Held] = field(default_factory=deque)  # routed, not all prefilled, in order
    running: dict[int, Held] = field(default_factory=dict)  # admitted (KV held), by rid, in admission order
    phases: PhaseSwitch = field(default_factory=PhaseSwitch)
    routed: int = 0  # requests routed here so far (the macro-instance scheduler's view counts against it)
    preempted: list[int] = field(default_factory=list)  # rids preempted since the executor last looked

    @property
    def phase(self) -> str:
        return self.phases.phase

    @property
    def switched_at(self) -> float:
        """When the last prefill phase ended."""
        return self.phases.switched_at

    def route(self, rid: int, prompt: int, now: float) -> None:
        """A request the macro-instance scheduler (or a load balancer) sent here."""
        if prompt < 1:
            raise ValueError(f"a prompt has at least one token, not {prompt}")
        self.waiting.append(Held(rid, prompt, now))
        self.routed += 1

    @property
    def kv_used(self) -> int:
        return sum(h.prompt + h.output for h in self.running.values())

    @property
    def load(self) -> int:
        """Requests routed here and not finished."""
        return len(self.waiting) + len(self.running)

    def idle(self) -> bool:
        return not self.waiting and not self.running

    def adopt(self, rid: int, context: int, now: float) -> None:
        """A request prefilled elsewhere whose KV (`context` tokens) arrived: it only decodes here (FuDG)."""
        self.waiting.append(Held(rid, context, now, done=context, output=1, first_token_at=now))
        self.routed += 1

    def next_step(self, now: float) -> Plan | None:
        """The next step's work, or None when there is nothing to run."""
        cfg = self.config
        budget = cfg.token_budget if cfg.discipline == HYBRID else cfg.max_batch_tokens
        self._admit(budget)
        decoding = [h for h in self.running.values() if h.done >= h.prompt]
        if cfg.discipline == HYBRID:
            decodes = self._decodes(decoding)
            chunks = self._chunks(cfg.token_budget - len(decodes))
            if not chunks and not decodes:
                return None
            return Plan("hybrid", chunks, decodes)
        chunks = self._chunks(cfg.max_batch_tokens)
        decodes = () if chunks else self._decodes(decoding)
        phase = self.phases.next(bool(chunks), bool(decodes), now)
        if phase == PREFILL:
            return Plan(PREFILL, chunks)
        return Plan(DECODE, (), decodes) if phase == DECODE else None

    def _decodes(self, decoding: list[Held]) -> tuple[tuple[int, int], ...]:
        return tuple((h.rid, h.tokens) for h in decoding[:self.config.max_decodes])

    def _admit(self, budget: int) -> None:
        """Waiting requests into the running set, in order, while their KV fits (first come, first admitted:
        a prompt that does not fit holds back the later ones), their prompts fit a step's budget, and the running
        set stays within `max_decodes` (vLLM's max_num_seqs bounds the requests it runs, not only a step's: a
        request admitted past it would hold KV and wait for a decode slot, its TPOT lost, where vLLM keeps it
        queued and its wait counts in TTFT)."""
        used = self.kv_used
        unprefilled = sum(h.prompt - h.done for h in self.running.values())
        while self.waiting and unprefilled < budget and len(self.running) < self.config.max_decodes:
            h = self.waiting[0]
            need = h.prompt + h.output + self.config.reserve * (len(self.running) + 1)
            if used + need > self.config.kv_tokens and self.running:
                break
            self.waiting.popleft()
            self.running[h.rid] = h
            used += h.prompt + h.output
            unprefilled += h.prompt - h.done

    def _chunks(self, budget: int) -> tuple[tuple[int, int, int], ...]:
        """Prompt chunks of admitted requests, in order, within `budget` tokens."""
        chunks = []
        for h in self.running.values():
            if budget <= 0:
                break
            if h.done < h.prompt:
                take = min(budget, h.prompt - h.done)
                chunks.append((h.rid, h.done, take))
                budget -= take
        return tuple(chunks)

    def step_done(self, plan: Plan, now: float, ended: Collection[int]) -> list[int]:
        """The step of `plan` ended at `now`; `ended` requests produced their last token in it. Returns the
        rids that produced a token (first tokens included)."""
        produced = []
        for rid, _, take in plan.chunks:
            h = self.running[rid]
            h.done += take
            if h.done >= h.prompt:
                if h.first_token_at < 0:
                    h.first_token_at = now
                h.output += 1
                produced.append(rid)
        for rid, _ in plan.decodes:
            self.running[rid].output += 1
            produced.append(rid)
        for rid in ended:
            self.running.pop(rid, None)
        self._preempt_overflow()
        return produced

    def _preempt_overflow(self) -> None:
        """Recompute preemption: while KV overflows, the youngest admitted request goes back to the front."""
        while self.kv_used > self.config.kv_tokens and len(self.running) > 1:
            rid = next(reversed(self.running))
            h = self.running.pop(rid)
            self.waiting.appendleft(Held(h.rid, h.prompt + h.output, h.routed_at, output=0,
                                         first_token_at=h.first_token_at))
            self.preempted.append(rid)

    def status(self) -> InstanceState:
        """What Algorithm 2 reads: the decodes, free KV."""
        decodes = tuple(Decoding(h.output, h.first_token_at) for h in self.running.values() if h.first_token_at >= 0)
        free = self.config.kv_tokens - self.kv_used - sum(h.prompt for h in self.waiting)
        return InstanceState(decodes=decodes, free_kv_tokens=max(0, free), routed=self.routed)
