#!/usr/bin/env python3
"""`hetnode sim --like helix` against Helix's own simulator, on Helix's single cluster and placement.

Runs Helix's placement for its single cluster (`helix_single_70b_ilp_plan.json`: 4 A100, 8 L4, 12 T4; LLaMA-2
70B) on the Azure conversation trace with the "helix" settings (hetnode/testnet/sim/settings.py), offline (60 s
warm-up, 600 s measured) and online (about 0.72 requests/s for 1,800 s from Helix's own generator,
`workload.sampled`: 3 s bins of the trace's rate and its requests' lengths drawn at random), and
prints each figure beside the one Helix's simulator reports for the same setup (the data folder's README), with
their ratio and whether it is within the tolerance (5%). `--like hetnode` runs the simulator's own defaults
instead, for comparison. `--offline-lengths order|drawn` and `--offline-delay S` override the offline loop's
lengths (the trace's requests in order, or drawn at random as Helix's feeder draws them) and its delay (Helix's
feeder issues each request 0.1 s after the event that adds it); "helix" has both of Helix's (docs/simulator.md
measures each). `--offline-option FIELD=JSON` sets one more `SimOptions` field for the offline run (e.g.
`queue_limit=0`: the scheduler refuses what it cannot place now, as Helix's offline scheduler drops it), for
measuring one difference at a time.

    .venv/bin/python scripts/validate_sim_helix.py [--data ../shared/data/helix-profiles] [--json OUT]
        [--seed S] [--offline-lengths order|drawn] [--offline-delay S] [--offline-option FIELD=JSON ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from hetnode.errors import ConfigError
from hetnode.planner.cluster import load_cluster
from hetnode.planner.model import model_spec
from hetnode.planner.plan import PlacementPlan
from hetnode.planner.profile_sources import profile_table_for
from hetnode.testnet.sim import load_trace, offline, sampled, simulate
from hetnode.testnet.sim.offline_loop import LENGTHS, OfflineLoop
from hetnode.testnet.sim.settings import LIKES, options_like

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "hetnode" / "testnet" / "clusters" / "helix-single.toml"
PLAN_FILE = "helix_single_70b_ilp_plan.json"
TOLERANCE = 0.05
ONLINE_RATE = 0.72  # requests/s (the data README)
# Helix's simulator on this placement (the data folder's README): (mode, figure) -> value.
REFERENCE: dict[tuple[str, str], float] = {
    ("offline", "decode throughput (tokens/s)"): 252.1,
    ("offline", "prompt latency mean (s)"): 2.96,
    ("offline", "decode latency/step mean (s)"): 1.45,
    ("offline", "decode latency/step p50 (s)"): 1.15,
    ("offline", "decode latency/step p95 (s)"): 3.17,
    ("online", "decode throughput (tokens/s)"): 141.6,
    ("online", "prompt latency p50 (s)"): 2.64,
    ("online", "decode latency/step p50 (s)"): 0.98,
    ("online", "decode latency/step p95 (s)"): 3.19,
}


def figures(summary: dict[str, Any]) -> dict[str, float]:
    """Our figures under the names REFERENCE uses (Helix's averages: helix_latency in the summary)."""
    prompt, step = summary["helix_latency"]["prompt"], summary["helix_latency"]["decode_step"]
    return {
        "decode throughput (tokens/s)": summary["decode_throughput"],
        "prompt latency mean (s)": prompt["mean"], "prompt latency p50 (s)": prompt["p50"],
        "decode latency/step mean (s)": step["mean"], "decode latency/step p50 (s)": step["p50"],
        "decode latency/step p95 (s)": step["p95"],
    }


def run(data: Path, like: str, seed: int, lengths: str | None = None,
        offline_more: dict[str, Any] | None = None, delay_s: float | None = None) -> dict[str, dict[str, float]]:
    plan_path = data / PLAN_FILE
    try:
        plan = PlacementPlan.from_json(json.loads(plan_path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot read Helix's plan: {exc}", file=str(plan_path)) from exc
    cluster = load_cluster(CLUSTER)
    model = model_spec("llama-70b")
    profiles = profile_table_for(cluster, model, "helix")
    trace = load_trace("conv")
    out: dict[str, dict[str, float]] = {}
    for mode in ("offline", "online"):
        is_offline = mode == "offline"
        options = options_like(like, offline=is_offline, **((offline_more or {}) if is_offline else {}))
        if is_offline and lengths is not None:
            options = replace(options, offline_loop=replace(options.offline_loop or OfflineLoop(), lengths=lengths))
        if is_offline and delay_s is not None:
            options = replace(options, offline_loop=replace(options.offline_loop or OfflineLoop(), delay_s=delay_s))
        if is_offline:
            workload, duration, warmup = offline(trace), 660.0, 60.0
        else:
            # Helix's own generator (whatever the settings: it is the experiment's input, not the simulator's)
            workload = sampled(trace, rate=ONLINE_RATE, duration_s=1800.0, seed=seed)
            duration, warmup = 1800.0, 30.0
        result = simulate(cluster, model, profiles, plan, workload=workload, duration_s=duration, warmup_s=warmup,
                          seed=seed, options=options)
        out[mode] = figures(result.summary)
        print(f"{mode}: {result.config['workload_description']}; {result.wall_s:.1f} s wall", file=sys.stderr)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "helix-profiles",
                   help="the folder holding helix_single_70b_ilp_plan.json (default: ../shared/data/helix-profiles)")
    p.add_argument("--like", default="helix", choices=LIKES, help="the simulator's settings (default: helix)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--offline-lengths", choices=LENGTHS, default=None,
                   help="offline: the trace's requests in order, or drawn at random (default: the settings')")
    p.add_argument("--offline-delay", type=float, default=None, metavar="S",
                   help="offline: seconds from the event that adds a request to its arrival, and between the first "
                        "ones (Helix's feeder: 0.1; default: the settings')")
    p.add_argument("--offline-option", action="append", default=[], metavar="FIELD=JSON",
                   help="offline: also set this SimOptions field (a JSON value), e.g. queue_limit=0")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args()
    try:
        more = {}
        for item in args.offline_option:
            name, _, value = item.partition("=")
            more[name] = json.loads(value)
    except ValueError as exc:
        p.error(f"--offline-option takes FIELD=JSON: {exc}")
    try:
        ours = run(args.data, args.like, args.seed, args.offline_lengths, more, args.offline_delay)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    misses = 0
    rows = []
    print(f"{'mode':<8} {'figure':<30} {'Helix':>8} {'ours':>8} {'ratio':>7}")
    for (mode, name), ref in REFERENCE.items():
        value = ours[mode][name]
        ratio = value / ref
        ok = abs(ratio - 1) <= TOLERANCE
        misses += not ok
        rows.append({"mode": mode, "figure": name, "helix": ref, "ours": value, "ratio": ratio, "within": ok})
        print(f"{mode:<8} {name:<30} {ref:>8.2f} {value:>8.2f} {ratio:>7.2f} {'' if ok else '  outside 5%'}")
    print(f"{len(REFERENCE) - misses} of {len(REFERENCE)} within {TOLERANCE:.0%} (settings: {args.like}"
          f"{'' if args.offline_lengths is None else ', offline lengths ' + args.offline_lengths}"
          f"{'' if args.offline_delay is None else f', offline delay {args.offline_delay:g} s'}"
          f"{''.join(', offline ' + o for o in args.offline_option)})")
    if args.json:
        args.json.write_text(json.dumps({"like": args.like, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
