"""`hetnode sim`: plan a cluster with the runtime's planner, then simulate serving a trace on it.

    hetnode sim --cluster helix-hetero --model llama-70b --method helix --trace conv --duration 1800 --plots out/

The load is `--rate R` requests/s, `--offline` (a saturating closed loop), or by default Helix's online
setting: `--load 0.75` of the peak, in requests of the trace's mean length; the peak is measured by an offline
run of the same plan and scheduler (`--peak measured`) or taken to be the plan's max flow (`--peak maxflow`).
`hetnode.cli` adds the subcommand with `add_arguments` and calls `run`; this module imports nothing heavy
until `run`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hetnode.argtypes import auto_or_count
from hetnode.argtypes import positive as _positive
from hetnode.errors import ConfigError
from hetnode.policy.decode_booking import ADMISSION, DECODE_BOOKINGS
from hetnode.policy.kv_codec import OPERATOR_CHOICES
from hetnode.policy.role_batching import prefill_tokens_of
from hetnode.testnet.sim.padg_cli import PLACEMENTS as PADG_PLACEMENTS
from hetnode.testnet.sim.padg_cli import add_arguments as add_padg_arguments

log = logging.getLogger("hetnode.sim")

SCHEDULER_NAMES = ("iwrr", "random", "shortest-queue", "swarm", "cls", "splitwise", "tstp", "random-pairs")
LIKES = ("hetnode", "helix")  # settings.LIKES; repeated so that the parser need not import the simulator
PAIR_DESIGNS = ("cronus", "dp", "pp", "disagg-hl", "disagg-lh")  # pair_designs.DESIGNS, likewise


def _non_negative(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {value!r}")
    return x


def add_arguments(p: argparse.ArgumentParser, *, clusters: Sequence[str] = ()) -> None:
    p.add_argument("--cluster", required=True, metavar="FILE",
                   help="cluster file (TOML), or a shipped name" + (f": {', '.join(clusters)}" if clusters else ""))
    p.add_argument("--model", required=True, metavar="NAME", help="model preset or a .toml/.json model file")
    p.add_argument("--profile", default="auto", metavar="FILE|roofline|helix|splitwise",
                   help="profile table: Helix's or Splitwise's measured profiles, the roofline cost model, or a "
                        "table file (measured on the live testnet, say); default auto")
    p.add_argument("--method", "--placement", dest="method", default="helix",
                   choices=["helix", "petals", "swarm", "sp", "sp+", "split", "thunderserve", *PAIR_DESIGNS,
                            *PADG_PLACEMENTS],
                   help="placement method of the runtime's planner: helix (MILP), or the baselines petals, swarm, sp "
                        "(separate pipelines), sp+ (plus a mixed pipeline of the rest), or split (prefill and decode "
                        "replicas, sized for the trace's mean prompt and output, routed by cls, KV handed between "
                        "them), or thunderserve (ThunderServe's deployment over the cluster's GPUs, planned for "
                        "the trace's mean lengths at --rate or 4 requests/s, tensor-parallel stages merged, routed "
                        "by its orchestration, tstp); default helix. On a two-GPU cluster: cronus (partially "
                        "disaggregated prefill) and "
                        "Cronus §5's baselines dp, pp, disagg-hl, disagg-lh (pair_designs.py; with --offline or "
                        "--rate, over the trace's first --first); cronus on more nodes pairs weak and strong ones "
                        "and runs in the main simulator (--max-batch-tokens default 512, §5.1's); or an instance "
                        "placement of EcoServe's evaluation "
                        "(padg_cli.py: ecoserve, nodg-vllm, nodg-sarathi, fudg-distserve, fudg-mooncake)")
    p.add_argument("--plan", default=None, metavar="FILE",
                   help="use this plan (JSON from `hetnode plan --json`) instead of planning")
    p.add_argument("--scheduler", default="iwrr", choices=SCHEDULER_NAMES,
                   help="the runtime's request scheduler (default: iwrr, Helix's; a split plan is routed by cls, "
                        "Splitwise's join-the-shortest-queue, or by splitwise, its pools with a mixed one, as the "
                        "coordinator routes it)")
    p.add_argument("--kv-codec", default="auto", choices=list(OPERATOR_CHOICES),
                   help="split plans: the codec of KV hand-offs (default: auto, the cheapest per link, as the "
                        "coordinator picks it)")
    p.add_argument("--kv-transfer", default="policy", choices=["policy", "layerwise", "whole"],
                   help="split plans: as the runtime's hops choose per link (default: KVTransferPolicy, layer by "
                        "layer during the prefill step when the transfer is long enough), or always layer-wise, or "
                        "always whole after the step")
    p.add_argument("--decode-booking", default=ADMISSION, choices=DECODE_BOOKINGS,
                   help="split plans routed by cls, tstp or random-pairs: book the decode replica's KV at admission "
                        "(default, Splitwise's rule and the runtime's), or when the request's hand-off starts, its KV "
                        "waiting on the prefill replica until the decode replica has room (ThunderServe's KV queues)")
    p.add_argument("--trace", default="conv", metavar="conv|code|FILE",
                   help="Azure trace: conv, code (the full trace from ../shared/data or $HETNODE_TRACE_DIR when "
                        "found, else the shipped sample) or a CSV file (default: conv)")
    p.add_argument("--no-length-filter", action="store_true",
                   help="keep requests longer than Helix's filter (input <= 2048, output <= 1024)")
    arrivals = p.add_mutually_exclusive_group()
    arrivals.add_argument("--poisson", action="store_true",
                          help="Poisson arrivals with lengths drawn from the trace, instead of the trace's own "
                               "arrivals")
    arrivals.add_argument("--sampled", action="store_true",
                          help="Helix's online generator instead of the trace's own arrivals: 3 s bins of the "
                               "trace's rate drawn at random, scaled to the rate, lengths drawn from the whole "
                               "trace (workload.sampled; what scripts/validate_sim_helix.py runs)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=_positive, default=None, metavar="R", help="mean arrival rate, requests/s")
    load.add_argument("--offline", action="store_true",
                      help="offline serving: a closed loop that keeps the scheduler's queue non-empty")
    load.add_argument("--load", type=_positive, default=0.75, metavar="F",
                      help="without --rate: this share of the peak (default: 0.75, Helix's online setting)")
    p.add_argument("--peak", default="measured", choices=["measured", "maxflow"],
                   help="without --rate, the peak that --load scales: measured by an offline run of the same "
                        "plan and scheduler (10 simulated minutes), or the plan's max flow, an upper bound that "
                        "per-request pipelines seldom reach (default: measured)")
    p.add_argument("--duration", type=_positive, default=None, metavar="S",
                   help="simulated seconds of arrivals (default: 1800 online, 600 offline, as Helix)")
    p.add_argument("--warmup", type=_non_negative, default=None, metavar="S",
                   help="seconds before the measured window (default: 30 online, 60 offline)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the scheduler and Poisson draws")
    p.add_argument("--slo-ttft", type=_positive, default=None, metavar="S", help="TTFT bound for SLO attainment")
    p.add_argument("--slo-tpot", type=_positive, default=None, metavar="S", help="TPOT bound for SLO attainment")
    p.add_argument("--slo-e2e", type=_positive, default=None, metavar="S", help="E2E bound for SLO attainment")
    p.add_argument("--like", default="hetnode", choices=LIKES,
                   help="named settings: hetnode (the runtime's behaviour, what predicts the testnet) or helix "
                        "(Helix's simulator: vLLM's measured KV pools and per-step caps, whole prompts, its offline "
                        "loop, its KV marks 0.85/0.9 and output ratios 1.0/0.6, one link message per item, its extra "
                        "costs; docs/simulator.md). Options given below win over the setting's (default: hetnode)")
    p.add_argument("--max-batch-tokens", type=int, default=None, metavar="N",
                   help="most tokens one node step carries (default: the setting's; 8192, the runtime's)")
    p.add_argument("--prefill-tokens", type=auto_or_count, default="auto", metavar="N",
                   help="most prompt tokens a step of a prefill replica's node batches, a longer prompt alone (0: no "
                        "cap; default auto: 1024 with --placement thunderserve, as the coordinator's)")
    p.add_argument("--high-water", type=float, default=None, metavar="F",
                   help="the scheduler's KV high-water mark (default: the setting's, else the scheduler's)")
    p.add_argument("--link-messages", default=None, choices=["step", "item"],
                   help="one link message per step and next hop (the runtime's) or one per item (Helix's: one "
                        "request at a time per idle link) (default: the setting's)")
    p.add_argument("--time-limit", type=_positive, default=None, metavar="S",
                   help="seconds the placement MILP may run (default: the planner's)")
    p.add_argument("--no-partial", action="store_true",
                   help="plan without partial inference (a node's successor starts exactly at its last layer)")
    p.add_argument("--kv-share", type=float, default=None, metavar="F",
                   help="share of device memory kept for the KV cache when planning, in [0, 1) (default: 0.5; "
                        "thunderserve: its kv_reserve, 0.1)")
    p.add_argument("--first", type=int, default=None, metavar="N",
                   help="Cronus's pair designs: serve the trace's first N requests (default 1000, as Cronus §5.1)")
    p.add_argument("--lose", default=None, metavar="NODES@T",
                   help="cluster nodes (GPUs, comma-separated) that go down T simulated seconds into the run: their "
                        "work is lost, the requests on them move (re-prefilling elsewhere) and the coordinator "
                        "re-plans as --reschedule says (docs/simulator.md, 'Nodes lost and re-plans')")
    p.add_argument("--reschedule", default=None, choices=["lightweight", "full", "none"],
                   help="with --lose: lightweight (ThunderServe §3.4: surviving groups keep their layers, phases "
                        "flip, the TSTP re-solved; what the coordinator does for a ThunderServe plan), full (a new "
                        "plan of the method over the nodes left; a node whose layers change reloads) or none (the "
                        "plan serves on without the lost nodes) (default: the coordinator's, lightweight for "
                        "--placement thunderserve, full otherwise)")
    p.add_argument("--reschedule-delay", type=_non_negative, default=None, metavar="S",
                   help="seconds from the loss to the new plan (default: measured, the coordinator's 0.5 s debounce "
                        "plus the planner's CPU time here)")
    p.add_argument("--reload", type=_non_negative, default=None, metavar="S",
                   help="seconds a node whose layers a re-plan changes takes to load them (default: 103, "
                        "ThunderServe's Table 4 for LLaMA-30B, a stated figure)")
    p.add_argument("--json", action="store_true", help="print the result as JSON (summary, nodes, links)")
    p.add_argument("--requests", action="store_true", help="with --json: include every request")
    p.add_argument("--csv", default=None, metavar="DIR", help="write requests/nodes/links/timeseries CSV files")
    p.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots to DIR")
    p.add_argument("--progress", default="auto", choices=["auto", "on", "off"],
                   help="progress bar on stderr (default: when stderr is a terminal)")
    add_padg_arguments(p)
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def resolve_cluster(name: str, clusters_dir: Path) -> Path:
    path = Path(name)
    if path.exists():
        return path
    shipped = clusters_dir / f"{name}.toml"
    if shipped.is_file():
        return shipped
    known = ", ".join(sorted(p.stem for p in clusters_dir.glob("*.toml")))
    raise ConfigError(f"no such cluster file (shipped ones: {known})", file=name, key="--cluster")


def run(args: argparse.Namespace, *, clusters_dir: Path) -> int:
    from hetnode.planner.cluster import load_cluster
    from hetnode.planner.cronus_plan import CHUNK as CRONUS_CHUNK
    from hetnode.planner.model import model_spec
    from hetnode.planner.plan import PlacementPlan
    from hetnode.planner.profile_sources import kv_share_for, profile_table_for
    from hetnode.testnet.sim import workload as wl
    from hetnode.testnet.sim.runner import measured_peak, simulate
    from hetnode.testnet.sim.settings import options_like
    from hetnode.testnet.sim.tp_stages import merge_tensor_parallel

    cluster = load_cluster(resolve_cluster(args.cluster, clusters_dir))
    model = model_spec(args.model)
    if args.method in PAIR_DESIGNS and (args.method != "cronus" or len(cluster.nodes) == 2):
        from hetnode.testnet.sim.pair_cli import run_pair

        if args.first is not None and args.first < 1:
            raise ConfigError(f"--first must be >= 1, not {args.first}", key="--first")
        # §5.1 replays the trace as it is: the length filter is Helix's, so it applies only when asked for.
        return run_pair(args, cluster, model, wl.load_trace(args.trace, length_filter=False))
    if args.method in PADG_PLACEMENTS:  # instances, not layer pipelines: the instance simulator
        from hetnode.testnet.sim.padg_cli import run as run_padg

        return run_padg(args, cluster, model)
    duration = args.duration or (600.0 if args.offline else 1800.0)
    warmup = args.warmup if args.warmup is not None else (60.0 if args.offline else 30.0)
    if warmup >= duration:
        raise ConfigError(f"the warm-up ({warmup:g} s) must be shorter than the duration ({duration:g} s)",
                          key="--warmup")
    loss = _loss(args, cluster, duration)  # before planning: a typo should not wait for the planner
    kv_share = kv_share_for(args.method, args.kv_share)
    profiles = profile_table_for(cluster, model, args.profile, kv_share=kv_share)
    trace = wl.load_trace(args.trace, length_filter=not args.no_length_filter)
    ts_options = None
    if args.plan is not None:
        try:
            plan = PlacementPlan.from_json(json.loads(Path(args.plan).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"cannot read the plan: {exc}", file=args.plan, key="--plan") from exc
        if plan.method == "thunderserve":
            ts_options = _thunderserve_options(args, trace, kv_share)
    else:
        plan, ts_options = _make_plan(args, cluster, model, profiles, trace, kv_share)
    merged = merge_tensor_parallel(plan, cluster)[1]
    if merged is not cluster:  # a tensor-parallel stage runs as one node (tp_stages.py): its profile is the cell's
        profiles = profile_table_for(merged, model, args.profile, kv_share=kv_share)
    _say(args, f"plan: {plan.method}, {len(plan.placements)} nodes, {plan.size}")

    _say(args, f"trace: {len(trace)} requests from {trace.source}")
    slos = {k: v for k, v in (("ttft", args.slo_ttft), ("tpot", args.slo_tpot), ("e2e", args.slo_e2e)) if v}
    try:
        # Cronus's CPI runs chunked prefill of 512 tokens an iteration (§5.1), which its balancer is fitted on.
        budget = args.max_batch_tokens or (CRONUS_CHUNK if plan.method == "cronus" else None)
        options = options_like(args.like, offline=args.offline, max_batch_tokens=budget,
                               high_water=args.high_water, link_messages=args.link_messages,
                               kv_codec=args.kv_codec, kv_transfer=args.kv_transfer,
                               prefill_tokens=prefill_tokens_of(plan.method, args.prefill_tokens),
                               decode_booking=args.decode_booking)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if args.like != "hetnode":
        _say(args, f"settings: like {args.like}")
    if args.offline:
        workload = wl.offline(trace)
    else:
        rate = args.rate
        if rate is None:
            if args.peak == "maxflow":
                peak = plan.max_flow
                _say(args, f"peak: the plan's max flow, {peak:.1f} tokens/s")
            else:
                peak = measured_peak(cluster, model, profiles, plan, trace=trace, scheduler=args.scheduler,
                                     seed=args.seed, options=options)
                _say(args, f"peak: {peak:.1f} tokens/s (prompt + generated), measured by an offline run")
            rate = wl.helix_online_rate(peak, trace.mean_input, trace.mean_output, args.load)
        if args.poisson:
            workload = wl.poisson(rate, lengths=trace, duration_s=duration, seed=args.seed)
        elif args.sampled:
            workload = wl.sampled(trace, rate=rate, duration_s=duration, seed=args.seed)
        else:
            workload = wl.replay(trace, rate=rate, duration_s=duration)
    _say(args, f"workload: {workload.description}")
    replan = None
    if loss is not None:
        replan = _replan(args, cluster, model, plan, loss, ts_options, trace, kv_share)
    progress = args.progress == "on" or (args.progress == "auto" and sys.stderr.isatty())
    result = simulate(cluster, model, profiles, plan, workload=workload, scheduler=args.scheduler,
                      duration_s=duration, warmup_s=warmup, seed=args.seed, slos=slos, progress=progress,
                      options=options, loss=loss, replan=replan)
    result.config["trace_source"] = trace.source
    if args.csv:
        for path in result.to_csv(args.csv):
            _say(args, f"wrote {path}")
    if args.plots:
        from hetnode.testnet.sim.plots import write_plots

        for path in write_plots(result, args.plots):
            _say(args, f"wrote {path}")
    if args.json:
        print(result.dumps(requests=args.requests))
    else:
        print(format_summary(result), end="")
    return 0


def _make_plan(args: argparse.Namespace, cluster: Any, model: Any, profiles: Any, trace: Any,
               kv_share: float) -> tuple[Any, Any]:
    """The plan of --method over `cluster`, and its ThunderServe options where it is ThunderServe's (None
    otherwise); made again over the nodes left after --lose for a full re-plan."""
    from hetnode.planner.thunderserve.deploy import thunderserve_placement

    if args.method == "thunderserve":
        options = _thunderserve_options(args, trace, kv_share)
        _say(args, f"planning {model.name} on {cluster.name} (thunderserve, for {options.traffic.input_len:.0f} "
                   f"prompt and {options.traffic.output_len:.0f} output tokens at {options.traffic.rate:g} "
                   "requests/s) ...")
        return thunderserve_placement(cluster, model, options), options
    if args.method == "split":
        from hetnode.planner.profile import Workload
        from hetnode.planner.split import split_placement

        # The pools are sized for the requests this run serves (hetnode coordinator's --split-workload).
        typical = Workload(input_len=max(1, round(trace.mean_input)), output_len=max(0, round(trace.mean_output)))
        _say(args, f"planning {model.name} on {cluster.name} (split, for {typical.input_len} prompt and "
                   f"{typical.output_len} output tokens) ...")
        return split_placement(cluster, model, profiles, workload=typical), None
    if args.method == "cronus":  # more than two nodes: weak and strong ones in pairs, in the main simulator
        from hetnode.planner.cronus_plan import cronus_placement

        plan = cronus_placement(cluster.name, model, {n.name: n.device_spec.fp16_tflops for n in cluster.nodes},
                                {n.name: int(n.memory_gb * 2**30) for n in cluster.nodes})
        _say(args, "plan: " + ", ".join(f"{a.nodes[0]} (PPI) with {b.nodes[0]} (CPI)"
                                        for a, b in zip(plan.replicas[::2], plan.replicas[1::2], strict=True)))
        return plan, None
    from hetnode.planner.placement import PlannerOptions, plan_placement

    planning = PlannerOptions(partial_inference=not args.no_partial,
                              **({"time_limit_s": args.time_limit} if args.time_limit else {}))
    _say(args, f"planning {model.name} on {cluster.name} ({args.method}) ...")
    return plan_placement(cluster, model, profiles, method=args.method, options=planning), None


def _loss(args: argparse.Namespace, cluster: Any, duration: float) -> Any:
    """--lose, checked against the cluster and the run's length (None without it)."""
    from hetnode.testnet.sim.replan import check_loss, parse_loss

    if args.lose is None:
        if args.reschedule or args.reschedule_delay is not None or args.reload is not None:
            raise ConfigError("--reschedule, --reschedule-delay and --reload say what follows a loss: give --lose",
                              key="--reschedule")
        return None
    loss = parse_loss(args.lose)
    check_loss(loss, cluster, duration)
    if args.reschedule == "lightweight" and args.plan is None and args.method != "thunderserve":
        raise ConfigError(f"lightweight rescheduling is ThunderServe's (§3.4), not {args.method}'s: use "
                          "--reschedule full or none", key="--reschedule")
    return loss


def _replan(args: argparse.Namespace, cluster: Any, model: Any, plan: Any, loss: Any, ts_options: Any, trace: Any,
            kv_share: float) -> Any:
    """The re-plan after --lose that --reschedule asks for (by default the coordinator's), made now and timed."""
    from hetnode.planner.profile_sources import profile_table_for
    from hetnode.testnet.sim.replan import RELOAD_S, after_loss
    from hetnode.testnet.sim.tp_stages import merge_tensor_parallel

    how = args.reschedule or ("lightweight" if plan.method == "thunderserve" else "full")

    def full(left: Any) -> Any:
        return _make_plan(args, left, model, profile_table_for(left, model, args.profile, kv_share=kv_share), trace,
                          kv_share)[0]

    def profiles(new: Any) -> Any:
        return profile_table_for(merge_tensor_parallel(new, cluster)[1], model, args.profile, kv_share=kv_share)

    if how != "none":
        _say(args, f"re-planning after losing {', '.join(loss.nodes)} at {loss.at:g} s ({how}) ...")
    replan = after_loss(plan, cluster, model, loss, how, options=ts_options, planner=full,
                        delay_s=args.reschedule_delay, reload_s=RELOAD_S if args.reload is None else args.reload,
                        profiles=profiles)
    if replan is not None:
        said = replan.note or (replan.plan.notes[0] if replan.plan.notes else replan.plan.size)
        _say(args, f"re-plan at {replan.at:.2f} s (planner {replan.planner_s:.2f} s of CPU): {said}")
    return replan


def _thunderserve_options(args: argparse.Namespace, trace: Any, kv_share: float) -> Any:
    """ThunderServe's options for the trace's lengths (their means and spreads), at --rate (else its default
    rate)."""
    import dataclasses

    from hetnode.planner.thunderserve.settings import ThunderServeOptions, Traffic

    defaults = ThunderServeOptions()
    traffic = Traffic.of(trace.inputs, trace.outputs, args.rate or defaults.traffic.rate)
    # The planner prices a decode replica's KV over the time the run's booking holds it (`slo.decode_residency`).
    return dataclasses.replace(defaults, traffic=traffic, seed=args.seed, kv_reserve=kv_share,
                               decode_booking=args.decode_booking)


def _say(args: argparse.Namespace, text: str) -> None:
    """Progress notes for a person: stderr, so that --json output stays clean."""
    if args.log_level in ("debug", "info", "warning"):
        print(text, file=sys.stderr, flush=True)


def format_summary(result: Any) -> str:
    s, c = result.summary, result.config
    lines = [
        f"cluster      {c['cluster']} ({c['method']} placement, plan {c['plan_size']})",
        f"model        {c['model']}; profiles {c['profiles']}",
        f"scheduler    {c['scheduler']}",
        f"workload     {c['workload_description']}",
        f"window       [{s['window_s'][0]:g}, {s['window_s'][1]:g}) s simulated in {result.wall_s:.1f} s wall "
        f"({result.events} events)",
        "requests     " + ", ".join(f"{k} {v}" for k, v in s["requests"].items()),
        f"throughput   decode {s['decode_throughput']:.1f} tokens/s, prompt {s['prompt_throughput']:.1f} tokens/s, "
        f"{s['request_throughput']:.3f} requests/s",
        "latency (s)  " + "        mean      p50      p90      p99",
    ]
    for key in ("ttft", "tpot", "e2e", "queue"):
        row = s["latency"][key]
        cells = "".join(f"{_num(row[q]):>9}" for q in ("mean", "p50", "p90", "p99"))
        lines.append(f"  {key:<10}{cells}")
    helix = s.get("helix_latency")
    if helix:
        lines.append("Helix's (s)          mean      p50      p95")
        for key, label in (("prompt", "prompt"), ("decode_step", "decode/step")):
            row = helix[key]
            lines.append(f"  {label:<12}" + "".join(f"{_num(row[q]):>9}" for q in ("mean", "p50", "p95")))
    if s["slo_attainment"]:
        lines.append("SLO          " + ", ".join(f"{k} {v:.1%}" for k, v in s["slo_attainment"].items()))
    for event in s.get("replan", ()):
        lines.append(f"re-plan      {_event(event)}")
    for w in s.get("slo_windows", ()):
        if "all" in w:
            lines.append(f"  arrived [{w['from']:g}, {w['to']:g}) s: {w['requests']} requests, SLO all {w['all']:.1%}")
    lines.append(f"nodes        mean utilization {s['node_utilization_mean']:.1%}, peak KV {s['kv_peak_max']:.1%}, "
                 f"mean pipeline depth {_num(s['mean_depth'])}")
    kv = s.get("kv_handoff")
    if kv:
        moved = ", ".join(f"{codec} {_bytes(b)} ({kv['transfers_by_codec'][codec]} transfers)"
                          for codec, b in kv["bytes_by_codec"].items()) or "none"
        gap = kv["prefill_end_to_decode_s"]
        lines.append(f"KV hand-off  {moved}; {c.get('option_kv_transfer', '')}, {kv['refused_full']} of "
                     f"{kv['installs']} installs refused (full)")
        lines.append(f"  prefill end -> first decode step: mean {_num(gap['mean'])} s, p50 {_num(gap['p50'])} s, "
                     f"p90 {_num(gap['p90'])} s")
    if s["busiest_link"]:
        lines.append(f"links        busiest {s['busiest_link']['name']} ({s['busiest_link']['utilization']:.1%}); "
                     f"longest prompt wait {s['worst_prompt_queue_link']['name']} "
                     f"({s['worst_prompt_queue_link']['mean_prompt_queue_s']:.3g} s)")
    return "\n".join(lines) + "\n"


def _event(e: dict[str, Any]) -> str:
    """One loss or re-plan event of a run, for a person."""
    if e["event"] == "loss":
        return f"{e['at']:g} s: lost {', '.join(e['gpus'])}; {e['requests_moved']} requests moved"
    if e["event"] == "ready":
        return f"{e['at']:.2f} s: the new plan serves; {e['queued_retried']} waiting requests retried on it"
    note = f"; {e['note']}" if e["note"] else ""
    return (f"{e['at']:.2f} s: {e['how']} re-plan (planner {e['planner_s']:.2f} s of CPU{note}): "
            f"{len(e['kept'])} nodes kept ({len(e['flipped'])} flipped), {len(e['dropped'])} dropped, "
            f"{len(e['reloaded'])} loading; {e['requests_moved']} requests moved; serves at {e['ready_at']:.2f} s")


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"
