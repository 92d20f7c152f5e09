"""One GPU's inference engine, iteration by iteration, for the two-GPU designs of Cronus §5 (pair_designs.py).

An engine is a vLLM-like instance: a queue of work items, a KV pool in blocks (`KVLedger`, vLLM's
`gpu_memory_utilization` of 0.9 of the device's memory minus the weights it holds), and the runtime's batch
policy (`BatchPolicy`) forming each iteration under a token budget (512 for chunked prefill: a prompt longer
than what is left of the budget is split, and its rest waits for the next iteration). Decodes go first in the
queue, as vLLM's chunked-prefill scheduler takes them, then prompts in arrival order.

An iteration's time is the roofline cost model's (`planner.costmodel.step_time`, the same model Cronus's
predictors are fitted on in `planner.cronus_fit`): the longer of its FLOPs (2 per weight per token, plus
attention over every token's context) and its bytes (the weights once, plus every item's KV) at the device's
efficiency shares, for the layers the engine holds, plus the roofline's fixed costs (`Roofline`: none by
default).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from hetnode.planner.costmodel import DEFAULT_ROOFLINE, LayerShape, Roofline, step_time
from hetnode.planner.devices import DeviceSpec
from hetnode.planner.model import ModelSpec
from hetnode.policy import BatchConfig, BatchPolicy, KVLedger

GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of device memory for weights, activations and KV
BLOCK_SIZE = 16  # vLLM's KV block, in tokens


@dataclass(slots=True)
class PairRequest:
    """A request and what happened to it (times in simulated seconds)."""

    rid: str
    arrival: float
    prompt: int
    output: int
    split: int = -1  # Cronus: the prompt tokens its PPI prefilled (-1: none)
    first_token: float = -1.0
    finish: float = -1.0
    generated: int = 0
    gaps: list[float] = field(default_factory=list)  # time between its tokens
    last_token: float = -1.0

    def token(self, now: float) -> bool:
        """A token of this request came out at `now`; True when it was the last."""
        if self.generated == 0:
            self.first_token = now
        else:
            self.gaps.append(now - self.last_token)
        self.last_token = now
        self.generated += 1
        if self.generated >= self.output:
            self.finish = now
            return True
        return False


class Work:
    """An item in an engine's queue: `num_tokens` tokens of a request at positions [start, start + num_tokens);
    a prompt item while start < prefill_end (what `BatchPolicy` reads)."""

    __slots__ = ("num_tokens", "prefill_end", "request", "session", "start")

    def __init__(self, request: PairRequest, start: int, num_tokens: int, prefill_end: int) -> None:
        self.request = request
        self.session = request.rid
        self.start = start
        self.num_tokens = num_tokens
        self.prefill_end = prefill_end

    @property
    def prompt(self) -> bool:
        return self.start < self.prefill_end

    def piece(self, k: int) -> Work:
        """The policy split this item: a clone runs its first k tokens; this one keeps the rest, in place."""
        clone = Work(self.request, self.start, k, self.prefill_end)
        self.start += k
        self.num_tokens -= k
        return clone


def kv_tokens(device: DeviceSpec, model: ModelSpec, layers: int, *, embeddings: bool = True) -> int:
    """Tokens of KV a vLLM instance holding `layers` layers (and the embedding and output matrices) keeps."""
    weights = layers * model.layer_bytes
    if embeddings:
        weights += 2 * model.vocab_size * model.hidden_size * model.bytes_per_param
    free = device.memory_bytes * GPU_MEMORY_UTILIZATION - weights
    if free <= 0:
        raise ValueError(f"{model.name}'s {layers} layers do not fit on a {device.name}")
    return int(free // (model.kv_bytes_per_token_layer * layers))


def iteration_seconds(device: DeviceSpec, shape: LayerShape, layers: int, batch: Iterable[Work],
                      roofline: Roofline = DEFAULT_ROOFLINE) -> float:
    """One iteration of `batch` on `layers` layers: each item attends to its context so far and its own tokens."""
    new = context = pairs = 0
    for w in batch:
        end = w.start + w.num_tokens
        new += w.num_tokens
        context += end
        pairs += w.num_tokens * w.start + w.num_tokens * (w.num_tokens + 1) // 2
    return step_time(device, shape, layers, new, context, attended_pairs=pairs, roofline=roofline)


class Engine:
    """A queue, a KV pool and a batch policy on one device holding `layers` layers."""

    def __init__(self, name: str, device: DeviceSpec, model: ModelSpec, layers: int, *, kv_tokens: int,
                 max_batch_tokens: int, max_prompts: int | None = None,
                 roofline: Roofline = DEFAULT_ROOFLINE) -> None:
        self.name = name
        self.device = device
        self.shape = model.shape
        self.layers = layers
        self.roofline = roofline
        self.ledger = KVLedger(kv_tokens // BLOCK_SIZE, BLOCK_SIZE)
        self.policy = BatchPolicy(self.ledger, BatchConfig(max_batch_tokens=max_batch_tokens, max_prompts=max_prompts))
        self.budget = max_batch_tokens
        self.queue: list[Work] = []
        self.running: list[Work] = []  # the iteration under way
        self.busy = False
        self.busy_s = 0.0
        self.iterations = 0
        self.preemptions = 0

    @property
    def state_decodes(self) -> tuple[int, int]:
        """(decode requests, their total context): what Cronus's balancer reads of a CPI."""
        n = ctx = 0
        for w in (*self.queue, *self.running):
            if not w.prompt:
                n += 1
                ctx += w.start
        return n, ctx

    def waiting(self) -> int:
        """Requests sent here that no iteration has started yet (vLLM's waiting queue)."""
        return sum(1 for w in self.queue if w.session not in self.ledger)

    def add(self, work: Work) -> None:
        self.queue.append(work)

    def form(self) -> tuple[list[Work], float] | None:
        """The next iteration (its items and seconds), or None when nothing can run."""
        queue = [w for w in self.queue if not w.prompt] + [w for w in self.queue if w.prompt]
        step = self.policy.form(queue)
        if step.refused:
            names = ", ".join(w.session for w in step.refused)
            raise RuntimeError(f"{self.name} cannot hold the KV of {names} (its pool is {self.ledger.capacity} "
                               f"blocks): the workload does not fit this design")
        self.queue = step.waiting
        if step.dropped:
            # Preempted for want of KV (the policy dropped its reservation): vLLM's recompute, the request goes
            # back to the head of the queue to prefill its prompt and the tokens it has generated.
            again = {w.session: w.request for w in step.dropped}
            self.preemptions += len(again)
            redo = [Work(r, 0, r.prompt + r.generated, r.prompt + r.generated) for r in again.values()]
            self.queue = redo + self.queue
        if not step.batch:
            return None
        batch = [w.piece(step.split_tokens) if w is step.split else w for w in step.batch]
        self.running = batch
        self.iterations += 1
        return batch, iteration_seconds(self.device, self.shape, self.layers, batch, self.roofline)

    def release(self, session: str) -> None:
        self.ledger.release(session)
