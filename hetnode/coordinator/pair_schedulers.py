"""Routing a ThunderServe plan by its orchestration, and the random dispatch ThunderServe compares it with.

- "tstp": the pair (prefill replica i, decode replica j) of each request follows the plan's orchestration
  (§3.3): pair (i, j) takes X_i Y_ij of the requests, spread evenly over time by smooth weighted round robin
  (each pair earns its weight per request; the pair with the most credit that has KV room is taken and pays
  the total back), so the shares hold exactly over any long run without drawing at random.
- "random-pairs": a prefill and a decode replica drawn uniformly (seeded) among the pairs with KV room:
  Fig. 12's "random dispatching" without the orchestration.

Both keep everything else of CLS (`SplitScheduler`): the KV accounting, the high-water masks, the queue, node
failures, and its `decode_booking` ("handoff": the pair is picked at admission among those whose prefill replica
has room and whose decode replica could hold the request; the decode KV is charged at the hand-off). Pure: no
I/O, no clock.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

from hetnode.coordinator.scheduler import Decision
from hetnode.coordinator.split_scheduler import SplitScheduler
from hetnode.errors import ConfigError
from hetnode.planner.plan import PlacementPlan


class _PairScheduler(SplitScheduler):
    """CLS with the choice of the pair left to `_pick`."""

    def __init__(self, plan: PlacementPlan, **kwargs: Any) -> None:
        super().__init__(plan, **kwargs)
        self._prefill = [i for i, r in enumerate(self._replicas) if r.role == "prefill"]
        self._decode = [i for i, r in enumerate(self._replicas) if r.role == "decode"]

    def _pick(self, fits: list[tuple[int, int]]) -> tuple[int, int]:
        raise NotImplementedError

    def _assign(self, request_id: str, input_len: int, waited: float) -> Decision | None:
        avg = self._output.mean
        replicas = self._replicas
        fits = [(i, j) for i, p in enumerate(self._prefill) for j, d in enumerate(self._decode)
                if self._open(replicas[p], input_len, avg) and self._open(replicas[d], input_len + avg, avg)]
        if not fits:
            return None
        i, j = self._pick(fits)
        return self._book(request_id, self._prefill[i], self._decode[j], input_len, waited)


class TstpScheduler(_PairScheduler):
    """Pairs in the shares of the plan's orchestration (module docstring)."""

    name: ClassVar[str] = "tstp"

    def __init__(self, plan: PlacementPlan, **kwargs: Any) -> None:
        super().__init__(plan, **kwargs)
        orch = plan.orchestration
        if (orch is None or len(orch.prefill_share) != len(self._prefill)
                or any(len(row) != len(self._decode) for row in orch.decode_share)):
            raise ConfigError(f"scheduler 'tstp' routes by a plan's orchestration (X and Y, one per prefill replica "
                              f"and pair); plan {plan.cluster}/{plan.model} ({plan.method}) has none that fits")
        self._weight = {(i, j): orch.prefill_share[i] * orch.decode_share[i][j]
                        for i in range(len(self._prefill)) for j in range(len(self._decode))}
        self._credit = dict.fromkeys(self._weight, 0.0)

    def _pick(self, fits: list[tuple[int, int]]) -> tuple[int, int]:
        # Only pairs the orchestration routes to earn credit; when none of them has room, the open pair with
        # the most credit (the least overdrawn) takes the request, so KV pressure bends the shares, never blocks.
        total = sum(self._weight.values())
        for pair, w in self._weight.items():
            self._credit[pair] += w
        routed = [p for p in fits if self._weight[p] > 0] or fits
        pair = max(routed, key=lambda p: (self._credit[p], -p[0], -p[1]))
        self._credit[pair] -= total
        return pair


class RandomPairScheduler(_PairScheduler):
    """A uniformly drawn pair among those with KV room (seeded)."""

    name: ClassVar[str] = "random-pairs"

    def __init__(self, plan: PlacementPlan, *, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(plan, seed=seed, **kwargs)
        self._rng = random.Random(seed)

    def _pick(self, fits: list[tuple[int, int]]) -> tuple[int, int]:
        return fits[self._rng.randrange(len(fits))]
