"""`hetnode provision`: how many prompt and token machines a target load needs (Splitwise §IV-D).

    hetnode provision --prompt-machine 8xh100 --token-machine 8xa100-80g --trace code --rate 20 --picture ha.svg

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

MACHINE_NAMES = ("8xa100-80g", "8xh100")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-70b", help="model preset or file (default: llama-70b, Splitwise's)")
    p.add_argument("--profile", default="auto", metavar="FILE|splitwise|roofline|helix",
                   help="profile table (default: auto: Splitwise's measured DGX profiles for Llama-2 70B)")
    p.add_argument("--prompt-machine", default="8xh100", choices=MACHINE_NAMES,
                   help="the prompt machines' type (default: 8xh100, a DGX-H100)")
    p.add_argument("--token-machine", default="8xa100-80g", choices=MACHINE_NAMES,
                   help="the token machines' type (default: 8xa100-80g, a DGX-A100: Splitwise-HA)")
    p.add_argument("--trace", default="code", help="Azure trace for the request lengths: code or conv (default code)")
    p.add_argument("--rate", type=_positive, required=True, metavar="RPS", help="target load, requests/s (Poisson)")
    p.add_argument("--duration", type=_positive, default=120.0, metavar="S",
                   help="simulated seconds per design (default: 120, Splitwise's 2-minute traces)")
    p.add_argument("--warmup", type=float, default=10.0, metavar="S", help="seconds not measured (default: 10)")
    p.add_argument("--max-prompt", type=_positive_int, default=8, metavar="N", help="most prompt machines (default: 8)")
    p.add_argument("--max-token", type=_positive_int, default=8, metavar="N", help="most token machines (default: 8)")
    p.add_argument("--goal", default="cost", choices=["cost", "power"], help="what the design minimizes")
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
    from hetnode.testnet.sim.provision import REFERENCE, SLOS, design_cluster, evaluate, picture, search
    from hetnode.testnet.sim.workload import load_trace, poisson

    if not 0 <= args.warmup < args.duration:
        raise ConfigError(f"need 0 <= warmup ({args.warmup}) < duration ({args.duration})", key="--warmup")
    model = model_spec(args.model)

    def table(prompt_machine: str, token_machine: str) -> ProfileTable:
        return profile_table_for(design_cluster(prompt_machine, token_machine, 1, 1, model)[0], model, args.profile)

    profiles = table(args.prompt_machine, args.token_machine)
    if REFERENCE not in profiles.profiles:  # the SLOs' reference machine is not in the design
        reference = table(REFERENCE, REFERENCE).profiles[REFERENCE]
        profiles = ProfileTable(profiles.model, {**profiles.profiles, REFERENCE: reference}, profiles.source)
    # The whole length distribution, as Splitwise sizes for it (hetnode sim filters to Helix's lengths).
    workload = poisson(args.rate, lengths=load_trace(args.trace, length_filter=False), duration_s=args.duration,
                       seed=args.seed)

    def one(prompt: int, token: int) -> Design:
        design = evaluate(args.prompt_machine, args.token_machine, prompt, token, model=model, profiles=profiles,
                          workload=workload, duration_s=args.duration, warmup_s=args.warmup,
                          scheduler=args.scheduler)
        print(f"  {prompt:3d} prompt + {token:3d} token: {'meets every SLO' if design.meets else design.worst}",
              file=sys.stderr, flush=True)
        return design

    print(f"provisioning {model.name} for {args.rate:g} req/s of {args.trace} ({profiles.source}); "
          f"prompt machines {args.prompt_machine}, token machines {args.token_machine}", file=sys.stderr)
    best, designs = search(one, max_prompt=args.max_prompt, max_token=args.max_token,
                           goal=args.goal)
    if args.picture:
        title = (f"{args.prompt_machine} prompt / {args.token_machine} token machines, {args.rate:g} req/s "
                 f"{args.trace}")
        Path(args.picture).write_text(picture(designs, best, title=title))
    if args.json:
        print(json.dumps({"best": None if best is None else _design_json(best),
                          "designs": [_design_json(d) for d in designs], "slos": SLOS}, indent=2))
    else:
        print(f"{'prompt':>6} {'token':>5} {'$/hour':>7} {'power':>6}  {'TTFT p50/p90/p99':>18}  "
              f"{'TBT p50/p90/p99':>18}  {'E2E p50/p90/p99':>18}  verdict")
        for d in designs:
            cols = "  ".join("/".join(f"{x:.2f}" for x in d.slowdowns[m]).rjust(18) for m in ("ttft", "tbt", "e2e"))
            mark = " *" if best is not None and (d.prompt, d.token) == (best.prompt, best.token) else ""
            print(f"{d.prompt:6d} {d.token:5d} {d.cost_per_hour:7.1f} {d.power:6.2f}  {cols}  "
                  f"{'meets' if d.meets else d.worst}{mark}")
        if best is None:
            print(f"no design of at most {args.max_prompt} prompt and {args.max_token} token machines meets every "
                  "SLO; raise --max-prompt or --max-token")
        else:
            print(f"chosen (least {args.goal}): {best.prompt} x {args.prompt_machine} prompt + {best.token} x "
                  f"{args.token_machine} token machines, ${best.cost_per_hour:.1f}/hour, power {best.power:g}x "
                  f"a DGX-A100")
    return 0 if best is not None else 1


def _design_json(d: Design) -> dict[str, object]:
    return {"prompt": d.prompt, "token": d.token, "cost_per_hour": d.cost_per_hour, "power": d.power,
            "meets": d.meets, "worst": d.worst, "slowdowns": dict(d.slowdowns), "finished": d.finished,
            "arrived": d.arrived}
