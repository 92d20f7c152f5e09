"""Splitwise's machine pools (§IV-A): the cluster-level scheduler with a prefill, a decode and a mixed pool.

The phase-split plan's replicas start in the pool of their role. Each request still gets a prefill and a decode
replica at arrival by join-the-shortest-queue on pending tokens (`SplitScheduler`), but a pool that is
overloaded borrows:

- Prefill: when even the shortest prefill queue would hold more than `prefill_queue_tokens` prompt tokens with
  this prompt, the request goes to a mixed replica whose queue stays under that; failing one, the decode
  replica with the shortest queue moves into the mixed pool and prefills it.
- Decode: token machines batch until their memory is near full (Splitwise §IV-B), so the decode pool is
  overloaded when no decode replica has KV room under the high-water mark, or, where `decode_batch` is set,
  when even the shortest decode queue already holds that many requests (a batch past which a decode step is
  slower than the TBT SLO allows: memory is rarely what runs out first on a whole DGX); then a mixed replica with
  room takes the decode, failing one the prefill replica with the shortest queue that has room moves into the
  mixed pool.
- A replica that prefills and decodes the same request runs it as one mixed pipeline (no KV hand-off).

A mixed replica keeps its home role and goes back to its home pool once no task of the other kind is left on
it. One that stays mixed for `repurpose_after_s` is re-purposed: its home becomes the role it has been
lending itself to (Splitwise's coarse re-purposing, "only if they stay in the mixed pool for a considerable
amount of time"). Pools change no weights: every replica holds the whole model; a role only says which work
the scheduler prefers to send it.

Pure: no I/O, no clock (every call passes `now`); the coordinator and the simulator drive the same object.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from hetnode.coordinator.scheduler import Decision
from hetnode.coordinator.split_scheduler import SplitScheduler, _Running
from hetnode.planner.plan import PlacementPlan

PREFILL, DECODE, MIXED = "prefill", "decode", "mixed"
# A few of Splitwise's 2,048-token prompt batches: past this, a prompt would wait several batches for its turn.
PREFILL_QUEUE_TOKENS = 8192.0
REPURPOSE_AFTER_S = 60.0


def _other(role: str) -> str:
    return DECODE if role == PREFILL else PREFILL


@dataclass(slots=True)
class _PoolRunning(_Running):
    shared: bool = False  # one replica prefills and decodes it: one mixed pipeline, its prompt charged once


class PoolScheduler(SplitScheduler):
    """Splitwise's CLS with prefill, decode and mixed pools; see the module docstring.

    prefill_queue_tokens: the prompt tokens a prefill queue may hold before the request looks to the mixed pool.
    decode_batch: the requests a decode queue may hold before the request looks to the mixed pool (None: until
    its KV is full).
    repurpose_after_s: how long a replica may stay mixed before its home role flips. The other options are
    `SplitScheduler`'s.
    """

    name: ClassVar[str] = "splitwise"

    def __init__(self, plan: PlacementPlan, *, prefill_queue_tokens: float = PREFILL_QUEUE_TOKENS,
                 repurpose_after_s: float = REPURPOSE_AFTER_S, decode_batch: int | None = None,
                 kv_capacity: Mapping[str, int] | None = None,
                 high_water: float = 0.9, avg_output_len: float = 240.0, queue_limit: int = 1024, seed: int = 0,
                 regions: Mapping[str, str] | None = None, output_ratio: float = 1.0,
                 learn_output: bool = True) -> None:
        if not 0 < prefill_queue_tokens <= math.inf:
            raise ValueError(f"prefill_queue_tokens must be positive, not {prefill_queue_tokens}")
        if not 0 < repurpose_after_s <= math.inf:
            raise ValueError(f"repurpose_after_s must be positive, not {repurpose_after_s}")
        if decode_batch is not None and decode_batch < 1:
            raise ValueError(f"decode_batch must be >= 1 or None, not {decode_batch}")
        super().__init__(plan, kv_capacity=kv_capacity, high_water=high_water, avg_output_len=avg_output_len,
                         queue_limit=queue_limit, seed=seed, regions=regions, output_ratio=output_ratio,
                         learn_output=learn_output)
        self.prefill_queue_tokens = prefill_queue_tokens
        self.repurpose_after_s = repurpose_after_s
        self.decode_batch = decode_batch
        self._home = [r.role for r in self._replicas]
        self._pool = list(self._home)
        self._mixed_since: list[float | None] = [None] * len(self._replicas)
        self._tasks = [{PREFILL: 0, DECODE: 0} for _ in self._replicas]
        self._prompts = [0.0] * len(self._replicas)  # prompt tokens routed to a replica and not yet prefilled
        self.moved_to_mixed = 0
        self.repurposed = 0

    def pools(self) -> list[tuple[str, str, tuple[str, ...]]]:
        """Each replica's home role, the pool it is in now, and its nodes (for status pages and tests)."""
        return [(home, pool, tuple(h.node for h in r.hops))
                for home, pool, r in zip(self._home, self._pool, self._replicas, strict=True)]

    # -- the policy -------------------------------------------------------------------------------------------

    def _assign(self, request_id: str, input_len: int, waited: float) -> Decision | None:
        self._repurpose(self._now)
        avg = self._output.mean
        p = self._pick(PREFILL, input_len, avg, "")
        if p is None:
            return None
        d = self._pick(DECODE, input_len + avg, avg, self._replicas[p].region, prefer=p)
        if d is None:
            return None
        shared = p == d
        prefill, decode = self._replicas[p], self._replicas[d]
        prefill.pending += input_len
        decode.pending += input_len
        self._prompts[p] += input_len
        for v in prefill.nodes if not shared else ():
            self._load[v] += input_len
        for v in decode.nodes:
            self._load[v] += input_len
            self._requests[v] += 1
        self._tasks[p][PREFILL] += 1
        self._tasks[d][DECODE] += 1
        self._running[request_id] = _PoolRunning(p, d, input_len, shared=shared)
        return Decision(request_id, prefill.hops, decode=None if shared else decode.hops, waited_s=waited)

    def _pick(self, kind: str, need: float, avg: float, region: str, prefer: int | None = None) -> int | None:
        """The replica that takes the `kind` task of a request needing `need` tokens of KV there: its own pool
        first, then the mixed pool, then the other pool (the replica found there moves into the mixed pool).
        `prefer`: the replica that prefills it; when that one is mixed and has room, it decodes too (a mixed
        replica runs both phases, and the KV then moves nowhere)."""
        usable = [i for i, r in enumerate(self._replicas) if not r.down and self._fits(r, need, avg)]
        if prefer is not None and self._pool[prefer] == MIXED and prefer in usable:
            return prefer
        own = self._shortest_of([i for i in usable if self._pool[i] == kind], avg, region)
        if own is not None and not self._over(own, kind, need):
            return own
        mixed = [i for i in usable if self._pool[i] == MIXED and not self._over(i, kind, need)]
        best = self._shortest_of(mixed, avg, region)
        if best is not None:
            return best
        lend = self._shortest_of([i for i in usable if self._pool[i] == _other(kind)], avg, region)
        if lend is not None:
            self._pool[lend] = MIXED
            self._mixed_since[lend] = self._now
            self.moved_to_mixed += 1
            return lend
        return own  # over its queue threshold, but nothing can take it sooner

    def _shortest_of(self, candidates: list[int], avg: float, region: str) -> int | None:
        """Join-the-shortest-queue on pending tokens, one in `region` first; ties to the first of the plan."""
        best: tuple[bool, float, int] | None = None
        for i in candidates:
            key = (bool(region) and self._replicas[i].region != region, self._queued(i, avg), i)
            if best is None or key < best:
                best = key
        return None if best is None else best[2]

    def _queued(self, i: int, avg: float) -> float:
        r = self._replicas[i]
        return r.pending + avg * self._decoding(r)

    def _over(self, i: int, kind: str, need: float) -> bool:
        """A prefill queue is over its threshold past `prefill_queue_tokens`; a decode one when it holds
        `decode_batch` requests already, or has no KV room (which the caller already excluded)."""
        if kind == PREFILL:
            return self._prompts[i] + need > self.prefill_queue_tokens
        return self.decode_batch is not None and self._decoding(self._replicas[i]) >= self.decode_batch

    def _release_prefill(self, running: _Running) -> None:
        assert isinstance(running, _PoolRunning)
        running.prefilling = False
        p = self._replicas[running.prefill]
        p.pending -= running.input_len
        self._prompts[running.prefill] -= running.input_len
        if not running.shared:
            for v in p.nodes:
                self._load[v] -= running.input_len
        self._task_done(running.prefill, PREFILL)

    def _release(self, running: _Running) -> None:
        super()._release(running)
        self._task_done(running.decode, DECODE)

    def _task_done(self, i: int, kind: str) -> None:
        self._tasks[i][kind] -= 1
        self._settle(i)

    def _settle(self, i: int) -> None:
        """A mixed replica with no task of the kind its home role does not do goes back to its home pool."""
        if self._pool[i] == MIXED and self._tasks[i][_other(self._home[i])] == 0:
            self._pool[i] = self._home[i]
            self._mixed_since[i] = None

    def _repurpose(self, now: float) -> None:
        for i, since in enumerate(self._mixed_since):
            if since is not None and now - since >= self.repurpose_after_s:
                self._home[i] = _other(self._home[i])
                self.repurposed += 1
                self._mixed_since[i] = now  # it may stay mixed a while yet (tasks of its old role drain)
                self._settle(i)

    def _largest(self, role: str) -> float:
        """Any up replica can take either task once it is lent: the largest KV of them all."""
        best = -math.inf
        for r in self._replicas:
            if not r.down:
                best = max(best, min((self._limit(v) for v in r.nodes), default=math.inf))
        return best / self.high_water

