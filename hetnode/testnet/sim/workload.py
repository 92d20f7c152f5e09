"""Workloads: the Azure LLM inference traces replayed, Poisson arrivals, and offline (saturating) runs.

The Azure traces (Splitwise's, also used by Helix, ThunderServe and Cronus) are CSV files with the columns
TIMESTAMP, ContextTokens, GeneratedTokens. `load_trace("conv")` reads the full trace from the shared data
folder when it can find one (`$HETNODE_TRACE_DIR`, or `../shared/data` next to the repository) and otherwise
the sample shipped in `hetnode/testnet/traces/` (the first few hundred requests of each trace), and says
which in `Trace.source`.

- `replay(trace, rate=R, duration_s=D)`: the trace's own arrival pattern (bursts and lulls) from its start,
  its time axis stretched so that exactly R x D requests arrive in [0, D): the rate holds over the part of
  the trace that is replayed (a trace's rate drifts; Helix Fig. 5b), not only over the whole trace. When the
  trace runs out it repeats after one mean gap. Helix's online setting scales the rate to 75% of the
  cluster's peak (`helix_online_rate`).
- `poisson(rate, lengths=trace, duration_s=D, seed=S)`: exponential gaps, with (input, output) pairs drawn
  from the trace.
- `sampled(trace, rate=R, duration_s=D, seed=S)`: Helix's own online generator: per 3 s interval a rate
  drawn at random from the trace's 3 s bins (scaled to R), arrivals uniform inside it, lengths drawn at random.
- `offline(trace)`: Helix's offline setting, "requests arrive at the rate needed to fully utilize the
  cluster". We run it as a closed loop that keeps `backlog` requests waiting in the scheduler's queue (and at
  most `max_inflight` unfinished), taking the trace's requests in order and cycling: the scheduler always has
  work to admit the moment its KV estimate allows, and nothing depends on guessing a rate. (An
  all-at-once arrival would do the same with a queue of thousands.)

Helix's length filter keeps requests with input <= 2048 and output <= 1024 tokens (16,657 of the conversation
trace's 19,366, mean 763 in and 232 out); `load_trace` applies it unless told not to.
"""

from __future__ import annotations

import csv
import logging
import math
import os
import random
from dataclasses import dataclass
from datetime import date
from pathlib import Path

from hetnode.errors import ConfigError

log = logging.getLogger(__name__)

TRACE_FILES = {"conv": "AzureLLMInferenceTrace_conv.csv", "code": "AzureLLMInferenceTrace_code.csv"}
SAMPLE_FILES = {"conv": "azure_conv_sample.csv", "code": "azure_code_sample.csv"}
SAMPLE_DIR = Path(__file__).resolve().parents[1] / "traces"
HELIX_MAX_INPUT = 2048
HELIX_MAX_OUTPUT = 1024


@dataclass(frozen=True)
class Trace:
    name: str
    timestamps: tuple[float, ...]  # seconds since the first request, non-decreasing
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    source: str = ""

    def __post_init__(self) -> None:
        if not len(self.timestamps) == len(self.inputs) == len(self.outputs):
            raise ValueError("a trace needs as many timestamps as input and output lengths")
        if not self.timestamps:
            raise ConfigError(f"trace {self.name} has no requests", file=self.source or None)

    def __len__(self) -> int:
        return len(self.timestamps)

    @property
    def span_s(self) -> float:
        return self.timestamps[-1] - self.timestamps[0]

    @property
    def rate(self) -> float:
        """Mean arrival rate (requests/s) over the trace."""
        return (len(self) - 1) / self.span_s if self.span_s > 0 else math.inf

    @property
    def mean_input(self) -> float:
        return sum(self.inputs) / len(self)

    @property
    def mean_output(self) -> float:
        return sum(self.outputs) / len(self)

    def filtered(self, max_input: int = HELIX_MAX_INPUT, max_output: int = HELIX_MAX_OUTPUT) -> Trace:
        """Only the requests with input <= max_input and output <= max_output (Helix §6.2)."""
        keep = [i for i in range(len(self)) if self.inputs[i] <= max_input and self.outputs[i] <= max_output]
        if not keep:
            raise ConfigError(f"no request of trace {self.name} has input <= {max_input} and output <= {max_output}")
        t0 = self.timestamps[keep[0]]
        return Trace(name=self.name, timestamps=tuple(self.timestamps[i] - t0 for i in keep),
                     inputs=tuple(self.inputs[i] for i in keep), outputs=tuple(self.outputs[i] for i in keep),
                     source=f"{self.source}, input <= {max_input}, output <= {max_output}")


def _seconds(stamp: str) -> float:
    """'2023-11-16 18:15:46.6805900' -> seconds since 2023-01-01 (only differences matter)."""
    day, _, clock = stamp.strip().partition(" ")
    if not clock:
        day, _, clock = stamp.strip().partition("T")
    y, mo, d = day.split("-")
    h, mi, s = clock.split(":")
    days = date(int(y), int(mo), int(d)).toordinal() - date(2023, 1, 1).toordinal()
    return days * 86400.0 + int(h) * 3600.0 + int(mi) * 60.0 + float(s)


def load_azure_trace(path: str | Path, name: str | None = None) -> Trace:
    """An Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens), sorted by time."""
    source = str(path)
    rows: list[tuple[float, int, int]] = []
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
            if missing:
                raise ConfigError(f"missing column(s) {', '.join(sorted(missing))}", file=source)
            for line, row in enumerate(reader, start=2):
                try:
                    rows.append((_seconds(row["TIMESTAMP"]), max(1, int(row["ContextTokens"])),
                                 max(1, int(row["GeneratedTokens"]))))
                except (ValueError, TypeError) as exc:
                    raise ConfigError(f"line {line}: {exc}", file=source) from None
    except OSError as exc:
        raise ConfigError(f"cannot read trace: {exc.strerror or exc}", file=source) from exc
    rows.sort(key=lambda r: r[0])
    if not rows:
        raise ConfigError("the trace has no requests", file=source)
    t0 = rows[0][0]
    return Trace(name=name or Path(path).stem, timestamps=tuple(r[0] - t0 for r in rows),
                 inputs=tuple(r[1] for r in rows), outputs=tuple(r[2] for r in rows), source=source)


def trace_dirs() -> list[Path]:
    """Where the full traces may be: $HETNODE_TRACE_DIR, then ../shared/data beside the repository."""
    out = []
    env = os.environ.get("HETNODE_TRACE_DIR")
    if env:
        out.append(Path(env))
    repo = Path(__file__).resolve().parents[3]
    out.append(repo.parent / "shared" / "data")
    return out


def find_trace(name: str) -> tuple[Path, bool]:
    """The file for "conv", "code" or a path; the flag says whether it is the shipped sample."""
    if name not in TRACE_FILES:
        path = Path(name)
        if not path.is_file():
            raise ConfigError(f"no trace {name!r}: give conv, code or a CSV file", key="--trace")
        return path, False
    for folder in trace_dirs():
        candidate = folder / TRACE_FILES[name]
        if candidate.is_file():
            return candidate, False
    return SAMPLE_DIR / SAMPLE_FILES[name], True


def load_trace(name: str, *, length_filter: bool = True) -> Trace:
    path, sample = find_trace(name)
    trace = load_azure_trace(path, name=name if name in TRACE_FILES else None)
    if sample:
        # Loud: a run from a copy of the tree silently measured on the sample once (the full trace sits beside
        # the repository, not in it).
        log.warning("the full %s trace is not in %s: using the shipped sample %s (set HETNODE_TRACE_DIR)", name,
                    " or ".join(str(d) for d in trace_dirs()), path)
        trace = Trace(trace.name, trace.timestamps, trace.inputs, trace.outputs,
                      source=f"{path} (the shipped sample; the full trace was not found)")
    return trace.filtered() if length_filter else trace


# -- workloads ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """Requests for one run: arrival times with lengths (online), or lengths only (offline)."""

    name: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    arrivals: tuple[float, ...] = ()  # seconds, non-decreasing; empty when offline
    offline: bool = False
    backlog: int = 32  # offline: requests kept waiting in the scheduler's queue
    max_inflight: int = 100_000  # offline: at most this many unfinished requests
    description: str = ""

    def __post_init__(self) -> None:
        if len(self.inputs) != len(self.outputs) or not self.inputs:
            raise ValueError("a workload needs at least one request, with an output length for every input")
        if not self.offline and len(self.arrivals) != len(self.inputs):
            raise ValueError("an online workload needs an arrival time per request")
        if min(self.inputs) < 1 or min(self.outputs) < 1:
            raise ValueError("requests need at least one input and one output token")
        if self.offline and (self.backlog < 1 or self.max_inflight < 1):
            raise ValueError("backlog and max_inflight must be at least 1")

    def __len__(self) -> int:
        return len(self.inputs)

    @property
    def mean_input(self) -> float:
        return sum(self.inputs) / len(self.inputs)

    @property
    def mean_output(self) -> float:
        return sum(self.outputs) / len(self.outputs)

    @property
    def rate(self) -> float:
        """Mean arrival rate of an online workload (requests/s)."""
        if self.offline or len(self.arrivals) < 2 or self.arrivals[-1] <= self.arrivals[0]:
            return math.nan
        return (len(self.arrivals) - 1) / (self.arrivals[-1] - self.arrivals[0])


def replay(trace: Trace, *, rate: float | None = None, duration_s: float) -> Workload:
    """The trace's arrivals with its time axis stretched so that exactly round(rate x duration_s) requests
    arrive in [0, duration_s) (None: the trace's own rate), repeating the trace when it runs out."""
    if rate is not None and not rate > 0:
        raise ConfigError(f"the rate must be > 0, not {rate}", key="--rate")
    if not duration_s > 0:
        raise ConfigError(f"the duration must be > 0, not {duration_s}", key="--duration")
    n = len(trace)
    gap = trace.span_s / (n - 1) if n > 1 and trace.span_s > 0 else 1.0
    period = trace.span_s + gap  # one pass of the trace, then one mean gap before it starts again

    def at(i: int) -> float:  # arrival time of request i of the repeated trace, unscaled
        return (i // n) * period + trace.timestamps[i % n]

    if rate is None:
        scale = 1.0
        count = 0
        while at(count) < duration_s:
            count += 1
    else:
        count = round(rate * duration_s)
        if count < 1:
            raise ConfigError(f"no request arrives within {duration_s} s at {rate} req/s")
        # Request `count` (the first one not taken) lands exactly at duration_s.
        end = at(count)
        scale = duration_s / end if end > 0 else 1.0
    if count < 1:
        raise ConfigError(f"no request arrives within {duration_s} s")
    arrivals = tuple(at(i) * scale for i in range(count))
    inputs = tuple(trace.inputs[i % n] for i in range(count))
    outputs = tuple(trace.outputs[i % n] for i in range(count))
    shown = rate if rate is not None else count / duration_s
    passes = f", {count / n:.2g} passes of the trace" if count > n else ""
    return Workload(name=f"{trace.name}-replay", inputs=inputs, outputs=outputs, arrivals=arrivals,
                    description=f"replay of {trace.name} ({trace.source}) at {shown:.3g} req/s for {duration_s:g} s"
                                f" ({count} requests, the trace's clock x{scale:.3g}{passes})")


def poisson(rate: float, *, lengths: Trace, duration_s: float, seed: int = 0) -> Workload:
    """Poisson arrivals at `rate` requests/s with (input, output) pairs drawn from `lengths`."""
    if not rate > 0:
        raise ConfigError(f"the rate must be > 0, not {rate}", key="--rate")
    rng = random.Random(seed)
    arrivals: list[float] = []
    inputs: list[int] = []
    outputs: list[int] = []
    t = rng.expovariate(rate)
    n = len(lengths)
    while t < duration_s:
        k = rng.randrange(n)
        arrivals.append(t)
        inputs.append(lengths.inputs[k])
        outputs.append(lengths.outputs[k])
        t += rng.expovariate(rate)
    if not arrivals:
        raise ConfigError(f"no request arrives within {duration_s} s at {rate} req/s")
    return Workload(name=f"{lengths.name}-poisson", inputs=tuple(inputs), outputs=tuple(outputs),
                    arrivals=tuple(arrivals),
                    description=f"Poisson arrivals at {rate:.3g} req/s for {duration_s:g} s, lengths from "
                                f"{lengths.name} ({lengths.source}), seed {seed}")


def sampled(trace: Trace, *, rate: float, duration_s: float, seed: int = 0, interval_s: float = 3.0) -> Workload:
    """Helix's online load generator (its artifact's `trace_generator.py`): the trace's arrival rate in
    `interval_s` (3 s) bins, rescaled so that its mean is `rate`; for each interval of [0, duration_s) one bin's
    rate drawn at random, rounded to a count (the rounding error carried to the next interval), that many
    arrivals uniform in the interval; each request's (input, output) pair drawn at random from the whole trace.

    Unlike `replay`, whose requests are the trace's first ones in order (for the conversation trace at 0.72
    req/s over 1,800 s, a mean output of 273 tokens against the trace's 232), the lengths here follow the
    whole trace, as Helix's generator draws them."""
    if not rate > 0 or not duration_s > 0 or not interval_s > 0:
        raise ConfigError(f"the rate ({rate}), duration ({duration_s}) and interval ({interval_s}) must be > 0",
                          key="--rate")
    bins = [0] * max(1, math.ceil(trace.span_s / interval_s) if trace.span_s > 0 else 1)
    for t in trace.timestamps:
        bins[min(len(bins) - 1, int(t / interval_s))] += 1
    scale = rate * interval_s / (sum(bins) / len(bins))  # requests per interval at `rate`, per unit of a bin
    rng = random.Random(seed)
    n = len(trace)
    arrivals: list[float] = []
    inputs: list[int] = []
    outputs: list[int] = []
    carry = 0.0
    intervals = math.ceil(duration_s / interval_s)
    for k in range(intervals):
        want = scale * bins[rng.randrange(len(bins))] + carry
        count = round(want)
        carry = want - count
        start = k * interval_s
        for t in sorted(start + interval_s * rng.random() for _ in range(count)):
            if t >= duration_s:
                continue
            j = rng.randrange(n)
            arrivals.append(t)
            inputs.append(trace.inputs[j])
            outputs.append(trace.outputs[j])
    if not arrivals:
        raise ConfigError(f"no request arrives within {duration_s} s at {rate} req/s")
    return Workload(name=f"{trace.name}-sampled", inputs=tuple(inputs), outputs=tuple(outputs),
                    arrivals=tuple(arrivals),
                    description=f"Helix's generator over {trace.name} ({trace.source}): {interval_s:g} s bins of its "
                                f"rate drawn at random, scaled to {rate:.3g} req/s for {duration_s:g} s "
                                f"({len(arrivals)} requests), lengths drawn at random, seed {seed}")


def offline(trace: Trace, *, backlog: int = 32, max_inflight: int = 100_000) -> Workload:
    """A saturating closed loop over the trace's requests (in order, cycling)."""
    return Workload(name=f"{trace.name}-offline", inputs=trace.inputs, outputs=trace.outputs, offline=True,
                    backlog=backlog, max_inflight=max_inflight,
                    description=f"offline: {trace.name} ({trace.source}) as a closed loop keeping {backlog} "
                                f"requests queued at the scheduler")


def helix_online_rate(max_flow_tokens_s: float, mean_input: float, mean_output: float,
                      load: float = 0.75) -> float:
    """Helix §6.2's online rate: `load` (75%) of the cluster's peak, in requests/s.

    The peak is the placement's max flow in tokens/s, where a token is a prompt or a generated token (one unit
    of flow crosses the whole model once), so a request is worth input + output tokens of it."""
    if not max_flow_tokens_s > 0:
        raise ConfigError("the plan has no throughput (max flow 0): nothing can be served")
    return load * max_flow_tokens_s / (mean_input + mean_output)
