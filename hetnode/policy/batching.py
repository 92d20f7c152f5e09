"""Which queued items run in a node's next step: the batch policy that the batch loop and the simulator share.

One step takes everything already waiting (it never waits for more), in arrival order, under three limits:

- Tokens: at most `max_batch_tokens` per step. A prompt chunk bigger than the budget left is split (chunked
  prefill, as Sarathi and vLLM do it): this step runs its first tokens, the rest keeps its place in the queue
  for the next step. A piece split off beside other work is at least `min_chunk` tokens; when less budget is
  left the chunk waits whole for the next step (a piece costs a message per hop and a step's fixed costs, so a
  sliver is not worth cutting). An item that does not fit an empty step is split to the budget, so an item is
  never skipped forever. A decode item (one token) that does not fit waits.
- Requests: at most `max_prompts` prompt items and `max_decodes` decode items per step, where set (None: no
  cap). vLLM-style engines cap a step by sequences as well as tokens; Helix's simulator caps its nodes this way
  (its `prompt_max_requests` and `decode_max_tokens`, measured per GPU and layer count). An item is a prompt
  item while it starts before its session's `prefill_end` (as the hops tell them apart). An item over a cap
  waits for the next step, keeping its place.
- Prompt tokens: at most `prompt_tokens` prompt tokens per step, where set (DistServe's prefill batching, which
  ThunderServe adopts: prompts batched first come first served up to the length that saturates the GPU, a
  longer one alone; `role_batching.py` sets it for a prefill replica). Prompts are not cut to fill it: the
  first prompt item that does not fit ends the step's prompts, and later ones wait behind it. A step's first
  prompt item always runs (split only by the token budget), so a long prompt is never held back.
- Sessions: at most one item per session per step; a session's later item waits for its earlier one (its KV
  positions must arrive in order).
- KV memory, through the node's `KVLedger`. A session's first item at this node reserves blocks for its whole
  prefill (`prefill_end` tokens; the caller knows it, a downstream node sees only chunks), so its later chunks
  cannot run out. When that does not fit, the item waits, and so does every later first item (first come,
  first admitted) while items of admitted sessions keep running. An item that goes past its session's
  reservation (decode crossing a block boundary) grows it by the blocks it lacks; when they are not free,
  that item waits. A prompt that needs more blocks than the whole pool can never run here and is refused.

When nothing at all can run and some item waits to grow an admitted session, waiting would deadlock: admitted
sessions free their KV only when they finish, and they cannot finish without growing. The policy then preempts
the youngest of those sessions (the least work lost), drops its reservation and its queued items, and forms the
step again; the executor fails that session with `PREEMPTED`, and the coordinator moves it elsewhere. When
every waiting item is a new session blocked on admission, nothing runs until a release frees blocks.

The policy reads four attributes of a queued item (`Pending`); it never mutates one. Executors turn its `Step`
into work: the runtime slices the split item's tokens, the simulator clones a piece. No clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Generic, Protocol, TypeVar

from hetnode.policy.kv_ledger import KVLedger

PREEMPTED = "preempted: out of KV memory on this node"
MIN_CHUNK = 16  # BatchConfig.min_chunk's default


class Pending(Protocol):
    """A queued item as the policy sees it: `num_tokens` tokens of `session` at [start, start + num_tokens)."""

    @property
    def session(self) -> Hashable: ...
    @property
    def start(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def prefill_end(self) -> int: ...  # tokens the session prefills; a decode item's own end will do


T = TypeVar("T", bound=Pending)


@dataclass(frozen=True, slots=True)
class BatchConfig:
    """Knobs of the batch policy; both executors take the same defaults."""

    max_batch_tokens: int = 8192  # most tokens one step carries (bounds activation memory), >= 1
    min_chunk: int = MIN_CHUNK  # smallest piece split off a prompt chunk beside other work, >= 1
    # Admit a prompt larger than the whole pool when the node holds no KV at all, and let it grow while it is
    # alone (an overcommit). Off: such a prompt is refused. A simulation can turn it on to keep the old
    # accounting, in which memory limits only admission order, never a request's feasibility.
    admit_oversized: bool = False
    # Most prompt items (chunks) and decode items one step takes; None: no cap beyond the token budget.
    max_prompts: int | None = None
    max_decodes: int | None = None
    # Most prompt tokens one step batches, a step's first prompt item exempt; None: only the token budget.
    prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_batch_tokens < 1 or self.min_chunk < 1:
            raise ValueError(f"max_batch_tokens ({self.max_batch_tokens}) and min_chunk ({self.min_chunk}) "
                             "must be >= 1")
        for name in ("max_prompts", "max_decodes", "prompt_tokens"):
            cap = getattr(self, name)
            if cap is not None and cap < 1:
                raise ValueError(f"{name} must be >= 1 or None, not {cap}")


class Step(Generic[T]):
    """The policy's decision for one step.

    `batch` runs, in queue order. If `split` is set, it is one of `batch` that runs only its first
    `split_tokens` tokens; it also stays in `waiting` (at its place) with the rest of its tokens, which the
    executor substitutes. `waiting` is the queue for the next step, in order. `blocked` are the waiting items
    held back by KV memory. `refused` can never run here (too big for the pool); `preempted` lists the sessions
    whose reservation the policy dropped, and `dropped` their queued items; neither is in `waiting`.
    """

    __slots__ = ("batch", "blocked", "dropped", "preempted", "refused", "split", "split_tokens", "tokens",
                 "waiting")

    def __init__(self, batch: list[T], waiting: list[T], tokens: int, split: T | None, split_tokens: int,
                 blocked: list[T], refused: list[T]) -> None:
        self.batch = batch
        self.waiting = waiting
        self.tokens = tokens
        self.split = split
        self.split_tokens = split_tokens
        self.blocked = blocked
        self.refused = refused
        self.preempted: list[Hashable] = []
        self.dropped: list[T] = []

    @property
    def stalled(self) -> bool:
        """Nothing runs though items wait: every one of them waits for KV memory."""
        return not self.batch and bool(self.waiting)


def refusal(need_blocks: int, capacity: int, block_size: int) -> str:
    return (f"out of KV memory on this node: the prompt needs {need_blocks} KV blocks ({need_blocks * block_size} "
            f"tokens) and the node's whole pool is {capacity} blocks")


class BatchPolicy:
    """Forms steps from a queue against one node's `KVLedger`."""

    __slots__ = ("admit_oversized", "budget", "config", "ledger", "max_decodes", "max_prompts", "min_chunk",
                 "prompt_tokens")

    def __init__(self, ledger: KVLedger, config: BatchConfig | None = None) -> None:
        self.config = config or BatchConfig()
        self.ledger = ledger
        self.budget = self.config.max_batch_tokens
        self.min_chunk = self.config.min_chunk
        self.admit_oversized = self.config.admit_oversized
        # An absent cap is a count no step reaches (one comparison in the loop, no None test).
        self.max_prompts = self.config.max_prompts or 1 << 62
        self.max_decodes = self.config.max_decodes or 1 << 62
        self.prompt_tokens = self.config.prompt_tokens or 1 << 62

    def set_prompt_tokens(self, cap: int | None) -> None:
        """A new `BatchConfig.prompt_tokens` from the next step on: a node whose replica changed role while
        keeping its layers (a lightweight reschedule's phase flip) keeps its queue and KV."""
        self.config = replace(self.config, prompt_tokens=cap)
        self.prompt_tokens = cap or 1 << 62

    def refusal(self, item: Pending) -> str:
        """Why `item` was refused."""
        ledger = self.ledger
        return refusal(ledger.blocks_for(max(item.prefill_end, item.start + item.num_tokens)), ledger.capacity,
                       ledger.block_size)

    def form(self, queue: Sequence[T]) -> Step[T]:
        """The next step over `queue` (arrival order). Reserves KV in the ledger for what runs; may preempt."""
        step = self._form(queue)
        if step.batch or not step.blocked:
            return step
        ledger = self.ledger
        while not step.batch and step.blocked:
            grow = [it.session for it in step.blocked if it.session in ledger]
            if not grow:
                break
            victim = ledger.youngest(grow)
            ledger.release(victim)
            keep = [it for it in step.waiting if it.session != victim]
            dropped = [it for it in step.waiting if it.session == victim]
            preempted, earlier = [*step.preempted, victim], step.dropped + dropped
            refused = step.refused
            step = self._form(keep)
            step.preempted, step.dropped = preempted, earlier
            step.refused = refused + step.refused
        return step

    def _form(self, queue: Sequence[T]) -> Step[T]:
        # One pass in arrival order. A simulation runs this millions of times, hence the locals: every item of
        # every step at every node comes through here.
        ledger = self.ledger
        limits = ledger.limit
        budget = self.budget
        min_chunk = self.min_chunk
        batch: list[T] = []
        waiting: list[T] = []
        blocked: list[T] = []
        refused: list[T] = []
        refused_sessions: set[Hashable] = set()
        seen: set[Hashable] = set()
        see = seen.add
        run = batch.append
        wait = waiting.append
        tokens = 0
        split: T | None = None
        split_tokens = 0
        admitting = True  # first come, first admitted: one new session waiting on KV stops later ones
        max_prompts = self.max_prompts
        max_decodes = self.max_decodes
        prompt_cap = self.prompt_tokens
        prompts = decodes = prompt_tokens = 0
        prompts_closed = False  # a prompt item over `prompt_cap` waited: later prompts wait behind it
        for it in queue:
            s = it.session
            if s in seen:
                if s in refused_sessions:
                    refused.append(it)
                else:
                    wait(it)
                continue
            see(s)
            n = it.num_tokens
            prompt = it.start < it.prefill_end
            if (prompts >= max_prompts) if prompt else (decodes >= max_decodes):
                wait(it)
                continue
            if prompt and (prompts_closed or (prompts and prompt_tokens + n > prompt_cap)):
                prompts_closed = True
                wait(it)
                continue
            take = n
            if tokens + n > budget:
                room = budget - tokens
                if batch and (n == 1 or room < min_chunk):
                    wait(it)
                    continue
                take = room
            end = it.start + take
            limit = limits.get(s)
            if limit is None:
                need = max(it.prefill_end, end)
                if ledger.blocks_for(need) > ledger.capacity:
                    if not (self.admit_oversized and admitting and not ledger.used):
                        refused.append(it)
                        refused_sessions.add(s)
                        continue
                    ledger.reserve(s, need, overcommit=True)
                elif not admitting or not ledger.reserve(s, need):
                    admitting = False
                    blocked.append(it)
                    wait(it)
                    continue
            elif end > limit and not ledger.reserve(s, end, overcommit=self.admit_oversized and len(ledger) == 1):
                blocked.append(it)
                wait(it)
                continue
            run(it)
            tokens += take
            if prompt:
                prompts += 1
                prompt_tokens += take
            else:
                decodes += 1
            if take < n:
                split, split_tokens = it, take
                wait(it)
        return Step(batch, waiting, tokens, split, split_tokens, blocked, refused)
