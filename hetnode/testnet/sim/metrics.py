"""What a run measured: per request, per node, per link and over time, with the aggregates people quote.

Times are seconds of simulated time. The measured window is [warmup, duration): throughput counts the tokens
produced inside it over its length (decode throughput: every generated token, the first one included, as
Helix's "tokens generated per second"; prompt throughput: prompt tokens whose prefill completed), and the
latency figures cover the requests that arrived inside it.

- TTFT: arrival to the first token at the coordinator (scheduler queueing, prefill chunks and links included).
- TPOT: (last token - first token) / (tokens - 1), the mean time between tokens of one request (TBT); the
  longest single gap is `max_tbt`.
- E2E: arrival to the last token. Queue: arrival to the scheduler's admission.
- Helix's latencies, beside ours (`summary["helix_latency"]`): prompt latency, from a request's admission to its
  first token (no scheduler queueing), over the requests whose first token came inside the window; decode
  latency, every gap between two tokens that came inside the window, averaged over those steps (TPOT averages
  per request first, so a short request weighs as much as a long one).
- SLO attainment: the fraction of the window's requests within every given bound (a request that never
  finished, or that the scheduler refused, meets none).
- Requests: `measured` arrived inside the window; of those, `finished`, `rejected` (refused by the scheduler:
  its queue was full, or no pipeline could ever hold it) and `unfinished` (still running or queued when the
  run ended).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

LATENCY_METRICS = ("ttft", "tpot", "e2e", "queue", "kv_wait", "max_tbt")
SLO_METRICS = ("ttft", "tpot", "e2e")


@dataclass(frozen=True, slots=True)
class RequestRecord:
    id: str
    arrival: float
    input_len: int
    output_len: int
    generated: int
    admitted: float  # NaN: never admitted (still queued, or refused)
    first_token: float  # NaN: none yet
    finish: float  # NaN: unfinished
    ttft: float
    tpot: float  # NaN with fewer than two tokens
    e2e: float
    queue: float
    kv_wait: float
    max_tbt: float
    depth: int  # hops of its pipeline
    path: str  # node[first,last)>node[first,last)>...
    measured: bool  # arrived inside the measured window
    rejected: str = ""
    # Phase-split routes: from the prefill phase's first token (sampled) to the decode phase's first step, the KV
    # hand-off's cost on the critical path (NaN on a one-phase route).
    handoff: float = math.nan
    # Tokens whose KV its first phase handed on: the whole context after a whole prefill, Cronus's k after a
    # partial one (the PPI's [0, k)); 0 on a one-phase route.
    kv_handed: int = 0
    # Phase-split routes: when its decode hops' KV was booked (its admission, or its hand-off's start with the
    # scheduler's decode_booking "handoff"); NaN otherwise.
    decode_booked: float = math.nan
    # Times it moved to another route (a node preempted it, had no room for it, or went down).
    moves: int = 0

    @property
    def finished(self) -> bool:
        return not math.isnan(self.finish)


@dataclass(frozen=True, slots=True)
class NodeStats:
    name: str
    device: str
    first_layer: int
    last_layer: int
    utilization: float  # busy fraction of the measured window
    busy_s: float  # over the whole run
    steps: int
    items: int  # items run (an item: one request's tokens in one step)
    mean_batch: float  # items per step
    max_batch: int
    tokens: int  # tokens through the node (prompt and decode)
    prompt_tokens: int
    kv_capacity_blocks: int  # blocks of block_size tokens (each a slot in every layer the node holds)
    kv_peak: float  # fraction of capacity (> 1: decode growth overcommitted it)
    kv_mean: float  # time-averaged fraction of capacity
    kv_waits: int  # prompts that waited for KV memory
    kv_wait_s: float
    layer_ranges: int  # distinct layer ranges its requests ran (> 1 with partial inference)

    @property
    def layers(self) -> int:
        return self.last_layer - self.first_layer


@dataclass(frozen=True, slots=True)
class LinkStats:
    name: str  # "a->b"
    src: str
    dst: str
    bandwidth_mbps: float  # inf: unlimited
    latency_ms: float
    utilization: float  # transmitting fraction of the measured window
    messages: int
    items: int
    bytes: float
    queued_messages: int  # messages that found the link busy
    mean_queue_s: float  # per message
    max_queue_s: float
    mean_item_queue_s: float  # per item
    prompt_items: int
    mean_prompt_queue_s: float  # per prompt item (Helix §6.7's "prompt phase requests queue up")


@dataclass(frozen=True)
class TimeSeries:
    bin_s: float
    decode_tokens_per_s: tuple[float, ...]
    prompt_tokens_per_s: tuple[float, ...]
    node_utilization: Mapping[str, tuple[float, ...]] = field(default_factory=dict, hash=False)

    @property
    def times(self) -> tuple[float, ...]:
        """Start of each bin."""
        return tuple(i * self.bin_s for i in range(len(self.decode_tokens_per_s)))


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    xs = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    if xs.size == 0:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    p50, p90, p99 = np.percentile(xs, [50, 90, 99])
    return {"count": int(xs.size), "mean": float(xs.mean()), "p50": float(p50), "p90": float(p90),
            "p99": float(p99), "max": float(xs.max())}


def step_percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50 and p95 as Helix's simulator reports its latencies (p95 rather than p90/p99)."""
    xs = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    if xs.size == 0:
        return {"count": 0, "mean": None, "p50": None, "p95": None}
    p50, p95 = np.percentile(xs, [50, 95])
    return {"count": int(xs.size), "mean": float(xs.mean()), "p50": float(p50), "p95": float(p95)}


def slo_attainment(records: Iterable[RequestRecord], slos: Mapping[str, float]) -> dict[str, float | None]:
    """Per bound and for all at once, the fraction of requests within it (NaN TPOT meets any bound)."""
    for key in slos:
        if key not in SLO_METRICS:
            raise ValueError(f"unknown SLO metric {key!r}; known: {', '.join(SLO_METRICS)}")
    rs = list(records)
    if not rs or not slos:
        return {}
    ok_all = 0
    ok = dict.fromkeys(slos, 0)
    for r in rs:
        every = True
        for key, bound in slos.items():
            value = getattr(r, key)
            good = r.finished and (math.isnan(value) or value <= bound)
            ok[key] += good
            every = every and good
        ok_all += every
    out: dict[str, float | None] = {k: v / len(rs) for k, v in ok.items()}
    out["all"] = ok_all / len(rs)
    return out


@dataclass
class SimResult:
    """Everything one `simulate` run measured."""

    config: dict[str, Any]
    summary: dict[str, Any]
    requests: list[RequestRecord]
    nodes: list[NodeStats]
    links: list[LinkStats]
    timeseries: TimeSeries
    wall_s: float = 0.0
    events: int = 0
    sim_end_s: float = 0.0

    def to_json(self, *, requests: bool = False) -> dict[str, Any]:
        """A JSON-ready dict (non-finite numbers become null); per-request rows only when asked."""
        out: dict[str, Any] = {
            "config": self.config, "summary": self.summary,
            "run": {"wall_s": self.wall_s, "events": self.events, "sim_end_s": self.sim_end_s,
                    "requests_per_wall_s": len(self.requests) / self.wall_s if self.wall_s > 0 else None},
            "nodes": [_row(n) for n in self.nodes],
            "links": [_row(link) for link in self.links],
            "timeseries": {"bin_s": self.timeseries.bin_s,
                           "decode_tokens_per_s": list(self.timeseries.decode_tokens_per_s),
                           "prompt_tokens_per_s": list(self.timeseries.prompt_tokens_per_s),
                           "node_utilization": {k: list(v) for k, v in self.timeseries.node_utilization.items()}},
        }
        if requests:
            out["requests"] = [_row(r) for r in self.requests]
        finite: dict[str, Any] = _finite(out)
        return finite

    def dumps(self, *, requests: bool = False) -> str:
        return json.dumps(self.to_json(requests=requests), indent=2, allow_nan=False)

    def to_csv(self, directory: str | Path) -> list[Path]:
        """requests.csv, nodes.csv, links.csv and timeseries.csv in `directory` (created); the paths written."""
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        written = [
            _write_csv(folder / "requests.csv", RequestRecord, self.requests),
            _write_csv(folder / "nodes.csv", NodeStats, self.nodes),
            _write_csv(folder / "links.csv", LinkStats, self.links),
        ]
        ts = self.timeseries
        path = folder / "timeseries.csv"
        names = list(ts.node_utilization)
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["time_s", "decode_tokens_per_s", "prompt_tokens_per_s", *(f"util:{n}" for n in names)])
            for i, t in enumerate(ts.times):
                w.writerow([t, ts.decode_tokens_per_s[i], ts.prompt_tokens_per_s[i],
                            *(ts.node_utilization[n][i] for n in names)])
        written.append(path)
        return written


def _row(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _write_csv(path: Path, cls: Any, rows: Sequence[Any]) -> Path:
    names = [f.name for f in fields(cls)]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(names)
        for row in rows:
            w.writerow(["" if isinstance(v, float) and math.isnan(v) else v for v in (getattr(row, n) for n in names)])
    return path
