"""`hetnode sim --placement ecoserve` (and its baselines): the instance simulator (padg.py) on a cluster file.

    hetnode sim --cluster ecoserve-l20 --model codellama-34b --placement ecoserve --tp 4 --trace sharegpt \
        --rate 20 --duration 120

The cluster file gives the hosts (nodes grouped by `host`), their GPU type, the GPU link inside a host and the
network between hosts; each host holds (its GPUs // tp) instances, up to `--instances`. `--trace` takes the Azure
traces (conv, code, a file) or Table 4's synthesized lengths (alpaca, sharegpt, longbench), whose SLOs are then
the default. Arrivals are Poisson at `--rate`. `hetnode.testnet.sim.cli` adds these arguments and hands over
here when the placement is one of `PLACEMENTS`.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Any

from hetnode.errors import ConfigError

# CLI name -> padg.DESIGNS name
PLACEMENTS = {"ecoserve": "ecoserve", "nodg-vllm": "vllm", "nodg-sarathi": "sarathi",
              "fudg-distserve": "distserve", "fudg-mooncake": "mooncake"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("instance placements (--placement ecoserve, nodg-vllm, nodg-sarathi, fudg-distserve, "
                             "fudg-mooncake)")
    g.add_argument("--tp", type=int, default=4, metavar="D", help="GPUs per instance, tensor parallel (default 4)")
    g.add_argument("--instances", type=int, default=0, metavar="N",
                   help="instances to deploy (default: all the cluster holds)")
    g.add_argument("--prefill-instances", type=int, default=0, metavar="N",
                   help="FuDG: how many instances prefill (default: half)")
    g.add_argument("--max-instances", type=int, default=0, metavar="N",
                   help="ecoserve: grow up to N instances by mitosis scaling (default: no scaling)")
    g.add_argument("--n-lower", type=int, default=4, metavar="N", help="mitosis N_l (default 4)")
    g.add_argument("--n-upper", type=int, default=16, metavar="N", help="mitosis N_u (default 16)")
    g.add_argument("--token-budget", type=int, default=512, metavar="N", help="nodg-sarathi's tokens per step")


def run(args: argparse.Namespace, cluster: Any, model: Any) -> int:
    from hetnode.policy.ecoserve import Slos
    from hetnode.testnet.sim import workload as wl
    from hetnode.testnet.sim.padg import PadgOptions, simulate_instances
    from hetnode.testnet.sim.synthetic import TABLE4, table4_trace

    options = options_for(cluster, args)
    if args.trace in TABLE4:
        trace = table4_trace(args.trace, seed=args.seed)
        row = TABLE4[args.trace]
        slos = Slos(args.slo_ttft or row.ttft_s, args.slo_tpot or row.tpot_s)
    else:
        trace = wl.load_trace(args.trace, length_filter=not args.no_length_filter)
        slos = Slos(args.slo_ttft or 5.0, args.slo_tpot or 0.1)
    if args.rate is None:
        raise ConfigError("the instance simulator needs an arrival rate", key="--rate")
    duration = args.duration or 300.0
    warmup = args.warmup if args.warmup is not None else 30.0
    workload = wl.poisson(args.rate, lengths=trace, duration_s=duration, seed=args.seed)
    result = simulate_instances(model, workload, PadgOptions(**options), duration_s=duration, warmup_s=warmup,
                                slos=slos)
    summary = {"cluster": cluster.name, "model": model.name, "placement": args.method, "trace": trace.source,
               "slos": {"ttft_s": slos.ttft_s, "tpot_s": slos.tpot_s}, **result.summary(),
               "scaling": result.scaling}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for k, v in summary.items():
            print(f"{k:20} {v:.4g}" if isinstance(v, float) else f"{k:20} {v}")
    return 0


def options_for(cluster: Any, args: argparse.Namespace) -> dict[str, Any]:
    """PadgOptions' fields from the cluster file (hosts, GPU type, links) and the arguments."""
    hosts: Counter[str] = Counter()
    kinds = set()
    first: dict[str, str] = {}
    for node in cluster.nodes:
        spec = node.device_spec
        hosts[node.machine] += spec.count
        kinds.add(spec.kind)
        first.setdefault(node.machine, node.name)
    if len(kinds) != 1:
        raise ConfigError(f"instance placements need one GPU type, cluster {cluster.name} has {sorted(kinds)}",
                          key="--cluster")
    per_host = min(hosts.values()) // args.tp
    if per_host < 1:
        raise ConfigError(f"TP {args.tp} needs {args.tp} GPUs on a host; the smallest host has {min(hosts.values())}",
                          key="--tp")
    capacity = per_host * len(hosts)
    instances = args.instances or capacity
    if instances > capacity or args.max_instances > capacity:
        raise ConfigError(f"the cluster holds {capacity} instances of TP {args.tp}", key="--instances")
    names = list(first.values())
    nic = cluster.link(names[0], names[1]) if len(names) > 1 else None
    inside = [n.name for n in cluster.nodes if n.machine == cluster.nodes[0].machine]
    pcie = cluster.link(inside[0], inside[1]) if len(inside) > 1 else None
    out: dict[str, Any] = {
        "design": PLACEMENTS[args.method], "device": kinds.pop(), "tp": args.tp, "instances": instances,
        # DistServe's prefill/decode pairs must not straddle hosts: an even count a host.
        "per_host": per_host - per_host % 2 if PLACEMENTS[args.method] == "distserve" else per_host,
        "prefill": args.prefill_instances, "max_instances": args.max_instances, "n_lower": args.n_lower,
        "n_upper": args.n_upper, "token_budget": args.token_budget,
    }
    if PLACEMENTS[args.method] == "distserve" and per_host < 2:
        raise ConfigError(f"fudg-distserve puts a prefill and a decode instance on each host: TP {args.tp} leaves "
                          f"{per_host} per host", key="--tp")
    if nic is not None:
        out["nic_gbps"], out["nic_latency_s"] = nic.bandwidth_mbps / 1000, nic.latency_ms / 1000
    if pcie is not None:
        out["pcie_gbps"] = pcie.bandwidth_mbps / 8000
    return out
