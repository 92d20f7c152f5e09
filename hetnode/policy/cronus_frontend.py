"""Cronus's frontend (§4.2, steps 1-5 of Fig. 1): when a request goes to the partial prefill instance, and how much.

A request waits at the frontend until the PPI's waiting queue is empty; the PPI holds at most `ppi_limit` (two)
requests at a time, one prefilling and one waiting, so that the split of each is computed from the CPI's
statistics of that moment rather than of when it arrived. At dispatch the splitter (`CronusBalancer`, or
`WholePrompt` for the disaggregated baselines, which §5.1 runs "with the same code ... but always set the
partial prefill length to the input length") reads the CPI's state and picks L_p. When the PPI reports a
partial prefill done, the frontend hands the request to the CPI and dispatches the next one.

Pure: the caller passes the CPI's state in (the runtime from the CPI node's reports, the simulator from its
simulated instance); one object per PPI-CPI pair.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from hetnode.policy.cronus import CpiState, Split

PPI_LIMIT = 2  # §4.2: "limiting the total number of requests in the PPI to at most two at a time"


class Splitter(Protocol):
    def split(self, prompt: int, state: CpiState) -> Split: ...


class WholePrompt:
    """Disaggregated prefill through Cronus's code path: the PPI prefills every prompt whole (k = L_in)."""

    def split(self, prompt: int, state: CpiState) -> Split:
        if prompt < 1:
            raise ValueError(f"a prompt has at least one token, not {prompt}")
        return Split(prompt, 0.0, 0.0)


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Send `request_id` to the PPI to prefill its first `split.tokens` tokens."""

    request_id: str
    prompt: int
    split: Split


class CronusFrontend:
    def __init__(self, splitter: Splitter, *, ppi_limit: int = PPI_LIMIT) -> None:
        if ppi_limit < 1:
            raise ValueError(f"ppi_limit must be >= 1, not {ppi_limit}")
        self.splitter = splitter
        self.ppi_limit = ppi_limit
        self.waiting: deque[tuple[str, int]] = deque()  # (request id, prompt tokens), arrival order
        self.at_ppi: set[str] = set()
        self.decisions = 0

    def submit(self, request_id: str, prompt: int, state: CpiState) -> list[Dispatch]:
        """A request arrived: what goes to the PPI now (this one, if the PPI has room and nobody waits)."""
        if prompt < 1:
            raise ValueError(f"request {request_id}: a prompt has at least one token, not {prompt}")
        if request_id in self.at_ppi or any(rid == request_id for rid, _ in self.waiting):
            raise ValueError(f"request {request_id} is already at the frontend")
        self.waiting.append((request_id, prompt))
        return self._dispatch(state)

    def partial_done(self, request_id: str, state: CpiState) -> list[Dispatch]:
        """The PPI finished `request_id`'s partial prefill (it goes on to the CPI): what goes to the PPI next."""
        if request_id not in self.at_ppi:
            raise ValueError(f"request {request_id} is not at the PPI")
        self.at_ppi.discard(request_id)
        return self._dispatch(state)

    def cancel(self, request_id: str, state: CpiState) -> list[Dispatch]:
        """`request_id` left (its client went away, or the PPI failed it): its place goes to the next one."""
        self.at_ppi.discard(request_id)
        self.waiting = deque((rid, n) for rid, n in self.waiting if rid != request_id)
        return self._dispatch(state)

    def _dispatch(self, state: CpiState) -> list[Dispatch]:
        out = []
        while self.waiting and len(self.at_ppi) < self.ppi_limit:
            rid, prompt = self.waiting.popleft()
            self.at_ppi.add(rid)
            self.decisions += 1
            out.append(Dispatch(rid, prompt, self.splitter.split(prompt, state)))
        return out
