"""The workload as the coordinator sees it: prompt and output lengths and the arrival rate over a sliding window,
and whether it has shifted from what the deployment was planned for (ThunderServe §3.4, Splitwise §IV-A).

Arrivals bring their prompt length, finished requests their output length; each is kept for `window_s`
seconds. The mix shifts when the window holds at least `min_requests` of each and its mean prompt or mean
output length differs from the baseline's by more than `shift` of the baseline's (|new - old| > shift x old).
The arrival rate shifts when the window holds at least `min_requests` arrivals and
their rate differs from the rate the plan was made for by more than `shift` of it (ThunderServe's orchestration
is solved for a rate: §3.4 re-solves it when the rate moves). A plan made for no rate in particular (`rate`
None: the split planner sizes its pools by lengths only) has its rate reported, not judged. The baseline is
what the plan in use was sized for: given at the start, and the window's mix and rate after each re-plan
(`rebase`, or `planned_at` when the planner states the rate it used). After a rebase no shift is reported for
one window: the window then still mixes the old workload with the new, and judging it would re-plan again for
a mix that is passing.

Pure: every call passes `now`.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkloadMix:
    arrivals: int  # in the window
    finished: int
    rate: float  # arrivals per second over the window (or over the time since the first, if shorter)
    mean_input: float
    mean_output: float
    window_s: float


class WorkloadMonitor:
    def __init__(self, baseline: tuple[float, float], *, window_s: float = 120.0, shift: float = 0.5,
                 min_requests: int = 50, rate: float | None = None) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, not {window_s}")
        if not shift > 0:
            raise ValueError(f"shift must be > 0, not {shift}")
        if min_requests < 1:
            raise ValueError(f"min_requests must be >= 1, not {min_requests}")
        if not (baseline[0] > 0 and baseline[1] >= 0):
            raise ValueError(f"the baseline needs a positive prompt length, not {baseline}")
        self.window_s = window_s
        self.shift = shift
        self.min_requests = min_requests
        self.baseline = (float(baseline[0]), float(baseline[1]))
        self.rate: float | None = None
        self.planned_at(rate)
        self._inputs: deque[tuple[float, int]] = deque()
        self._outputs: deque[tuple[float, int]] = deque()
        self._first = -1.0
        self._rebased = -1.0

    def arrived(self, now: float, input_len: int) -> None:
        if self._first < 0:
            self._first = now
        self._inputs.append((now, input_len))
        self._trim(now)

    def finished(self, now: float, output_len: int) -> None:
        self._outputs.append((now, output_len))
        self._trim(now)

    def mix(self, now: float) -> WorkloadMix:
        self._trim(now)
        span = min(self.window_s, now - self._first) if self._first >= 0 else 0.0
        inputs = [n for _, n in self._inputs]
        outputs = [n for _, n in self._outputs]
        return WorkloadMix(arrivals=len(inputs), finished=len(outputs),
                           rate=len(inputs) / span if span > 0 else 0.0,
                           mean_input=sum(inputs) / len(inputs) if inputs else 0.0,
                           mean_output=sum(outputs) / len(outputs) if outputs else 0.0, window_s=self.window_s)

    def spread(self, now: float) -> tuple[float, float]:
        """The standard deviation over the mean of the window's prompt and of its output lengths (0 with fewer
        than two): what the ThunderServe planner's D sees of the spread (planner/thunderserve/first_token.py).
        Apart from `mix`, which every arrival's shift check reads: only a plan and a report need it."""
        self._trim(now)
        return _cv([n for _, n in self._inputs]), _cv([n for _, n in self._outputs])

    def shifted(self, now: float) -> str:
        """Why the window's mix is no longer the baseline's ('' while it is, or while the window holds too few
        requests to say)."""
        mix = self.mix(now)
        if mix.arrivals < self.min_requests:
            return ""
        if self._rebased >= 0 and now - self._rebased < self.window_s:
            return ""
        why = []
        if mix.finished >= self.min_requests:
            for name, old, new in (("prompt", self.baseline[0], mix.mean_input),
                                   ("output", self.baseline[1], mix.mean_output)):
                if abs(new - old) > self.shift * max(old, 1.0):
                    why.append(f"mean {name} length {old:.0f} -> {new:.0f} tokens")
        # The rate needs no finished requests: a rate that has doubled is known from arrivals alone.
        if self.rate is not None and abs(mix.rate - self.rate) > self.shift * self.rate:
            why.append(f"arrival rate {self.rate:.2f} -> {mix.rate:.2f} requests/s")
        return "; ".join(why)

    def rebase(self, now: float) -> tuple[float, float]:
        """The window's mix (and rate, if the plan is judged by one) becomes the baseline (the deployment has just
        been re-planned for it)."""
        mix = self.mix(now)
        self.baseline = (mix.mean_input or self.baseline[0], mix.mean_output if mix.finished else self.baseline[1])
        if self.rate is not None and mix.rate > 0:
            self.rate = mix.rate
        self._rebased = now
        return self.baseline

    def planned_at(self, rate: float | None) -> None:
        """The plan in use was made for `rate` requests/s (None: for no rate in particular, which is not judged)."""
        if rate is not None and not rate > 0:
            raise ValueError(f"a planned rate must be > 0, not {rate}")
        self.rate = None if rate is None else float(rate)

    def _trim(self, now: float) -> None:
        cutoff = now - self.window_s
        for q in (self._inputs, self._outputs):
            while q and q[0][0] < cutoff:
                q.popleft()


def _cv(values: list[int]) -> float:
    if len(values) < 2:
        return 0.0
    mean = statistics.fmean(values)
    return statistics.pstdev(values, mean) / mean if mean > 0 else 0.0
