#!/usr/bin/env python
"""Where ThunderServe's planner and the simulator disagree, per replica and phase (issue 14).

For the plan `reproduce_thunderserve.py` makes of each traffic (thunderserve-cloud-gpus, LLaMA-30B, planned at
4 requests/s, and routed for a saturating run as it routes one: by the TSTP solved at what the planner expects the
plan to sustain), prints each replica's capacity as the planner has it (prefill: prompts/s, the mu_i of the TSTP
LP; decode: requests/s its KV sustains at its batch, nu_j over the residency ratio of the pairs the orchestration
sends it; and the decode batch it assumes) beside what the simulator sustains
for it in a saturating (offline) run: the requests the replica served per second (the run's throughput in
the orchestration's shares) divided by the busy share of
its busiest stage (a replica whose busiest stage is busy b of the time while serving r requests/s sustains
r / b), the decode stages' mean and largest batch, and how long a decode replica's KV holds a request (the
planner: prefill, hand-off and output_len x TPOT, `slo.decode_residency`; the simulator: admission to last
token, as the scheduler books it at admission; with --decode-booking handoff, from its hand-off's start), each
node's
busy share and KV use, and the busiest links. Before the simulation, the planner's own view at the planned rate
(`planner_view`: each prefill replica's share within the TTFT SLO at its load, each decode replica's TPOT at its
load against the TPOT SLO, the weights' share of its memory) and its estimated attainment of the plan at the
planned and the sustained rate, under the SLOs planned for and twice as loose (`planner_scores`).
--deployment appendix-f diagnoses the paper's own deployment (Appendix F) in place of our planner's.

    .venv/bin/python scripts/diagnose_thunderserve_phases.py [--duration 120] [--traffic code conv]
        [--deployment ours|appendix-f]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from reproduce_thunderserve import DEPLOYMENTS, Lab, add_decode_booking, add_prefill_tokens, cluster, thunderserve_plan

from hetnode.planner.cluster import ClusterSpec
from hetnode.planner.plan import PlacementPlan
from hetnode.planner.thunderserve.gpus import GpuPool
from hetnode.planner.thunderserve.parallel import Layout, Performance, performance
from hetnode.planner.thunderserve.reschedule import kept_groups, reschedule, sustained_rate
from hetnode.planner.thunderserve.settings import ThunderServeOptions
from hetnode.planner.thunderserve.slo import decode_residency, decode_tpot, kv_handoff, slo_for, waits_within


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=120.0)
    parser.add_argument("--traffic", nargs="+", default=["code", "conv"], choices=["code", "conv"])
    parser.add_argument("--seed", type=int, default=0)
    add_prefill_tokens(parser)
    add_decode_booking(parser)
    parser.add_argument("--deployment", choices=DEPLOYMENTS, default="ours",
                        help="our planner's plan (default) or the paper's own (Appendix F's)")
    args = parser.parse_args(argv)
    lab = Lab(args.duration, min(60.0, args.duration / 5), args.seed, prefill_tokens=args.prefill_tokens or None,
              decode_booking=args.decode_booking)
    cloud = cluster("thunderserve-cloud-gpus")
    for traffic in args.traffic:
        opts = lab.ts_options(traffic)
        plan = thunderserve_plan(lab, cloud, opts, traffic, args.deployment)
        pool, layouts = replica_layouts(plan, cloud, lab, opts)
        planner_view(pool, layouts, plan, lab, opts)
        planner_scores(cloud, plan, lab, opts)
        # Routed as reproduce_thunderserve routes a saturating run: by the TSTP solved at what the plan sustains.
        plan, _ = lab.routed_for(plan, cloud, opts, None)
        result = lab.run(f"thunderserve {traffic}", cloud, plan, traffic, None, opts.kv_reserve)
        stats = {n.name: n for n in result.nodes}
        total = result.summary["request_throughput"]
        orch = plan.orchestration
        assert orch is not None
        print(f"\n{traffic}: planned for {opts.traffic}")
        print(f"{traffic}: {result.summary['request_throughput']:.2f} requests/s offline "
              f"({args.duration:.0f} s, warm-up {lab.warmup_s:.0f} s)")
        done = [q for q in result.requests if q.measured and q.finished and math.isfinite(q.admitted)]
        # A decode replica's KV holds a request from its booking (admission, or the hand-off's start with
        # --decode-booking handoff) to its last token; the planner's from admission (the prefill, the hand-off
        # and output_len x TPOT at its batch).
        held = statistics.fmean(q.finish - q.decode_booked for q in done) if done else math.nan
        print(f"{'replica':10} {'stages':>6} {'planner /s':>10} {'batch':>6}   {'sim served /s':>13} "
              f"{'busiest':>8} {'sim sustains /s':>15} {'sim/planner':>11} {'sim batch mean/max':>18} "
              f"{'KV held s planner/sim':>22}")
        # The planner's residency of a request on decode replica j (prefill on i, hand-off, decode: `slo.
        # decode_residency`), averaged over the pairs in the orchestration's shares X_i Y_ij.
        held_planned: list[float] = []
        for j, (dlay, dperf) in enumerate(layouts["decode"]):
            pairs = [(x * y[j], decode_residency(pperf, kv_handoff(pool, play, dlay, lab.model, opts).seconds, dperf,
                                                 opts.traffic.output_len, opts.decode_booking))
                     for (play, pperf), x, y in zip(layouts["prefill"], orch.prefill_share, orch.decode_share,
                                                    strict=True)]
            weight = sum(w for w, _ in pairs)
            ratio = sum(w * v for w, v in pairs) / weight if weight > 0 else min(v for _, v in pairs)
            held_planned.append(ratio)
        counts = Counter[str]()
        for r in plan.replicas:
            k = counts[r.role]
            counts[r.role] += 1
            cells = [r.nodes[s:s + r.tp] for s in range(0, len(r.nodes), r.tp)]
            perf = layouts[r.role][k][1]
            est = perf.prefill_rate if r.role == "prefill" else perf.decode_rate / held_planned[k]
            leads = [cell[0] for cell in cells]
            busiest = max(stats[n].utilization for n in leads)
            # served by this replica: the run's completions in the orchestration's shares (X_i; sum_i X_i Y_ij)
            share = (orch.prefill_share[k] if r.role == "prefill"
                     else sum(x * y[k] for x, y in zip(orch.prefill_share, orch.decode_share, strict=True)))
            rate = total * share / sum(orch.prefill_share)
            sustains = rate / busiest if busiest > 0 else float("nan")
            batch = (f"{max(stats[n].mean_batch for n in leads):.1f}/{max(stats[n].max_batch for n in leads)}"
                     if r.role == "decode" else "")
            decode_s = perf.tpot[-1][1] * opts.traffic.output_len
            kv_held = (f"{decode_s * held_planned[k]:.1f}/{held:.1f}" if r.role == "decode" else "")
            print(f"{r.role[0]}{k:<9} {len(cells):>6} {est:>10.2f} "
                  f"{perf.max_batch if r.role == 'decode' else '':>6}   {rate:>13.2f} {busiest:>8.0%} "
                  f"{sustains:>15.2f} {sustains / est if est else float('nan'):>11.2f} {batch:>18} {kv_held:>22}")
        # Where the decode KV's hold goes: the prefill phase (admission to first token: the queue at the prefill
        # pipeline, its steps and hops), the hand-off, the decode; and how many requests hold it at once, booked
        # and decoding (time averages over the measured window). The planner's prefill phase is the prefill
        # replicas' prefill_s (one prompt alone) in the orchestration's shares.
        shares = orch.prefill_share
        planned_prefill = (sum(x * p.prefill_s for x, (_, p) in zip(shares, layouts["prefill"], strict=True))
                           / sum(shares))
        handoffs = [q.handoff for q in done if math.isfinite(q.handoff)]
        starts = [(q.decode_booked, q.first_token + (q.handoff if math.isfinite(q.handoff) else 0.0), q.finish)
                  for q in result.requests if q.finished and math.isfinite(q.decode_booked)]
        if done:
            handoff = statistics.fmean(handoffs) if handoffs else 0.0
            prefill_phase = statistics.fmean(q.first_token - q.admitted for q in done)
            decode_phase = statistics.fmean(q.finish - q.first_token for q in done) - handoff
            window = (lab.warmup_s, args.duration)
            booked = mean_count([(a, f) for a, _, f in starts], window)
            decoding = mean_count([(d, f) for _, d, f in starts], window)
            waits = statistics.fmean(q.decode_booked - q.first_token for q in done)  # < 0: booked before
            print(f"{traffic}: decode KV held {held:.2f} s; prefill phase {prefill_phase:.2f} s (planner "
                  f"{planned_prefill:.2f} s, one prompt alone), booked {waits:+.2f} s after the first token, "
                  f"hand-off {handoff:.3f} s, decode {decode_phase:.2f} s; "
                  f"requests holding it {booked:.1f}, decoding {decoding:.1f} (time means)")
            tpots = [q.tpot for q in done if math.isfinite(q.tpot)]
            if len(layouts["decode"]) == 1 and tpots:  # per replica would need each request's replica
                perf = layouts["decode"][0][1]
                print(f"{traffic}: TPOT sim {statistics.fmean(tpots):.3f} s, planner {perf.tpot_at(decoding):.3f} s "
                      f"at the {decoding:.1f} decoding ({perf.tpot[-1][1]:.3f} s at its batch {perf.max_batch})")
        print("busy: " + ", ".join(f"{n.name} [{n.first_layer},{n.last_layer}) {n.utilization:.0%} "
                                   f"batch {n.mean_batch:.1f}, KV mean {n.kv_mean:.0%} peak {n.kv_peak:.0%}"
                                   for n in result.nodes))
        busiest_links = sorted(result.links, key=lambda x: -x.utilization)[:6]
        print("busiest links: " + ", ".join(f"{x.name} {x.utilization:.0%} (queue mean {x.mean_queue_s:.2f} s)"
                                            for x in busiest_links))
        print("planner: " + "; ".join(plan.notes[:1]))
    return 0


def replica_layouts(plan: PlacementPlan, cloud: ClusterSpec, lab: Lab, opts: ThunderServeOptions
                    ) -> tuple[GpuPool, dict[str, list[tuple[Layout, Performance]]]]:
    """Each replica's layout and the planner's performance of it, by role in the plan's order (`kept_groups`, as
    the rescheduler reads a plan)."""
    kept = kept_groups(plan, cloud)
    layouts: dict[str, list[tuple[Layout, Performance]]] = {"prefill": [], "decode": []}
    for group, layout in kept.groups:
        layouts[group.role].append((layout, performance(kept.pool, layout, lab.model, opts)))
    return kept.pool, layouts


def planner_view(pool: GpuPool, layouts: dict[str, list[tuple[Layout, Performance]]], plan: PlacementPlan,
                 lab: Lab, opts: ThunderServeOptions) -> None:
    """Each replica as the planner prices it at the planned rate, by the terms of its SLO estimate
    (`slo.attainment`): the prefill queue against the TTFT SLO (an M/M/1 wait at the load the orchestration sends
    it: the share of prompts within the TTFT SLO), the decode TPOT at its load against the TPOT SLO, and the
    memory behind the decode batch (the weights' share of the replica's GPUs and the KV room left)."""
    model, orch = lab.model, plan.orchestration
    assert orch is not None
    slo = slo_for(model, opts)
    rate = opts.traffic.rate
    print(f"\nplanner at {rate:g} requests/s: SLOs TTFT {slo.ttft_s:.2f} s, TPOT {slo.tpot_s * 1e3:.0f} ms, E2E "
          f"{slo.e2e_s:.1f} s; estimated attainment {orch.slo_attainment:.1%}")
    print(f"{'replica':8} {'GPUs':>22} {'tp x pp':>7} {'weights/mem':>11} {'load /s':>7} {'prefill s':>9} "
          f"{'rate /s':>7} {'TTFT ok':>7} {'batch':>5} {'TPOT@1 ms':>9} {'TPOT@load ms':>12} {'TPOT@max ms':>11} "
          f"{'decode /s':>9}")
    counts = Counter[str]()
    for r in plan.replicas:
        k = counts[r.role]
        counts[r.role] += 1
        layout, perf = layouts[r.role][k]
        kinds = Counter(pool.gpus[g].kind for g in layout.gpus)
        memory = sum(pool.gpus[g].memory_bytes for g in layout.gpus)
        weights = model.num_layers * model.layer_bytes / memory
        name = "+".join(f"{n}x{kind}" for kind, n in sorted(kinds.items()))
        if r.role == "prefill":
            load = rate * orch.prefill_share[k]
            mu = perf.prefill_rate
            ok = waits_within(mu, load, slo.ttft_s - perf.prefill_s)
            print(f"p{k:<7} {name:>22} {r.tp:>3} x {len(layout.stages):<3} {weights:>11.0%} {load:>7.2f} "
                  f"{perf.prefill_s:>9.2f} {mu:>7.2f} {ok:>7.0%}")
        else:
            load = rate * sum(x * y[k] for x, y in zip(orch.prefill_share, orch.decode_share, strict=True))
            at_load = decode_tpot(perf, load, opts.traffic.output_len)
            print(f"d{k:<7} {name:>22} {r.tp:>3} x {len(layout.stages):<3} {weights:>11.0%} {load:>7.2f} "
                  f"{perf.prefill_s:>9.2f} {perf.prefill_rate:>7.2f} {'':>7} {perf.max_batch:>5} "
                  f"{perf.tpot[0][1] * 1e3:>9.0f} {at_load * 1e3:>12.0f} {perf.tpot[-1][1] * 1e3:>11.0f} "
                  f"{perf.decode_rate:>9.2f}")


def planner_scores(cloud: ClusterSpec, plan: PlacementPlan, lab: Lab, opts: ThunderServeOptions) -> None:
    """The planner's estimated attainment of `plan` as it stands (groups, layouts, phases; the TSTP re-solved,
    `reschedule(..., steps=0)`) at the planned rate and at the rate it expects the plan to sustain, under the
    SLOs planned for and under SLOs twice as loose: whether a looser SLO would change which plan scores higher."""
    cells = []
    for scale in (opts.ttft_scale, 2 * opts.ttft_scale):
        scaled = replace(opts, ttft_scale=scale, tpot_scale=scale * opts.tpot_scale / opts.ttft_scale,
                         e2e_scale=scale * opts.e2e_scale / opts.ttft_scale)
        for rate in (opts.traffic.rate, sustained_rate(plan, cloud, lab.model, scaled)):
            at = replace(scaled, traffic=replace(scaled.traffic, rate=rate))
            solved = reschedule(plan, cloud, lab.model, at, steps=0)
            assert solved.orchestration is not None
            # The share the TSTP can route at all (its capacity and link rows) is in the planner's note.
            routed = next((n.split("; ")[1] for n in solved.notes if n.startswith("estimated SLO attainment")), "")
            cells.append(f"SLO scale {scale:g}, {rate:.2f}/s: {solved.orchestration.slo_attainment:.1%} ({routed})")
    print("planner's estimated attainment: " + "; ".join(cells))


def mean_count(intervals: list[tuple[float, float]], window: tuple[float, float]) -> float:
    """How many of the intervals are open at once, on average over the window."""
    inside = sum(max(0.0, min(b, window[1]) - max(a, window[0])) for a, b in intervals)
    return float(inside / (window[1] - window[0]))


if __name__ == "__main__":
    raise SystemExit(main())
