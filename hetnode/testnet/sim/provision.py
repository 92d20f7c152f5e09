"""Splitwise's provisioning (§IV-D): how many prompt and token machines of given types a load needs.

A design is a number of prompt machines of one type and of token machines of another (Splitwise-HA: DGX-H100
prompt machines and DGX-A100 token machines; AA, HH likewise), each machine one whole-model replica, all on one
InfiniBand fabric (200 Gb/s per DGX-A100 and 400 per DGX-H100; a pair talks at the slower one's). Each design is
simulated serving the target load (the runtime's own scheduler, Splitwise's pools by default, and its KV
hand-offs) and judged by Splitwise's nine SLOs (Table VI): the p50, p90 and p99 of each request's TTFT, TBT and
E2E latency as a slowdown against the same request alone on a DGX-A100 (2x/3x/6x for TTFT, 1.25x/1.5x/5x for
TBT and E2E). A request's TBT here is its mean time per output token after the first.

Two searches, both assuming that more machines never make a design worse and a lighter load never makes one
miss (true of this model, and what lets them bisect):

- At a target load (`search`, goals "cost" and "power"): for each number of prompt machines, the fewest token
  machines that meet every SLO, by bisection, then the design that meets them at the least cost or power
  (Splitwise's iso-throughput designs, Fig. 12).
- Under a budget (`search_throughput`, goal "throughput"): for each number of prompt machines, the most token
  machines the budget (cost or power) allows; for each such design the highest Poisson rate at which it meets
  every SLO, by bisection over the rate; then the design with the highest (Splitwise's iso-power and iso-cost
  throughput-optimized designs, Figs. 16-18).

Costs are Splitwise's Table I ($17.6/hour a DGX-A100, $38/hour a DGX-H100, capped or not: the ratio, 2.16x, is
the one its simulator's iso-cost clusters use); provisioned power is Table V's (a DGX-H100 1.75x a DGX-A100, one
whose GPUs are capped at 50% of their power 1.23x: Splitwise-HHcap's token machines, `8xh100-pcap`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

from hetnode.errors import ConfigError
from hetnode.planner.cluster import ClusterSpec, parse_cluster
from hetnode.planner.model import ModelSpec
from hetnode.planner.plan import NodePlacement, PlacementPlan, Replica
from hetnode.planner.profile import DeviceProfile, ProfileTable
from hetnode.testnet.sim.runner import SimOptions, simulate
from hetnode.testnet.sim.workload import Workload


@dataclass(frozen=True)
class Machine:
    device: str
    cost_per_hour: float  # dollars
    power: float  # provisioned, relative to a DGX-A100
    interconnect_gbps: float  # its InfiniBand
    # Its GPUs' NVLink, one direction (what a roofline profile's tensor-parallel all-reduces run over, where no
    # measured profile covers the model): NVIDIA's A100 and H100 data sheets, 600 and 900 GB/s bidirectional.
    nvlink_gbps: float


MACHINES = {
    "8xa100-80g": Machine("8xa100-80g", 17.6, 1.0, 200.0, 300.0),  # DGX-A100: Splitwise Tables I and V
    "8xh100": Machine("8xh100", 38.0, 1.75, 400.0, 450.0),  # DGX-H100
    "8xh100-pcap": Machine("8xh100-pcap", 38.0, 1.23, 400.0, 450.0),  # DGX-H100, each GPU capped at 50% power
}
GOALS = ("cost", "power", "throughput")
REFERENCE = "8xa100-80g"  # the SLOs are slowdowns against a request alone on this machine
# Splitwise Table VI: the largest slowdown allowed at p50, p90, p99.
SLOS: Mapping[str, tuple[float, float, float]] = {"ttft": (2.0, 3.0, 6.0), "tbt": (1.25, 1.5, 5.0),
                                                  "e2e": (1.25, 1.5, 5.0)}
PERCENTILES = (50, 90, 99)  # (the order of every triple here)


@dataclass(frozen=True)
class Design:
    prompt: int
    token: int
    cost_per_hour: float
    power: float
    slowdowns: Mapping[str, tuple[float, float, float]] = field(default_factory=dict)  # metric -> p50, p90, p99
    finished: int = 0
    arrived: int = 0
    rate: float = 0.0  # the load it was simulated at, requests/s (the goal "throughput": the most it meets)

    @property
    def meets(self) -> bool:
        """Every SLO met, and every request that arrived finished (a design that cannot keep up leaves some)."""
        return bool(self.slowdowns) and self.finished == self.arrived and all(
            got <= limit for metric, limits in SLOS.items()
            for got, limit in zip(self.slowdowns[metric], limits, strict=True))

    @property
    def tightest(self) -> float:
        """The largest share of an SLO's limit that its slowdown uses (at most 1 when every SLO is met; inf when
        not simulated): between designs of the same cost, the lower one has the more headroom."""
        if not self.slowdowns:
            return math.inf
        return max(got / limit for metric, limits in SLOS.items()
                   for got, limit in zip(self.slowdowns[metric], limits, strict=True))

    @property
    def worst(self) -> str:
        """The SLO furthest over its limit ('' when all are met)."""
        if not self.slowdowns:
            return "not simulated"
        over = [(got / limit, f"{metric} p{p} {got:.2f}x > {limit:g}x")
                for metric, limits in SLOS.items()
                for p, got, limit in zip(PERCENTILES, self.slowdowns[metric], limits, strict=True) if got > limit]
        if self.finished < self.arrived:
            return f"{self.arrived - self.finished} of {self.arrived} requests unfinished"
        return max(over)[1] if over else ""


def design_cluster(prompt_machine: str, token_machine: str, prompt: int, token: int,
                   model: ModelSpec) -> tuple[ClusterSpec, PlacementPlan]:
    """The cluster and phase-split plan of a design: machines p0.. prefill, t0.. decode, each the whole model.

    `token` 0 is Splitwise's baseline instead (Baseline-A100, Baseline-H100): `prompt` machines that each run
    both phases with mixed batching, no phase split, requests spread by join-the-shortest-queue."""
    for name in (prompt_machine, token_machine):
        if name not in MACHINES:
            raise ConfigError(f"no cost and power known for machine {name!r}; known: {', '.join(MACHINES)}",
                              key="--prompt-machine" if name == prompt_machine else "--token-machine")
    if prompt < 1 or token < 0:
        raise ConfigError(f"a design needs at least one prompt and one token machine, not {prompt} and {token}")
    names = [(f"p{i}", prompt_machine) for i in range(prompt)] + [(f"t{i}", token_machine) for i in range(token)]
    gbps = min(MACHINES[prompt_machine].interconnect_gbps, MACHINES[token_machine].interconnect_gbps)
    cluster = parse_cluster({
        "name": f"splitwise-{prompt}x{prompt_machine}-{token}x{token_machine}",
        "coordinator": {"region": "dc"},
        "nodes": [{"name": n, "device": d, "region": "dc",
                   "gpu_link": {"bandwidth_mbps": MACHINES[d].nvlink_gbps * 8000, "latency_ms": 0.005}}
                  for n, d in names],
        "links": {"default": {"bandwidth_mbps": gbps * 1000, "latency_ms": 0.005}},
    }, "provisioning design")
    layers = model.num_layers
    replicas = tuple(Replica("prefill" if n.startswith("p") else "decode", (n,)) for n, _ in names) if token else ()
    plan = PlacementPlan(cluster=cluster.name, model=model.name, num_layers=layers,
                         method="split" if token else "sp",
                         placements=tuple(NodePlacement(n, 0, layers) for n, _ in names), replicas=replicas,
                         partial_inference=False)
    return cluster, plan


def alone(profile: DeviceProfile, layers: int, input_len: int, output_len: int) -> tuple[float, float, float]:
    """TTFT, TBT and E2E of a request alone on a machine of `profile` (the SLOs' reference)."""
    ttft = profile.prefill_time(input_len, layers)
    tbt = profile.decode_time(1, layers, input_len + output_len // 2)
    return ttft, tbt, ttft + max(0, output_len - 1) * tbt


def decode_batch_for(profiles: ProfileTable, machine: str, model: ModelSpec, context: float) -> int:
    """The largest decode batch a `machine` steps through within the p50 TBT SLO (a slowdown against one request
    alone on the reference machine at the same `context`): the queue past which Splitwise's pools lend."""
    alone_s = profiles.profiles[REFERENCE].decode_time(1, model.num_layers, int(context))
    profile = profiles.profiles[machine]
    limit = SLOS["tbt"][0] * alone_s
    batch = 1
    while batch < 4096 and profile.decode_time(batch + 1, model.num_layers, int(context)) <= limit:
        batch += 1
    return batch


def evaluate(prompt_machine: str, token_machine: str, prompt: int, token: int, *, model: ModelSpec,
             profiles: ProfileTable, workload: Workload, duration_s: float, warmup_s: float,
             scheduler: str = "splitwise", options: SimOptions | None = None, rate: float = 0.0) -> Design:
    """One design serving `workload` (whose Poisson rate, `rate`, the design records). A baseline (`token` 0)
    is routed by join-the-shortest-queue whatever `scheduler` says (it has no pools)."""
    cluster, plan = design_cluster(prompt_machine, token_machine, prompt, token, model)
    if not token:
        scheduler = "shortest-queue"
    result = simulate(cluster, model, profiles, plan, workload=workload, scheduler=scheduler, duration_s=duration_s,
                      warmup_s=warmup_s, options=options)
    reference = profiles.profiles[REFERENCE]
    slow: dict[str, list[float]] = {"ttft": [], "tbt": [], "e2e": []}
    measured = [r for r in result.requests if r.measured]
    finished = [r for r in measured if math.isfinite(r.e2e)]
    for r in finished:
        ttft, tbt, e2e = alone(reference, model.num_layers, r.input_len, r.output_len)
        slow["ttft"].append(r.ttft / ttft)
        slow["e2e"].append(r.e2e / e2e)
        if math.isfinite(r.tpot):
            slow["tbt"].append(r.tpot / tbt)
    cost, power = price(prompt_machine, token_machine, prompt, token)
    slowdowns = {m: (_percentile(v, 50), _percentile(v, 90), _percentile(v, 99)) for m, v in slow.items()}
    return Design(prompt, token, cost, power, slowdowns, len(finished), len(measured), rate)


def price(prompt_machine: str, token_machine: str, prompt: int, token: int) -> tuple[float, float]:
    """Dollars per hour and provisioned power (in DGX-A100s) of a design."""
    p, t = MACHINES[prompt_machine], MACHINES[token_machine]
    return prompt * p.cost_per_hour + token * t.cost_per_hour, prompt * p.power + token * t.power


def _percentile(values: Sequence[float], p: float) -> float:
    if not values:
        return math.inf
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


Evaluate = Callable[[int, int], Design]


def search(evaluate_design: Evaluate, *, max_prompt: int, max_token: int, goal: str = "cost",
           ) -> tuple[Design | None, list[Design]]:
    """The design that meets every SLO at the least `goal` ("cost" or "power"), the one with the most headroom of
    those (`Design.tightest`), and every design evaluated.

    For each number of prompt machines, the fewest token machines that meet the SLOs, by bisection over
    [1, max_token]; a prompt count that misses even with max_token token machines is skipped."""
    if goal not in ("cost", "power"):
        raise ConfigError(f"the goal at a target load must be cost or power, not {goal!r}", key="--goal")
    if max_prompt < 1 or max_token < 1:
        raise ConfigError(f"the search needs at least one machine of each kind, not {max_prompt} and {max_token}")
    seen: dict[tuple[int, int], Design] = {}

    def at(p: int, t: int) -> Design:
        if (p, t) not in seen:
            seen[(p, t)] = evaluate_design(p, t)
        return seen[(p, t)]

    best: Design | None = None
    for p in range(1, max_prompt + 1):
        if not at(p, max_token).meets:
            continue
        lo, hi = 1, max_token  # hi meets
        while lo < hi:
            mid = (lo + hi) // 2
            if at(p, mid).meets:
                hi = mid
            else:
                lo = mid + 1
        found = at(p, hi)
        if best is None or _rank(found, goal) < _rank(best, goal):
            best = found
    return best, sorted(seen.values(), key=lambda d: (d.prompt, d.token))


def _rank(design: Design, goal: str) -> tuple[float, float]:
    """The least cost (or power), then the most headroom: machines of one price tie often (4 prompt and 2 token
    H100s cost what 5 and 1 do), and the bisection's first find is no better a choice than any other."""
    return (design.cost_per_hour if goal == "cost" else design.power, design.tightest)


EvaluateAt = Callable[[int, int, float], Design]  # prompt machines, token machines, requests/s


def search_throughput(evaluate_design: EvaluateAt, *, prompt_machine: str, token_machine: str, budget: float,
                      of: str, max_prompt: int, max_token: int, max_rate: float, resolution: float,
                      ) -> tuple[Design | None, list[Design]]:
    """The design of at most `budget` cost or power (`of`) that meets every SLO at the highest rate, and, for each
    design considered, its best (its `rate` the highest met; 0 and the slowdowns at `resolution` when none is).

    The designs considered are the largest the budget allows: for each number of prompt machines the most token
    machines that fit (fewer never serve more). Each one's rate is bisected over [resolution, max_rate] to
    within `resolution` requests/s."""
    if of not in ("cost", "power"):
        raise ConfigError(f"a budget is of cost or power, not {of!r}")
    if not budget > 0 or not max_rate > 0 or not 0 < resolution <= max_rate:
        raise ConfigError(f"need budget > 0 ({budget}), max_rate > 0 ({max_rate}) and 0 < resolution <= max_rate "
                          f"({resolution})")
    if max_prompt < 1 or max_token < 1:
        raise ConfigError(f"the search needs at least one machine of each kind, not {max_prompt} and {max_token}")
    k = 0 if of == "cost" else 1
    candidates: list[tuple[int, int]] = []
    for p in range(1, max_prompt + 1):
        fits = [t for t in range(1, max_token + 1) if price(prompt_machine, token_machine, p, t)[k] <= budget]
        if fits:
            candidates.append((p, max(fits)))
    if not candidates:
        cheapest = price(prompt_machine, token_machine, 1, 1)[k]
        raise ConfigError(f"no design fits a {of} budget of {budget:g}: one prompt and one token machine take "
                          f"{cheapest:g}", key=f"--budget-{of}")
    best: Design | None = None
    out: list[Design] = []
    for p, t in candidates:
        found = _highest_rate(partial(evaluate_design, p, t), max_rate, resolution)
        out.append(found)
        if found.meets and (best is None or found.rate > best.rate):
            best = found
    return best, out


def _highest_rate(at: Callable[[float], Design], max_rate: float, resolution: float) -> Design:
    """The design at the highest rate in [resolution, max_rate] that it meets (on a grid of `resolution`), or
    as it fares at `resolution` when it meets none."""
    lowest = at(resolution)
    if not lowest.meets:
        return lowest
    top = at(max_rate)
    if top.meets:
        return top
    lo, hi = 1, max(1, int(max_rate / resolution))  # lo meets, hi misses (in steps of resolution)
    met = lowest
    while hi - lo > 1:
        mid = (lo + hi) // 2
        d = at(mid * resolution)
        if d.meets:
            lo, met = mid, d
        else:
            hi = mid
    return met


def picture(designs: Sequence[Design], best: Design | None, *, title: str) -> str:
    """The search space as an SVG grid (Splitwise Fig. 12): prompt machines across, token machines up, each
    evaluated design a cell, green where it meets every SLO, with its cost (or, from a throughput search, the
    highest rate it meets); the chosen design starred."""
    if not designs:
        raise ValueError("nothing to draw")
    by_rate = len({d.rate for d in designs}) > 1  # a throughput search: each cell's own highest rate
    cols = max(d.prompt for d in designs)
    rows = max(d.token for d in designs)
    cell, left, top = 34, 60, 40
    width, height = left + cols * cell + 20, top + rows * cell + 50
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="9">', f'<text x="{left}" y="20" font-size="12">{_xml(title)}</text>']
    for d in designs:
        x = left + (d.prompt - 1) * cell
        y = top + (rows - d.token) * cell
        fill = "#7fc97f" if d.meets else "#f0f0f0"
        out.append(f'<rect x="{x}" y="{y}" width="{cell - 2}" height="{cell - 2}" fill="{fill}" stroke="#999">'
                   f'<title>{d.prompt} prompt, {d.token} token: ${d.cost_per_hour:.0f}/h, power {d.power:g}; '
                   f'{_xml(d.worst or "meets every SLO")}</title></rect>')
        label = f"{d.rate:.3g}/s" if by_rate else f"${d.cost_per_hour:.0f}"
        out.append(f'<text x="{x + 3}" y="{y + 19}">{label}</text>')
        if best is not None and (d.prompt, d.token) == (best.prompt, best.token):
            out.append(f'<text x="{x + 22}" y="{y + 10}" font-size="12">*</text>')
    for i in range(cols):
        out.append(f'<text x="{left + i * cell + 10}" y="{top + rows * cell + 14}">{i + 1}</text>')
    for j in range(rows):
        out.append(f'<text x="{left - 16}" y="{top + (rows - j - 1) * cell + 19}">{j + 1}</text>')
    out.append(f'<text x="{left}" y="{height - 8}">prompt machines (across), token machines (up); green: every '
               f'SLO met{" (at the rate shown)" if by_rate else ""}; *: the chosen design</text>')
    out.append("</svg>")
    return "\n".join(out)


def _xml(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
