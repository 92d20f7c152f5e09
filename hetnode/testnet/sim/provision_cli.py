"""`hetnode provision`: how many prompt and token machines a target load needs (Splitwise §IV-D).

    hetnode provision --prompt-machine 8xh100 --token-machine 8xa100-80g --trace code --rate 20 --picture ha.svg
    hetnode provision --prompt-machine 8xh100 --token-machine 8xh100-pcap --goal throughput --budget-power 40

`hetnode.cli` adds the subcommand with `add_arguments` and calls `run`; nothing heavy is imported until `run`.
The search and its model are in `hetnode.testnet.sim.provision`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hetnode.argtypes import positive as _positive
from hetnode.argtypes import positive_int as _positive_int

if TYPE_CHECKING:
    from hetnode.testnet.sim.provision import Design

MACHINE_NAMES = ("8xa100-80g", "8xh100", "8xh100-pcap")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-70b", help="model preset or file (default: llama-70b, Splitwise's)")
    p.add_argument("--profile", default="auto", metavar="FILE|splitwise|roofline|helix",
                   help="profile table (default: auto: Splitwise's measured DGX profiles for Llama-2 70B)")
    p.add_argument("--prompt-machine", default="8xh100", choices=MACHINE_NAMES,
                   help="the prompt machines' type (default: 8xh100, a DGX-H100)")
    p.add_argument("--token-machine", default="8xa100-80g", choices=MACHINE_NAMES,
                   help="the token machines' type (default: 8xa100-80g, a DGX-A100: Splitwise-HA)")
    p.add_argument("--trace", default="code", help="Azure trace for the request lengths: code or conv (default code)")
    p.add_argument("--rate", type=_positive, default=None, metavar="RPS",
                   help="target load, requests/s (Poisson); required by the goals cost and power")
    p.add_argument("--duration", type=_positive, default=120.0, metavar="S",
                   help="simulated seconds per design (default: 120, Splitwise's 2-minute traces)")
    p.add_argument("--warmup", type=float, default=10.0, metavar="S", help="seconds not measured (default: 10)")
    p.add_argument("--max-prompt", type=_positive_int, default=8, metavar="N", help="most prompt machines (default: 8)")
    p.add_argument("--max-token", type=_positive_int, default=8, metavar="N", help="most token machines (default: 8)")
    p.add_argument("--goal", default="cost", choices=["cost", "power", "throughput"],
                   help="what the design optimizes: the least cost or power at --rate, or the most throughput "
                        "under --budget-cost or --budget-power (default: cost)")
    p.add_argument("--budget-cost", type=_positive, default=None, metavar="$/H",
                   help="goal throughput: the most dollars per hour the design may cost")
    p.add_argument("--budget-power", type=_positive, default=None, metavar="X",
                   help="goal throughput: the most provisioned power, in DGX-A100s (a DGX-H100 is 1.75)")
    p.add_argument("--max-rate", type=_positive, default=200.0, metavar="RPS",
                   help="goal throughput: the highest rate tried (default: 200)")
    p.add_argument("--rate-resolution", type=_positive, default=2.0, metavar="RPS",
                   help="goal throughput: the rate found is within this of the highest met (default: 2)")
    p.add_argument("--batching", default="splitwise", choices=["splitwise", "shared"],
                   help="the machines' batch policy (default: splitwise, its machine-level scheduler)")
    p.add_argument("--scheduler", default="splitwise", choices=["splitwise", "cls"],
                   help="the cluster-level scheduler (default: splitwise, with the mixed pool)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the Poisson arrivals")
    p.add_argument("--json", action="store_true", help="print every design evaluated as JSON")
    p.add_argument("--picture", default=None, metavar="OUT.svg", help="also draw the search space (Fig. 12)")


def run(args: argparse.Namespace) -> int:
    from hetnode.errors import ConfigError
    from hetnode.planner.model import model_spec
    from hetnode.planner.profile import ProfileTable
    from hetnode.planner.profile_sources import profile_table_for
    from hetnode.testnet.sim.provision import (
        REFERENCE,
        SLOS,
        decode_batch_for,
        design_cluster,
        evaluate,
        picture,
        search,
        search_throughput,
    )
    from hetnode.testnet.sim.runner import SimOptions
    from hetnode.testnet.sim.workload import Workload, load_trace, poisson

    if not 0 <= args.warmup < args.duration:
        raise ConfigError(f"need 0 <= warmup ({args.warmup}) < duration ({args.duration})", key="--warmup")
    budgets = [(name, value) for name, value in (("cost", args.budget_cost), ("power", args.budget_power))
               if value is not None]
    if args.goal == "throughput":
        if len(budgets) != 1:
            raise ConfigError("the goal throughput needs one budget: --budget-cost or --budget-power",
                              key="--budget-cost" if budgets else "--goal")
        if args.rate is not None:
            raise ConfigError("the goal throughput searches the rate; give --max-rate, not --rate", key="--rate")
    else:
        if budgets:
            raise ConfigError(f"--budget-{budgets[0][0]} goes with --goal throughput, not {args.goal}",
                              key=f"--budget-{budgets[0][0]}")
        if args.rate is None:
            raise ConfigError(f"the goal {args.goal} needs a target load: --rate", key="--rate")
    model = model_spec(args.model)

    def table(prompt_machine: str, token_machine: str) -> ProfileTable:
        return profile_table_for(design_cluster(prompt_machine, token_machine, 1, 1, model)[0], model, args.profile)

    profiles = table(args.prompt_machine, args.token_machine)
    if REFERENCE not in profiles.profiles:  # the SLOs' reference machine is not in the design
        reference = table(REFERENCE, REFERENCE).profiles[REFERENCE]
        profiles = ProfileTable(profiles.model, {**profiles.profiles, REFERENCE: reference}, profiles.source)
    # The whole length distribution, as Splitwise sizes for it (hetnode sim filters to Helix's lengths).
    lengths = load_trace(args.trace, length_filter=False)
    workloads: dict[float, Workload] = {}
    # The pools lend a decode past the batch a token machine steps through within the p50 TBT SLO.
    context = sum(lengths.inputs) / len(lengths.inputs) + sum(lengths.outputs) / len(lengths.outputs) / 2
    options = SimOptions(batching=args.batching,
                         decode_batch=decode_batch_for(profiles, args.token_machine, model, context))

    def at(prompt: int, token: int, rate: float) -> Design:
        if rate not in workloads:
            workloads[rate] = poisson(rate, lengths=lengths, duration_s=args.duration, seed=args.seed)
        design = evaluate(args.prompt_machine, args.token_machine, prompt, token, model=model, profiles=profiles,
                          workload=workloads[rate], duration_s=args.duration, warmup_s=args.warmup,
                          scheduler=args.scheduler, options=options, rate=rate)
        print(f"  {prompt:3d} prompt + {token:3d} token at {rate:g} req/s: "
              f"{'meets every SLO' if design.meets else design.worst}", file=sys.stderr, flush=True)
        return design

    machines = f"prompt machines {args.prompt_machine}, token machines {args.token_machine}"
    if args.goal == "throughput":
        (of, budget), = budgets
        print(f"provisioning {model.name} for the most {args.trace} requests/s under a {of} budget of {budget:g} "
              f"({profiles.source}); {machines}", file=sys.stderr)
        best, designs = search_throughput(at, prompt_machine=args.prompt_machine, token_machine=args.token_machine,
                                          budget=budget, of=of, max_prompt=args.max_prompt,
                                          max_token=args.max_token, max_rate=args.max_rate,
                                          resolution=args.rate_resolution)
        load = f"{of} budget {budget:g}"
    else:
        print(f"provisioning {model.name} for {args.rate:g} req/s of {args.trace} ({profiles.source}); {machines}",
              file=sys.stderr)
        best, designs = search(lambda p, t: at(p, t, args.rate), max_prompt=args.max_prompt,
                               max_token=args.max_token, goal=args.goal)
        load = f"{args.rate:g} req/s"
    if args.picture:
        title = f"{args.prompt_machine} prompt / {args.token_machine} token machines, {load} {args.trace}"
        Path(args.picture).write_text(picture(designs, best, title=title))
    if args.json:
        print(json.dumps({"best": None if best is None else _design_json(best),
                          "designs": [_design_json(d) for d in designs], "slos": SLOS}, indent=2))
    else:
        print(f"{'prompt':>6} {'token':>5} {'$/hour':>7} {'power':>6} {'req/s':>6}  {'TTFT p50/p90/p99':>18}  "
              f"{'TBT p50/p90/p99':>18}  {'E2E p50/p90/p99':>18}  verdict")
        for d in designs:
            cols = "  ".join("/".join(f"{x:.2f}" for x in d.slowdowns[m]).rjust(18) for m in ("ttft", "tbt", "e2e"))
            mark = " *" if best is not None and (d.prompt, d.token) == (best.prompt, best.token) else ""
            print(f"{d.prompt:6d} {d.token:5d} {d.cost_per_hour:7.1f} {d.power:6.2f} {d.rate:6.3g}  {cols}  "
                  f"{'meets' if d.meets else d.worst}{mark}")
        if best is None:
            print(f"no design of at most {args.max_prompt} prompt and {args.max_token} token machines meets every "
                  f"SLO at {load}; raise --max-prompt or --max-token" + (", or lower --rate-resolution"
                                                                       if args.goal == "throughput" else ""))
        else:
            goal = "most throughput" if args.goal == "throughput" else f"least {args.goal}"
            print(f"chosen ({goal}): {best.prompt} x {args.prompt_machine} prompt + {best.token} x "
                  f"{args.token_machine} token machines, ${best.cost_per_hour:.1f}/hour, power {best.power:g}x "
                  f"a DGX-A100, every SLO met at {best.rate:g} req/s")
    return 0 if best is not None else 1


def _design_json(d: Design) -> dict[str, object]:
    return {"prompt": d.prompt, "token": d.token, "cost_per_hour": d.cost_per_hour, "power": d.power, "rate": d.rate,
            "meets": d.meets, "worst": d.worst, "slowdowns": dict(d.slowdowns), "finished": d.finished,
            "arrived": d.arrived}
