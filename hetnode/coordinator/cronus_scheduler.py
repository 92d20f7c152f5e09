"""Routing for Cronus (§4.2): each request to a pair of a partial prefill instance (PPI, the low-end node) and a
chunked prefill instance (CPI, the high-end node), with the split point its balancer picks at dispatch.

A plan for it (`planner/cronus_plan.py`) lists replicas in pairs, a "ppi" then its "cpi", each a pipeline of the
whole model (one node each in the paper). A request is dispatched to a pair whose PPI holds fewer than
`ppi_limit` (two) requests and whose CPI has KV room under the high-water mark for its prompt and the average
output (the whole request ends on the CPI); otherwise it waits in the FIFO queue every policy shares, which is
§4.2's frontend queue. At dispatch the pair's splitter (`CronusBalancer`, or `WholePrompt` for disaggregated
prefill through the same code) reads the CPI's state (`cpi_state`, when the executor can say it exactly; else
this scheduler's own estimate: its requests decoding there, their contexts, the KV room left) and picks L_p.
The decision routes [0, L_p) to the PPI and the rest of the prompt and the decode to the CPI
(`Decision.split`); L_p = L_in is a prefill phase and a decode phase.

The PPI's place is freed when the executor reports the partial prefill done (`partial_done`), or at the latest at
the request's first token (`prefilled`). With `refit_window`, the two times a split request shows (the PPI's
partial prefill, dispatch or the PPI's previous hand-over to its hand-over; the CPI's rest, hand-over to first
token) refit the pair's balancer (`policy/cronus_refit.py`); a request whose hand-over was never reported
teaches nothing. A pair whose PPI is down still serves: its CPI prefills whole prompts
itself (one mixed phase), so requests moved off a dead PPI finish on the CPI. A pair whose CPI is down serves
nothing.

Pure: no I/O, no clock. The simulator (`testnet/sim/pair_designs.py`) runs this same object for its Cronus and
disaggregated designs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from hetnode.coordinator.scheduler import Decision, NamedCapacityScheduler, NodeDown, NodeKV, PipelineHop
from hetnode.errors import ConfigError
from hetnode.planner.plan import PlacementPlan
from hetnode.policy.cronus import PPI_LIMIT, CpiState, CronusBalancer, Splitter
from hetnode.policy.cronus_refit import PredictorRefit

PPI, CPI = "ppi", "cpi"
CHUNK = 512  # the CPI's token budget per iteration (§5.1)
BLOCK = 16  # KV block in tokens, for the CPI state's free blocks


@dataclass(slots=True)
class _Pair:
    ppi: tuple[PipelineHop, ...]
    cpi: tuple[PipelineHop, ...]
    ppi_nodes: frozenset[str]
    cpi_nodes: frozenset[str]
    splitter: Splitter
    at_ppi: set[str] = field(default_factory=set)
    charged: float = 0.0  # prompt tokens of the requests it runs (the CPI ends up holding them all)
    requests: int = 0
    decoding: int = 0  # requests past their first token (decoding on the CPI) and their prompt tokens
    decoding_prompt: int = 0
    ppi_down: bool = False
    cpi_down: bool = False
    refit: PredictorRefit | None = None
    ppi_free_at: float = -math.inf  # the PPI's last hand-over


@dataclass(slots=True)
class _Running:
    pair: int
    input_len: int
    split: int  # tokens the PPI prefills (0: none, the CPI does it all)
    decoding: bool = False
    routed_at: float = 0.0
    state: CpiState | None = None  # what the balancer read at dispatch
    handed_at: float = -1.0  # the PPI's hand-over


class CronusScheduler(NamedCapacityScheduler):
    name: ClassVar[str] = "cronus"
    _unit = "PPI-CPI pair"
    _full = "waiting: every pair's PPI holds its requests (two at most, Cronus §4.2) or its CPI has no KV room"

    def __init__(self, plan: PlacementPlan, *, splitters: Sequence[Splitter],
                 cpi_state: Callable[[str], CpiState] | None = None, kv_capacity: Mapping[str, int] | None = None,
                 high_water: float = 0.9, avg_output_len: float = 240.0, queue_limit: int = 1024,
                 ppi_limit: int = PPI_LIMIT, max_batch_tokens: int = CHUNK, seed: int = 0,
                 output_ratio: float = 1.0, learn_output: bool = True, refit_window: int = 0) -> None:
        super().__init__(high_water=high_water, avg_output_len=avg_output_len, queue_limit=queue_limit,
                         output_ratio=output_ratio, learn_output=learn_output)
        if ppi_limit < 1 or max_batch_tokens < 1 or refit_window < 0:
            raise ValueError(f"ppi_limit ({ppi_limit}) and max_batch_tokens ({max_batch_tokens}) must be >= 1, "
                             f"refit_window ({refit_window}) >= 0")
        replicas = plan.replicas
        if not replicas or len(replicas) % 2 or any(
                (a.role, b.role) != (PPI, CPI) for a, b in zip(replicas[::2], replicas[1::2], strict=True)):
            raise ConfigError(f"plan {plan.cluster}/{plan.model} is not a Cronus plan: it needs its replicas in "
                              f"pairs, a ppi then a cpi, not {[r.role for r in replicas]}")
        if len(splitters) != len(replicas) // 2:
            raise ConfigError(f"a Cronus plan of {len(replicas) // 2} pairs needs as many splitters, not "
                              f"{len(splitters)}")
        ranges = plan.ranges()
        hops: list[tuple[PipelineHop, ...]] = []
        for r in replicas:
            layer, pipeline = 0, []
            for node in r.nodes:
                if node not in ranges or ranges[node][0] != layer:
                    raise ConfigError(f"plan {plan.cluster}/{plan.model}: {r.role} replica {' -> '.join(r.nodes)} "
                                      "does not run every layer once, in order")
                pipeline.append(PipelineHop(node, *ranges[node]))
                layer = ranges[node][1]
            if layer != plan.num_layers:
                raise ConfigError(f"plan {plan.cluster}/{plan.model}: {r.role} replica ends at layer {layer} of "
                                  f"{plan.num_layers}")
            hops.append(tuple(pipeline))
        self.plan = plan
        self._pairs = [_Pair(hops[i], hops[i + 1], frozenset(replicas[i].nodes), frozenset(replicas[i + 1].nodes),
                             splitters[i // 2]) for i in range(0, len(hops), 2)]
        for pair in self._pairs:
            if refit_window and isinstance(pair.splitter, CronusBalancer):
                pair.refit = PredictorRefit(pair.splitter.ppi, pair.splitter.cpi, window=refit_window)
        self._capacity = dict(kv_capacity or {})
        self._cpi_state = cpi_state
        self.ppi_limit = ppi_limit
        self.max_batch_tokens = max_batch_tokens
        self._running: dict[str, _Running] = {}
        self._down: set[str] = set()
        self.decisions = 0

    # -- what the executors report ------------------------------------------------------------------------------

    def partial_done(self, request_id: str, now: float) -> list[Decision]:
        """The PPI finished the request's partial prefill (its KV goes to the CPI): its place at the PPI is free."""
        self._now = max(self._now, now)
        running = self._running.get(request_id)
        if running is None or request_id not in self._pairs[running.pair].at_ppi:
            return []
        pair = self._pairs[running.pair]
        if pair.refit is not None and running.split > 0 and isinstance(pair.splitter, CronusBalancer):
            started = max(running.routed_at, pair.ppi_free_at)
            pair.splitter.ppi = pair.refit.observe_partial(running.split, self._now - started)
        running.handed_at = self._now
        return self._leave_ppi(pair, request_id)

    def _leave_ppi(self, pair: _Pair, request_id: str) -> list[Decision]:
        """The request's place at the PPI is free (it handed over, or its first token came first)."""
        pair.at_ppi.discard(request_id)
        pair.ppi_free_at = self._now
        return self._drain(self._now)

    def prefilled(self, request_id: str, now: float) -> list[Decision]:
        """The request's first token: it decodes on the CPI now (and has certainly left the PPI)."""
        self._now = max(self._now, now)
        running = self._running.get(request_id)
        if running is None:
            return []
        if not running.decoding:
            running.decoding = True
            pair = self._pairs[running.pair]
            pair.decoding += 1
            pair.decoding_prompt += running.input_len
            if (pair.refit is not None and running.handed_at >= 0 and running.state is not None
                    and 0 < running.split < running.input_len and isinstance(pair.splitter, CronusBalancer)):
                pair.splitter.cpi = pair.refit.observe_chunked(running.input_len, running.split, running.state,
                                                               self._now - running.handed_at)
        if request_id not in self._pairs[running.pair].at_ppi:
            return []
        # No hand-over reported: the first token frees the PPI's place (its time teaches the balancer nothing).
        return self._leave_ppi(self._pairs[running.pair], request_id)

    def node_down(self, node: str, now: float | None = None) -> NodeDown:
        if now is not None:
            self._now = max(self._now, now)
        if node in self._down:
            return NodeDown(node, (), ())
        self._down.add(node)
        hit = set()
        for i, pair in enumerate(self._pairs):
            if node in pair.ppi_nodes:
                pair.ppi_down = True
                hit.add(i)
            if node in pair.cpi_nodes:
                pair.cpi_down = True
                hit.add(i)
        affected = tuple(rid for rid, r in self._running.items() if r.pair in hit and self._needs(rid, r, node))
        return NodeDown(node, affected, self._reject_unservable())

    def _needs(self, request_id: str, running: _Running, node: str) -> bool:
        """Whether the request still needs `node`: always where it is the CPI's, and where it is the PPI's until
        the request's first token (its partial prefill, or the KV hand-off after it, may still be under way)."""
        pair = self._pairs[running.pair]
        return node in pair.cpi_nodes or (running.split > 0 and not running.decoding)

    # -- views -----------------------------------------------------------------------------------------------

    @property
    def largest_kv(self) -> float:
        best = -math.inf
        for pair in self._pairs:
            if not pair.cpi_down:
                best = max(best, self._cpi_room(pair))
        return best

    @property
    def down(self) -> frozenset[str]:
        return frozenset(self._down)

    def kv_estimate(self) -> dict[str, NodeKV]:
        out = {}
        for pair in self._pairs:
            for hop in pair.cpi:
                out[hop.node] = NodeKV(pair.requests, pair.charged + pair.requests * self._output.mean,
                                       self._capacity.get(hop.node), self.high_water)
        return out

    def pipeline_of(self, request_id: str) -> tuple[PipelineHop, ...] | None:
        running = self._running.get(request_id)
        if running is None:
            return None
        pair = self._pairs[running.pair]
        return pair.ppi if request_id in pair.at_ppi else pair.cpi

    def predictors(self) -> list[dict[str, object]]:
        """Each pair's balancer as it stands (Eq. 2's k and b, Eq. 3's k_ctxp, k_ctxd and b) and the times it has
        been refitted on so far; {} for a pair whose splitter predicts nothing (whole prompts)."""
        out: list[dict[str, object]] = []
        for pair in self._pairs:
            b = pair.splitter
            if not isinstance(b, CronusBalancer):
                out.append({})
                continue
            seen = (len(pair.refit.partial), len(pair.refit.chunked)) if pair.refit is not None else (0, 0)
            out.append({"ppi": {"k": b.ppi.k, "b": b.ppi.b}, "cpi": {"k_ctxp": b.cpi.k_ctxp, "k_ctxd": b.cpi.k_ctxd,
                                                                     "b": b.cpi.b},
                        "refitted_on": {"partial": seen[0], "chunked": seen[1]}})
        return out

    def cpi_estimate(self, pair: int) -> CpiState:
        """The CPI's state as this scheduler knows it: its decoding requests, their prompts plus the average
        output so far (half of it), and the KV room left of its smallest node."""
        p = self._pairs[pair]
        context = p.decoding_prompt + int(p.decoding * self._output.mean / 2)
        room = self._cpi_room(p) - p.charged - p.requests * self._output.mean
        free = int(room // BLOCK) if math.isfinite(room) else 1 << 40
        return CpiState(decodes=p.decoding, decode_context=context, free_blocks=max(0, free), block_size=BLOCK,
                        max_batch_tokens=self.max_batch_tokens)

    # -- the policy -----------------------------------------------------------------------------------------

    def _cpi_room(self, pair: _Pair) -> float:
        caps = [self._capacity.get(h.node) for h in pair.cpi]
        known = [c for c in caps if c is not None]
        return min(known) if known else math.inf

    def _fits(self, pair: _Pair, input_len: int) -> bool:
        need = pair.charged + (pair.requests + 1) * self._output.mean + input_len
        return need <= self.high_water * self._cpi_room(pair)

    def _assign(self, request_id: str, input_len: int, waited: float) -> Decision | None:
        best: tuple[int, int] | None = None
        for i, pair in enumerate(self._pairs):
            if pair.cpi_down or not self._fits(pair, input_len):
                continue
            if not pair.ppi_down and len(pair.at_ppi) >= self.ppi_limit:
                continue
            key = (len(pair.at_ppi), i)
            if best is None or key < best:
                best = key
        if best is None:
            return None
        i = best[1]
        pair = self._pairs[i]
        pair.charged += input_len
        pair.requests += 1
        self.decisions += 1
        if pair.ppi_down or input_len < 1:  # the CPI alone: one mixed phase
            self._running[request_id] = _Running(i, input_len, 0)
            return Decision(request_id, pair.cpi, waited_s=waited)
        state = self._cpi_state(pair.cpi[0].node) if self._cpi_state is not None else self.cpi_estimate(i)
        split = pair.splitter.split(input_len, state).tokens
        pair.at_ppi.add(request_id)
        self._running[request_id] = _Running(i, input_len, split, routed_at=self._now, state=state)
        return Decision(request_id, pair.ppi, decode=pair.cpi, split=split if split < input_len else None,
                        waited_s=waited)

    def _release(self, running: _Running) -> None:
        pair = self._pairs[running.pair]
        pair.charged -= running.input_len
        pair.requests -= 1
        if running.decoding:
            pair.decoding -= 1
            pair.decoding_prompt -= running.input_len
        for rid in [r for r in pair.at_ppi if self._running.get(r) is None]:
            pair.at_ppi.discard(rid)  # the request that ended (at most two are there)

    def _unservable(self, input_len: int) -> str:
        up = [p for p in self._pairs if not p.cpi_down]
        if not up:
            return f"every pair's CPI is down ({', '.join(sorted(self._down))})"
        need = input_len + self._output.mean
        room = max(self.high_water * self._cpi_room(p) for p in up)
        if need > room:
            return (f"the request needs about {need:.0f} tokens of KV ({input_len} prompt + {self._output.mean:.0f} "
                    f"expected output) and no CPI has room for more than {room:.0f} under the high-water mark")
        return ""
