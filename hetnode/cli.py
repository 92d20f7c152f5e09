"""The `hetnode` command: join, coordinator, testnet, plan.

Exit codes: 0 success, 2 usage or configuration error (bad flag, bad file, refused admission), 1 runtime
failure (unreachable bootstrap after the retry budget, a crash).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import secrets
import socket
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from hetnode.argtypes import auto_or_count
from hetnode.argtypes import non_negative as _non_negative
from hetnode.argtypes import positive as _positive
from hetnode.argtypes import positive_int as _positive_int
from hetnode.errors import ConfigError, HetnodeError, PeerUnreachable, Refused
from hetnode.policy.decode_booking import ADMISSION, DECODE_BOOKINGS
from hetnode.policy.kv_codec import OPERATOR_CHOICES
from hetnode.policy.kv_transfer import TRANSFER_CHOICES, transfer_policy
from hetnode.policy.machine_batching import BATCHINGS, batch_policy_for
from hetnode.policy.role_batching import prefill_tokens_of

if TYPE_CHECKING:
    from hetnode.coordinator.deployment import Plan
    from hetnode.planner.cluster import ClusterSpec
    from hetnode.planner.model import ModelSpec
    from hetnode.planner.profile import ProfileTable

log = logging.getLogger("hetnode")

DEFAULT_HOME = Path(os.environ.get("HETNODE_HOME", Path.home() / ".hetnode"))


def _planning_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--placement", default="helix",
                   choices=["helix", "petals", "swarm", "sp", "sp+", "pipeline", "split", "cronus", "thunderserve",
                            "ecoserve"],
                   help="how the coordinator places layers (default: helix, the max-flow MILP; pipeline: one "
                        "pipeline through every node; split: prefill and decode replicas, KV handed between; "
                        "cronus: weak and strong nodes in pairs, each holding the model, the weak one prefilling "
                        "the start of each prompt; thunderserve: ThunderServe's search over prefill and decode "
                        "groups, routed by its orchestration, rescheduled lightly when a node is lost; ecoserve: "
                        "every node holding the model an instance, in macro-instances, requests routed by "
                        "EcoServe's Algorithms 1 and 2)")
    p.add_argument("--prefill-tokens", type=auto_or_count, default="auto", metavar="N",
                   help="most prompt tokens a step of a prefill replica's node batches, a longer prompt alone "
                        "(ThunderServe's and DistServe's prefill batching; 0: no cap beyond the token budget; "
                        "default auto: 1024, ThunderServe's Fig. 2 plateau, with --placement thunderserve, else 0)")
    p.add_argument("--macro-bounds", type=_macro_bounds, default=(4, 16), metavar="NL,NU",
                   help="with --placement ecoserve: mitosis's N_l and N_u, the fewest and most instances of a "
                        "macro-instance (default: 4,16)")
    p.add_argument("--scale-from", type=int, default=0, metavar="N",
                   help="with --placement ecoserve: mitosis scaling; N instances serve at first, the others (and "
                        "nodes that join later) stay loaded but spare until a window's SLO attainment under "
                        "--scale-target adds one; --scale-idle under-used windows in a row remove one (default 0: "
                        "every instance serves, nothing scales)")
    p.add_argument("--scale-window", type=_positive, default=30.0, metavar="S",
                   help="seconds of one scaling window (default: 30)")
    p.add_argument("--scale-target", type=_positive, default=0.9, metavar="F",
                   help="the SLO attainment (share of requests meeting --slo) under which a window adds an "
                        "instance (default: 0.9)")
    p.add_argument("--scale-low-use", type=_positive, default=0.3, metavar="F",
                   help="the instances' mean busy share under which a window counts as under-used (default: 0.3)")
    p.add_argument("--scale-idle", type=_positive_int, default=4, metavar="N",
                   help="under-used windows in a row that remove an instance (default: 4)")
    p.add_argument("--split-workload", type=_workload, default=(750, 240), metavar="IN,OUT",
                   help="prompt and output tokens of a typical request, which size a split plan's prefill and "
                        "decode pools (default: 750,240)")
    p.add_argument("--reschedule-shift", type=_non_negative, default=0.0, metavar="F",
                   help="re-plan a split deployment for the observed mix when its mean prompt or output length "
                        "moves by more than this share from what it was sized for, over the last "
                        "--workload-window seconds, and a thunderserve one also when the arrival rate does "
                        "(0, the default: never)")
    p.add_argument("--workload-window", type=_positive, default=120.0, metavar="S",
                   help="seconds of requests the coordinator's view of the workload covers (default: 120)")
    p.add_argument("--slo", type=_slo, default=(5.0, 0.1), metavar="TTFT,TPOT",
                   help="time to first token and time per output token, in seconds: a thunderserve plan's "
                        "orchestration maximizes the share of requests within TTFT + output length x TPOT (its "
                        "end-to-end SLO, the paper's objective), and ecoserve's Algorithm 2 "
                        "checks an instance against them (default: 5,0.1, ShareGPT's in EcoServe's Table 4)")
    p.add_argument("--scheduler", default="iwrr",
                   choices=["iwrr", "random", "shortest-queue", "swarm", "cls", "splitwise", "tstp", "random-pairs"],
                   help="how each request's pipeline is chosen (default: iwrr, Helix's). A phase-split plan is routed "
                        "by CLS's join-the-shortest-queue (cls; a thunderserve plan by its orchestration, tstp), by "
                        "Splitwise's prefill, decode and mixed pools (splitwise) or by random prefill-decode pairs "
                        "(random-pairs, ThunderServe's ablation); other plans then by iwrr")
    p.add_argument("--plan-time-limit", type=_positive, default=10.0, metavar="S",
                   help="seconds the helix search may take per re-plan (default: 10)")
    p.add_argument("--route-wait", type=_positive, default=30.0, metavar="S",
                   help="how long a request waits for a pipeline of live nodes (at start, or to move to after a "
                        "node fails) before it is answered 503 (default: 30)")
    p.add_argument("--decode-booking", default=ADMISSION, choices=list(DECODE_BOOKINGS),
                   help="when a phase-split plan's scheduler books the decode replica's KV for a request: admission "
                        "(the default, Splitwise's: when it is admitted; the decode hops reserve before the prefill "
                        "starts) or handoff (ThunderServe's KV queues: admission is limited by the prefill side, "
                        "the prefill hops keep the prompt's KV until the decode replica has room, and the decode "
                        "hops reserve it then)")
    p.add_argument("--kv-codec", default="auto", choices=list(OPERATOR_CHOICES),
                   help="how KV travels between the phases of a phase-split route (default: auto, the cheapest "
                        "of packing, sending and unpacking at each link's measured bandwidth)")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default=os.environ.get("HETNODE_LOG_LEVEL", "info"),
                   choices=["debug", "info", "warning", "error"], help="log verbosity (default: info)")
    # Internal: the testnet passes a pipe fd here and waits for one JSON readiness line on it.
    p.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    # Internal: the testnet's lifeline pipe; EOF on it means the launcher is gone.
    p.add_argument("--lifeline-fd", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--emulate-links", metavar="FILE", default=None,
                   help="link-emulation file written by the testnet (shapes bandwidth/latency to each peer)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetnode",
        description="Serve LLMs on heterogeneous GPUs across regions, peer to peer.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("coordinator", help="run the coordinator: admits nodes, plans, serves the REST API",
                       description="Run the coordinator peer and its REST API.")
    c.add_argument("--listen", action="append", default=None, metavar="MULTIADDR",
                   help="libp2p listen address, repeatable (default: /ip4/0.0.0.0/tcp/4001)")
    c.add_argument("--api", default="127.0.0.1:8000", metavar="HOST:PORT",
                   help="REST API bind address (default: 127.0.0.1:8000; port 0 picks a free port)")
    c.add_argument("--token", default=os.environ.get("HETNODE_TOKEN"),
                   help="admission token nodes must present (env HETNODE_TOKEN; default: a random one, printed)")
    c.add_argument("--api-key", default=os.environ.get("HETNODE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on the REST API (env HETNODE_API_KEY)")
    c.add_argument("--identity", type=Path, default=None, metavar="PATH",
                   help="Ed25519 identity key file, created on first run (default: coordinator.key in --state-dir, "
                        "else ~/.hetnode/coordinator.key)")
    c.add_argument("--state-dir", type=Path, default=None, metavar="DIR",
                   help="keep the identity, admission token, API key, bound ports and last plan here, so that a "
                        "restarted coordinator is the same peer at the same addresses and serves the plan its "
                        "nodes still hold (default: keep nothing)")
    c.add_argument("--heartbeat-interval", type=_positive, default=1.0, metavar="S",
                   help="seconds between node heartbeats (default: 1)")
    c.add_argument("--heartbeat-deadline", type=_positive, default=5.0, metavar="S",
                   help="mark a node down after this many seconds without a heartbeat (default: 5)")
    c.add_argument("--probe-interval", type=_positive, default=60.0, metavar="S",
                   help="seconds between link re-probes while membership is stable (default: 60)")
    c.add_argument("--model", default="smollm2-135m",
                   help="model to serve: a preset (smollm2-135m), a .gguf file or a Hugging Face directory "
                        "(nodes load their shard of it; default: smollm2-135m); 'none' serves no model")
    c.add_argument("--region", default="", help="the coordinator's region: the pipeline starts there")
    c.add_argument("--trace-history", type=_positive_int, default=1024, metavar="N",
                   help="how many of the latest requests GET /v1/requests/{id} can show (default: 1024)")
    _planning_args(c)
    _common(c)

    j = sub.add_parser("join", help="run a node daemon and join a network through a bootstrap peer",
                       description="Run a node: join through a bootstrap peer, report hardware and links.")
    j.add_argument("--bootstrap", action="append", required=True, metavar="MULTIADDR",
                   help="address of the coordinator or any member, with /p2p/<peer id>; repeatable")
    j.add_argument("--token", default=os.environ.get("HETNODE_TOKEN"),
                   help="admission token (env HETNODE_TOKEN)")
    j.add_argument("--listen", action="append", default=None, metavar="MULTIADDR",
                   help="libp2p listen address, repeatable (default: /ip4/0.0.0.0/tcp/0)")
    j.add_argument("--identity", type=Path, default=DEFAULT_HOME / "node.key", metavar="PATH",
                   help="Ed25519 identity key file, created on first run (default: ~/.hetnode/node.key)")
    j.add_argument("--name", default=None, help="node name shown in the cluster (default: host name)")
    j.add_argument("--region", default="", help="region label used by the planner (default: none)")
    j.add_argument("--emulate", default=None, metavar="DEVICE",
                   help="report an emulated GPU from the papers' tables: t4, l4, a100, h100, v100, a6000, "
                        "a5000, a40, 3090ti, or a multi-GPU form such as 2xl4, 4xt4")
    j.add_argument("--memory-gb", type=_positive, default=None, metavar="GIB",
                   help="report this much device memory to the planner instead of the device's (a node that "
                        "shares its GPU, or a testnet node emulating a smaller one)")
    j.add_argument("--device", default="cpu", help="compute device to profile: cpu or cuda[:N] (default: cpu)")
    j.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="serving dtype (default: float32)")
    j.add_argument("--kv-cache-mb", type=_positive, default=256.0, metavar="MB",
                   help="memory for this node's KV cache blocks (default: 256)")
    j.add_argument("--kv-transfer", default="policy", choices=list(TRANSFER_CHOICES),
                   help="how this node sends a prefill step's KV to the decode phase: layer by layer while the step "
                        "runs when the transfer is long enough to gain by it (policy, the default), always "
                        "layer-wise, or always whole after the step (the last two to compare them)")
    j.add_argument("--batching", default="shared", choices=list(BATCHINGS),
                   help="how this node forms a step: the shared batch policy (chunked prefill in arrival order), "
                        "or Splitwise's machine-level scheduler (prompts first come first served up to "
                        "--prompt-tokens a step, decodes until memory is near full, a machine holding both "
                        "prompts first with preemption and ageing), or EcoServe's temporal disaggregation (a step "
                        "all prefill while a prompt can run, else all decode)")
    j.add_argument("--prompt-tokens", type=_positive_int, default=2048, metavar="N",
                   help="with --batching splitwise: most prompt tokens batched in one step (default: 2048)")
    j.add_argument("--prefill-tokens", type=_positive_int, default=None, metavar="N",
                   help="while this node serves a phase-split plan's prefill replica: most prompt tokens batched "
                        "in one step, a longer prompt alone (ThunderServe's and DistServe's prefill batching; "
                        "1024 is ThunderServe's Fig. 2 plateau); default: the cap the coordinator's assignment "
                        "names (its --prefill-tokens)")
    j.add_argument("--compute-dilation", type=_positive, default=100.0, metavar="X",
                   help="with --emulate: a step lasts X times the emulated device's modelled step time "
                        "(or the real time, if longer), so emulated devices keep their relative speeds "
                        "(default: 100)")
    j.add_argument("--drain", type=_non_negative, default=30.0, metavar="S",
                   help="on SIGTERM or Ctrl-C, give the sessions here up to S seconds to move to other nodes with "
                        "their KV before leaving (0: leave at once; they re-prefill elsewhere) (default: 30)")
    j.add_argument("--retry-budget", type=_non_negative, default=3600.0, metavar="S",
                   help="give up (exit 1) when no bootstrap peer answers for this long; 0: never give up "
                        "(default: 3600, so that a coordinator back after minutes finds its nodes)")
    j.add_argument("--metrics", default=None, metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (port 0 picks a free one; default: "
                        "off). Unauthenticated: bind it to an address only your Prometheus reaches")
    _common(j)

    t = sub.add_parser("testnet", help="run a local multi-process testnet on 127.0.0.1",
                       description="Start, inspect and stop a local testnet of a coordinator and N nodes.")
    tsub = t.add_subparsers(dest="testnet_command", required=True, metavar="ACTION")
    up = tsub.add_parser("up", help="start a coordinator and nodes as separate processes",
                         description="Start a coordinator and nodes on 127.0.0.1 with free ports.")
    which = up.add_mutually_exclusive_group()
    which.add_argument("--nodes", type=int, default=None, metavar="N",
                       help="N unshaped CPU nodes (default: 3 when no --cluster)")
    which.add_argument("--cluster", default=None, metavar="FILE",
                       help="cluster file (TOML): devices, regions, link conditions; or a shipped name: "
                            "demo, local3")
    up.add_argument("--model", default="smollm2-135m",
                    help="model the testnet serves (preset, .gguf or HF directory; 'none': control plane only)")
    up.add_argument("--detach", action="store_true", help="start in the background and return")
    up.add_argument("--state-dir", type=Path, default=DEFAULT_HOME / "testnet", metavar="DIR",
                    help="where keys, logs and the state file live (default: ~/.hetnode/testnet)")
    up.add_argument("--api", default="127.0.0.1:0", metavar="HOST:PORT",
                    help="coordinator REST API bind (default: a free port on 127.0.0.1)")
    up.add_argument("--api-key", default=os.environ.get("HETNODE_API_KEY"), help="REST API key")
    up.add_argument("--token", default=None, help="admission token (default: random)")
    up.add_argument("--heartbeat-deadline", type=_positive, default=5.0, metavar="S",
                    help="seconds without heartbeat before a node is marked down (default: 5)")
    up.add_argument("--probe-interval", type=_positive, default=60.0, metavar="S",
                    help="the coordinator's seconds between link re-probes while membership is stable (default: 60)")
    up.add_argument("--ready-timeout", type=_positive, default=120.0, metavar="S",
                    help="fail if a process is not ready within this many seconds (default: 120)")
    up.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    up.add_argument("--compute-dilation", type=_positive, default=None, metavar="X",
                    help="emulated nodes' --compute-dilation: a step lasts X times the emulated device's "
                         "modelled step time, or the real time if longer (default: the node's, 100)")
    up.add_argument("--kv-transfer", default="policy", choices=list(TRANSFER_CHOICES),
                    help="every node's --kv-transfer (default: policy)")
    up.add_argument("--kv-cache-mb", type=_positive, default=None, metavar="MB",
                    help="every node's --kv-cache-mb, the size of its KV pool (default: the node's, 256)")
    up.add_argument("--netns", action="store_true",
                    help="every process in its own Linux network namespace on a bridge, with its own address, "
                         "the cluster's bandwidths enforced by the kernel (tc htb); needs root")
    up.add_argument("--metrics", action="store_true",
                    help="give every node a Prometheus /metrics listener on a free port of 127.0.0.1 (shown by "
                         "'testnet status' and in the state file); the coordinator's is on its REST API")
    up.add_argument("--batching", default="shared", choices=list(BATCHINGS),
                    help="every node's --batching (default: shared, or ecoserve with --placement ecoserve; splitwise: "
                         "Splitwise's machine-level scheduler)")
    _planning_args(up)
    for name, help_ in (("down", "stop a detached testnet"), ("status", "show a detached testnet"),
                        ("restart", "restart one process of a detached testnet (after a crash, or to test one)")):
        p = tsub.add_parser(name, help=help_, description=help_.capitalize() + ".")
        p.add_argument("--state-dir", type=Path, default=DEFAULT_HOME / "testnet", metavar="DIR",
                       help="state directory of the testnet (default: ~/.hetnode/testnet)")
        if name == "restart":
            p.add_argument("name", metavar="NAME", help="'coordinator' or a node's name")
            p.add_argument("--kill", action="store_true",
                           help="SIGKILL it if it is running (default: SIGTERM, then SIGKILL after 10 s)")
            p.add_argument("--ready-timeout", type=_positive, default=120.0, metavar="S",
                           help="fail if it is not ready within this many seconds (default: 120)")

    pl = sub.add_parser("plan", help="plan layer placement over a cluster file and show the max-flow plan",
                        description="Place a model's layers on a cluster's nodes (Helix's max-flow MILP or a "
                                    "baseline heuristic) and print the plan, as a table or JSON; optionally "
                                    "draw it. No GPU and no network: pure planning.")
    pl.add_argument("--cluster", required=True, metavar="FILE",
                    help="cluster file (TOML, docs/cluster-files.md), or a shipped name: "
                         + ", ".join(_shipped_clusters()))
    pl.add_argument("--model", required=True, metavar="NAME",
                    help=f"model preset ({', '.join(_model_presets())}) or a .toml/.json model file "
                         "(docs/planner.md)")
    pl.add_argument("--profile", default="auto", metavar="FILE|roofline|helix|splitwise",
                    help="where T_j comes from: Helix's measured profiles, Splitwise's (Llama-2 70B on DGX-A100/"
                         "H100), the roofline of the papers' GPU tables, or a profile-table file (default: auto, "
                         "helix or splitwise where they measured the model and every device type, roofline "
                         "otherwise)")
    pl.add_argument("--method", default="helix",
                    choices=["helix", "petals", "swarm", "sp", "sp+", "split", "thunderserve"],
                    help="helix: MILP over the max-flow graph; petals, swarm, sp (separate pipelines), sp+ "
                         "(plus a mixed pipeline of the leftovers): the papers' baselines; split: prefill and "
                         "decode pools; thunderserve: ThunderServe's tabu search over GPU groups, phases and "
                         "routing (default: helix)")
    pl.add_argument("--traffic", default="conv", metavar="code|conv|IN,OUT",
                    help="thunderserve: mean prompt and output tokens, an Azure trace's (code, conv) or given "
                         "(default: conv)")
    pl.add_argument("--rate", type=_positive, default=4.0, metavar="R",
                    help="thunderserve: requests per second to plan for (default: 4)")
    pl.add_argument("--slo-scale", type=_positive, default=5.0, metavar="S",
                    help="thunderserve: TTFT, TPOT and E2E SLOs as S times the model's latency on two A100s; the "
                         "search scores the E2E one, the paper's objective (default: 5)")
    pl.add_argument("--steps", type=int, default=100, metavar="N",
                    help="thunderserve: tabu search steps, N_step (default: 100)")
    pl.add_argument("--time-limit", type=_positive, default=None, metavar="S",
                    help="seconds the MILP solver may run (default: the planner's)")
    pl.add_argument("--work-limit", type=_positive_int, default=None, metavar="N",
                    help="rounds of helix's search, a deterministic budget: the plan then does not depend on the "
                         "machine's load (--time-limit becomes a safety net; default: search until the time limit)")
    pl.add_argument("--no-partial", action="store_true",
                    help="forbid partial inference: a node's successor must start exactly at its last layer")
    pl.add_argument("--prune-degree", type=_positive_int, default=None, metavar="D",
                    help="keep about D fastest links per node in the MILP (Helix §4.5; default: the planner's)")
    pl.add_argument("--kv-share", type=float, default=None, metavar="F",
                    help="share of device memory kept for the KV cache, in [0, 1) (default: 0.5; thunderserve: 0.1)")
    pl.add_argument("--seed", type=int, default=None, metavar="N", help="seed of the planner's randomness")
    pl.add_argument("--pick", choices=["served", "max_flow"], default="served",
                    help="how helix picks among its search's best and the heuristics' placements: what they serve "
                         "(KV held for a request's lifetime counted; default) or the max flow (Helix's rule)")
    pl.add_argument("--check", default=None, metavar="PLAN.json",
                    help="plan nothing: validate a plan (`hetnode plan --json` output) against the cluster, model "
                         "and profiles and print every problem (a flow over a link that does not exist among "
                         "them); exit 1 when there is one")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    pl.add_argument("--picture", default=None, metavar="OUT",
                    help="also draw the plan to OUT: .svg (no dependency) or .png (matplotlib)")
    pl.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])

    from hetnode.testnet.sim.cli import add_arguments as add_sim_arguments

    sim = sub.add_parser("sim", help="simulate serving a trace on a planned cluster (discrete-event)",
                         description="Plan a cluster with the runtime's planner and simulate serving an Azure "
                                     "trace (or Poisson arrivals) on it with the runtime's scheduler: latency, "
                                     "throughput, node and link utilization. No GPU and no network.")
    add_sim_arguments(sim, clusters=_shipped_clusters())

    from hetnode.testnet.sim.provision_cli import add_arguments as add_provision_arguments

    provision = sub.add_parser("provision", help="size a phase-split cluster for a load (Splitwise §IV-D)",
                               description="Search the numbers of prompt and token machines that serve a target "
                                           "load within Splitwise's SLOs at the least cost or power, by "
                                           "simulating each design; print the designs and the one chosen.")
    add_provision_arguments(provision)
    return parser


def _two(value: str, cast: type[int] | type[float], form: str) -> tuple[Any, Any]:
    """Two comma-separated numbers (`form` names them in the error, e.g. 'IN,OUT (two integers)')."""
    try:
        a, b = (cast(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {form}, not {value!r}") from None
    return a, b


def _slo(value: str) -> tuple[float, float]:
    ttft, tpot = _two(value, float, "TTFT,TPOT in seconds (e.g. 5,0.1)")
    if not (ttft > 0 and tpot > 0 and math.isfinite(ttft) and math.isfinite(tpot)):
        raise argparse.ArgumentTypeError(f"both SLOs must be positive and finite, not {value!r}")
    return ttft, tpot


def _macro_bounds(value: str) -> tuple[int, int]:
    lower, upper = _two(value, int, "N_l,N_u (two integers)")
    if not 1 <= lower < upper:
        raise argparse.ArgumentTypeError(f"need 1 <= N_l < N_u, not {lower},{upper}")
    return lower, upper


def _workload(value: str) -> tuple[int, int]:
    prompt, output = _two(value, int, "IN,OUT (two integers)")
    if prompt < 1 or output < 0:
        raise argparse.ArgumentTypeError(f"needs at least 1 prompt and 0 output tokens: {value!r}")
    return prompt, output


def _model_presets() -> list[str]:
    from hetnode.planner.model import model_names

    return model_names()


def _clusters_dir() -> Path:
    from importlib import resources

    return Path(str(resources.files("hetnode.testnet") / "clusters"))


def _shipped_clusters() -> list[str]:
    return sorted(p.stem for p in _clusters_dir().glob("*.toml"))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from hetnode.runtime import setup_logging

    setup_logging(getattr(args, "log_level", "info"))
    try:
        _check_planning(args)
        if args.command == "coordinator":
            trio.run(_run_coordinator, args)
        elif args.command == "join":
            _validate_bootstrap(args.bootstrap)
            if not args.token:
                raise ConfigError("an admission token is needed: --token or HETNODE_TOKEN")
            trio.run(_run_node, args)
        elif args.command == "testnet":
            from hetnode.testnet import launcher

            return launcher.main(args)
        elif args.command == "plan":
            return _run_plan(args)
        elif args.command == "sim":
            return _run_sim(args)
        elif args.command == "provision":
            from hetnode.testnet.sim.provision_cli import run as run_provision

            return run_provision(args)
        return 0
    except BaseException as exc:  # mapped to an exit code when it is ours, re-raised otherwise
        leaf = _hetnode_error(exc)
        if leaf is None:
            raise
        return report_error(leaf)


def _check_planning(args: argparse.Namespace) -> None:
    """The planning options that only make sense together (`coordinator` and `testnet up`), refused before
    anything starts."""
    if getattr(args, "scale_from", 0) and getattr(args, "placement", "") != "ecoserve":
        raise ConfigError(f"--scale-from scales EcoServe's instances: it needs --placement ecoserve, not "
                          f"{args.placement}", key="--scale-from")


def _hetnode_error(exc: BaseException) -> HetnodeError | None:
    """The HetnodeError inside exc, looking through trio's exception groups."""
    if isinstance(exc, HetnodeError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            found = _hetnode_error(sub)
            if found is not None:
                return found
    return None


def report_error(exc: HetnodeError) -> int:
    """Print the error for a person and return the exit code it maps to."""
    if isinstance(exc, (ConfigError, Refused)):
        what = "refused by the coordinator" if isinstance(exc, Refused) else "error"
        print(f"hetnode: {what}: {exc}", file=sys.stderr)
        return 2
    if isinstance(exc, PeerUnreachable):
        print(f"hetnode: unreachable: {exc}", file=sys.stderr)
        return 1
    print(f"hetnode: {exc}", file=sys.stderr)
    return 1


def _validate_bootstrap(addrs: list[str]) -> None:
    from multiaddr import Multiaddr

    for addr in addrs:
        try:
            ma = Multiaddr(addr)
            if "p2p" not in [p.name for p in ma.protocols()]:
                raise ValueError("it has no /p2p/<peer id> part")
        except Exception as exc:  # multiaddr raises several unrelated types for bad input
            raise ConfigError(f"malformed bootstrap address {addr!r}: {exc}", key="--bootstrap") from exc


def _run_sim(args: argparse.Namespace) -> int:
    """`hetnode sim`: plan, simulate, report (hetnode.testnet.sim.cli); configuration mistakes exit 2."""
    from hetnode.testnet.sim.cli import run

    return run(args, clusters_dir=_clusters_dir())


def _run_plan(args: argparse.Namespace) -> int:
    """`hetnode plan`: load, plan, print (and draw); configuration mistakes raise ConfigError (exit 2)."""
    import json

    from hetnode.planner.cluster import load_cluster
    from hetnode.planner.model import model_spec
    from hetnode.planner.profile_sources import kv_share_for, profile_table_for
    from hetnode.planner.report import format_plan
    from hetnode.planner.validate import validate_plan

    if args.picture is not None and Path(args.picture).suffix.lower() not in (".svg", ".png"):
        raise ConfigError("a picture is .svg or .png", file=args.picture, key="--picture")
    path = Path(args.cluster)
    if not path.exists():
        if args.cluster not in _shipped_clusters():
            raise ConfigError(f"no such cluster file (shipped ones: {', '.join(_shipped_clusters())})",
                              file=args.cluster, key="--cluster")
        path = _clusters_dir() / f"{args.cluster}.toml"
    cluster = load_cluster(path)
    model = model_spec(args.model)
    kv_share = kv_share_for(args.method, args.kv_share)
    profiles = profile_table_for(cluster, model, args.profile, kv_share=kv_share)

    if args.check is not None:
        return _check_plan(args.check, cluster, model, profiles)

    import dataclasses

    from hetnode.planner.placement import PlannerOptions, plan_placement
    from hetnode.planner.thunderserve.settings import TRAFFIC_PRESETS, ThunderServeOptions, Traffic

    if args.traffic in TRAFFIC_PRESETS:
        traffic = dataclasses.replace(TRAFFIC_PRESETS[args.traffic], rate=args.rate)
    else:
        try:
            prompt, output = _workload(args.traffic)
        except argparse.ArgumentTypeError as exc:
            raise ConfigError(str(exc), key="--traffic") from None
        traffic = Traffic(input_len=prompt, output_len=max(1, output), rate=args.rate)
    thunderserve = ThunderServeOptions(traffic=traffic, ttft_scale=args.slo_scale, tpot_scale=args.slo_scale,
                                       e2e_scale=args.slo_scale, steps=args.steps, kv_reserve=kv_share)
    given = {"time_limit_s": args.time_limit, "prune_degree": args.prune_degree, "seed": args.seed,
             "work_limit": args.work_limit}
    options = PlannerOptions(partial_inference=not args.no_partial, pick=args.pick, thunderserve=thunderserve,
                             **{k: v for k, v in given.items() if v is not None})
    plan = plan_placement(cluster, model, profiles, method=args.method, options=options)
    problems = validate_plan(plan, cluster, model, profiles)
    for problem in problems:
        log.warning("the plan does not validate: %s", problem)
    if args.picture is not None:
        from hetnode.planner.picture import draw_plan

        draw_plan(plan, cluster, args.picture, profiles=profiles)
    if args.json:
        out = {**plan.to_json(), "cluster": cluster.name, "model": model.name, "profiles": profiles.source,
               "validation": problems}
        print(json.dumps(out, indent=2))
    else:
        print(format_plan(plan, cluster, profiles=profiles, model=model), end="")
        print(f"profiles     {profiles.source}")
        if args.picture is not None:
            print(f"picture      {args.picture}")
    return 0


def _check_plan(path: str, cluster: ClusterSpec, model: ModelSpec, profiles: ProfileTable) -> int:
    """`hetnode plan --check PLAN.json`: 0 and "valid" when the plan validates, else 1 and every problem."""
    import json

    from hetnode.planner.plan import PlacementPlan
    from hetnode.planner.validate import validate_plan

    try:
        plan = PlacementPlan.from_json(json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"not a plan file: {exc}", file=path, key="--check") from exc
    problems = validate_plan(plan, cluster, model, profiles)
    for problem in problems:
        print(f"invalid: {problem}")
    if not problems:
        print(f"valid: {path} on {cluster.name}, max flow {plan.max_flow:.1f} tokens/s")
    return 1 if problems else 0


async def _run_coordinator(args: argparse.Namespace) -> None:
    from hetnode.coordinator.api import build_app, serve_api
    from hetnode.coordinator.daemon import Coordinator, CoordinatorConfig
    from hetnode.coordinator.dashboard import dashboard_routes
    from hetnode.coordinator.live_stats import LiveStats
    from hetnode.coordinator.state_dir import CoordinatorState, SavedPlan, StateDir, same_api_port, same_port
    from hetnode.protocol.identity import load_or_create_identity
    from hetnode.protocol.libp2p_transport import open_libp2p_transport
    from hetnode.runtime import announce_ready, maybe_shaped, parse_hostport, shutdown_on_signal

    store = StateDir(args.state_dir) if args.state_dir is not None else None
    saved = store.load() if store is not None else CoordinatorState()
    listen = args.listen or ["/ip4/0.0.0.0/tcp/4001"]
    api = args.api
    if store is not None:
        listen = [same_port(a, saved.listen) for a in listen]
        api = same_api_port(api, saved.api)
    host, port = parse_hostport(api, "--api")
    token = args.token or saved.token
    if not token:
        token = secrets.token_urlsafe(16)
        print(f"no --token given; nodes must join with --token={token}", flush=True)
    api_key = args.api_key or saved.api_key
    try:
        config = CoordinatorConfig(token=token, heartbeat_interval_s=min(args.heartbeat_interval,
                                                                          args.heartbeat_deadline / 3),
                                   heartbeat_deadline_s=args.heartbeat_deadline,
                                   probe_interval_s=args.probe_interval)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    from hetnode.coordinator.deployment import PlanningConfig
    from hetnode.policy.kv_codec import KVCodecPolicy

    planning = PlanningConfig(method=args.placement, scheduler=args.scheduler, time_limit_s=args.plan_time_limit,
                              split_workload=args.split_workload, reschedule_shift=args.reschedule_shift,
                              workload_window_s=args.workload_window, slo_s=args.slo,
                              macro_bounds=args.macro_bounds, scale_from=args.scale_from,
                              scale_window_s=args.scale_window, scale_target=args.scale_target,
                              scale_low_use=args.scale_low_use, scale_idle_windows=args.scale_idle,
                              prefill_tokens=prefill_tokens_of(args.placement, args.prefill_tokens),
                              decode_booking=args.decode_booking)
    identity = args.identity or (store.identity if store is not None else DEFAULT_HOME / "coordinator.key")
    key = load_or_create_identity(identity)
    serving = None
    if args.model.lower() != "none":
        from hetnode.models.resolve import load_config
        from hetnode.models.tokenizer import load_tokenizer

        model_config = await trio.to_thread.run_sync(load_config, args.model)
        tokenizer = await trio.to_thread.run_sync(load_tokenizer, args.model)
        serving = (model_config, tokenizer)
    async with open_libp2p_transport(key, listen) as raw, maybe_shaped(raw, args.emulate_links) as transport:
        coordinator = Coordinator(config, transport)
        from hetnode.coordinator.metrics import CoordinatorMetrics
        from hetnode.coordinator.observe_api import observe_routes

        metrics = CoordinatorMetrics(coordinator)
        live = LiveStats(trio.current_time)
        routes = dashboard_routes(coordinator, live)
        generator = None
        if serving is not None:
            from hetnode.coordinator.openai_api import openai_routes
            from hetnode.coordinator.traces import TraceStore

            generator = coordinator.enable_serving(model=args.model, model_config=serving[0],
                                                   tokenizer=serving[1], home_region=args.region,
                                                   planning=planning, ready_timeout_s=args.route_wait)
            generator.kv_codecs = KVCodecPolicy(args.kv_codec)
            generator.traces = TraceStore(args.trace_history)
            routes += openai_routes(generator, metrics=[metrics, live])
            deployment = coordinator.deployment
            assert deployment is not None
            if store is not None:
                if saved.plan is not None:
                    from hetnode.planner.plan import PlacementPlan

                    try:
                        placement = PlacementPlan.from_json(saved.plan.placement)
                    except (KeyError, TypeError, ValueError) as exc:
                        raise ConfigError(f"unreadable saved plan: {exc!r}", file=str(store.state_file),
                                          key="plan") from exc
                    # Nodes rejoin within a heartbeat deadline or two of the coordinator coming back.
                    deployment.restore(placement, saved.plan.version, wait_s=3 * args.heartbeat_deadline)

                def keep(plan: Plan) -> None:
                    saved.plan = SavedPlan(plan.version, plan.placement.to_json())
                    store.save(saved)

                deployment.on_serving = keep
        routes += observe_routes(metrics, generator)
        app = build_app(coordinator, api_key=api_key, extra_routes=routes)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(shutdown_on_signal, nursery.cancel_scope, lifeline_fd=args.lifeline_fd))
            await nursery.start(coordinator.run)
            url = await nursery.start(serve_api, app, host, port)
            log.info("coordinator %s listening on %s; API at %s, dashboard at %s/dashboard", transport.peer_id,
                     " ".join(transport.listen_addrs()), url, url)
            if store is not None:
                saved.token, saved.api_key = token, api_key
                saved.listen, saved.api = transport.listen_addrs(), url.removeprefix("http://")
                store.save(saved)
            announce_ready(args.ready_fd, role="coordinator", peer_id=transport.peer_id,
                           addrs=transport.listen_addrs(), api=url)


async def _run_node(args: argparse.Namespace) -> None:
    from hetnode.node.daemon import NodeConfig, NodeDaemon
    from hetnode.node.profile import emulated_profile, measure_profile
    from hetnode.protocol.identity import load_or_create_identity
    from hetnode.protocol.libp2p_transport import open_libp2p_transport
    from hetnode.runtime import announce_ready, maybe_shaped, parse_hostport, shutdown_on_signal

    profile = (emulated_profile(args.emulate, args.dtype) if args.emulate
               else await trio.to_thread.run_sync(measure_profile, args.device, args.dtype))
    if args.memory_gb is not None:
        profile = msgspec.structs.replace(profile, memory_bytes=int(args.memory_gb * (1 << 30)))
    key = load_or_create_identity(args.identity)
    listen = args.listen or ["/ip4/0.0.0.0/tcp/0"]
    async with open_libp2p_transport(key, listen) as raw, maybe_shaped(raw, args.emulate_links) as transport:
        name = args.name or f"{socket.gethostname()}-{str(transport.peer_id)[-6:]}"
        config = NodeConfig(bootstrap=tuple(args.bootstrap), token=args.token, name=name, region=args.region,
                            profile=profile, retry_budget_s=args.retry_budget)
        from hetnode.node.emulation import pace_factory
        from hetnode.node.engine import EngineConfig
        from hetnode.node.hops import HopServer

        hops = HopServer(transport, lambda peer: daemon.is_member(peer), device=args.device, dtype=args.dtype,
                         engine_config=EngineConfig(kv_cache_bytes=int(args.kv_cache_mb * (1 << 20))),
                         pace_factory=pace_factory(args.emulate, args.compute_dilation) if args.emulate else None,
                         kv_transfer=transfer_policy(args.kv_transfer),
                         batch_policy=batch_policy_for(args.batching, args.prompt_tokens, trio.current_time),
                         prefill_tokens=args.prefill_tokens)
        daemon = NodeDaemon(config, transport, hops)
        async with trio.open_nursery() as nursery:
            # SIGTERM or Ctrl-C: the sessions here move to other nodes with their KV before the node goes.
            nursery.start_soon(partial(shutdown_on_signal, nursery.cancel_scope,
                                       partial(daemon.leave, drain_s=args.drain), lifeline_fd=args.lifeline_fd,
                                       grace_s=args.drain + 3))
            await nursery.start(hops.run)
            metrics_url = None
            if args.metrics is not None:
                from hetnode.node.metrics_http import serve_metrics

                mhost, mport = parse_hostport(args.metrics, "--metrics")
                try:
                    metrics_url = await nursery.start(serve_metrics, hops.metrics.registry, mhost, mport)
                except OSError as exc:
                    raise ConfigError(f"cannot listen on {args.metrics}: {exc}", key="--metrics") from exc
            await nursery.start(daemon.run)
            log.info("node %s (%s, %s) joined; coordinator %s%s", name, transport.peer_id, profile.device,
                     daemon.coordinator, f"; metrics at {metrics_url}/metrics" if metrics_url else "")
            announce_ready(args.ready_fd, role="node", name=name, peer_id=transport.peer_id,
                           addrs=transport.listen_addrs(), device=profile.device, metrics=metrics_url)
