"""`simulate`: one run of a cluster, a placement plan and a scheduler on a workload, measured.

    plan = plan_placement(cluster, model, profiles, method="helix")
    result = simulate(cluster, model, profiles, plan, scheduler="iwrr",
                      workload=replay(load_trace("conv"), rate=2.0, duration_s=1800), duration_s=1800)
    print(result.summary["decode_throughput"])

The scheduler is the runtime's own object (`hetnode.coordinator.routing.make_scheduler`, the same code the
coordinator daemon runs), driven by the simulated clock; a scheduler object may be passed instead of a name.
The plan comes from the runtime's planner unchanged; a phase-split plan (`split_placement`: prefill and decode
replicas) is routed by "cls", whatever the name, as the coordinator routes it, and its KV hand-offs run as
`handoff.py` describes; a Cronus plan (`cronus_placement`'s pairs) is routed by the coordinator's
`CronusScheduler`, its partial prefills handed over the same way. Nothing here reads the wall clock except to
report how long the run took.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from hetnode.errors import ConfigError
from hetnode.planner.cluster import ClusterSpec, NodeSpec
from hetnode.planner.costmodel import MEMORY_EFFICIENCY
from hetnode.planner.cronus_plan import device_splitters
from hetnode.planner.devices import DeviceSpec
from hetnode.planner.model import ModelSpec
from hetnode.planner.node_limits import PAST_TABLE, limits_for
from hetnode.planner.plan import PlacementPlan
from hetnode.planner.profile import ProfileTable, node_kv_tokens
from hetnode.policy import MIN_CHUNK
from hetnode.policy.cronus_refit import REFIT_WINDOW
from hetnode.policy.decode_booking import ADMISSION, DECODE_BOOKINGS
from hetnode.policy.kv_codec import AUTO, OPERATOR_CHOICES
from hetnode.policy.machine_batching import BATCHINGS, PROMPT_TOKENS, batch_policy_for
from hetnode.policy.role_batching import prompt_tokens_for
from hetnode.testnet.sim.coordinator import Scheduler, SimCoordinator, SimRequest
from hetnode.testnet.sim.core import Network, Simulation
from hetnode.testnet.sim.handoff import POLICY, TRANSFER_MODES, SimHandoff, TransferMode, device_rates
from hetnode.testnet.sim.metrics import (
    LATENCY_METRICS,
    LinkStats,
    NodeStats,
    RequestRecord,
    SimResult,
    TimeSeries,
    percentiles,
    slo_attainment,
    step_percentiles,
)
from hetnode.testnet.sim.node import MIXED_STEPS, SimNode
from hetnode.testnet.sim.offline_loop import OfflineLoop
from hetnode.testnet.sim.replan import Loss, Replan, SimReplans, Transition, check_loss, transition
from hetnode.testnet.sim.tp_stages import merge_tensor_parallel, stage_cells
from hetnode.testnet.sim.workload import Trace, Workload, offline

SCHEDULERS = ("iwrr", "random", "shortest-queue", "swarm", "cls", "splitwise", "tstp", "random-pairs", "cronus")
KV_POOLS = ("estimate", "measured")  # a node's KV: memory minus weights, or the profile's measured pool
LINK_MESSAGES = ("step", "item")  # one message per step and next hop, or one per item
SWARM_WIRINGS = ("node", "link")  # SWARM's draw: by the candidate node's rate, or by the link's measured delay
DECODE_LOOPS = ("hop", "coordinator")  # a sampled token goes last hop -> first hop, or by way of the coordinator
NAN = math.nan


@dataclass(frozen=True)
class SimOptions:
    """Knobs of the simulated system; the defaults are the runtime's."""

    max_batch_tokens: int = 8192  # EngineConfig.max_batch_tokens: most tokens one step carries
    block_size: int = 16  # KV block, in tokens (vLLM's and hetnode.kv's)
    drain_s: float = 600.0  # online: after the last arrival, run at most this long for requests to finish
    high_water: float | None = None  # the scheduler's KV high-water mark (None: the scheduler's default)
    queue_limit: int | None = None  # the scheduler's queue bound (None: its default)
    bin_s: float | None = None  # width of the time-series bins (None: about 1/150 of the run)
    # Tokens of KV per node, where it is not what the profile's memory leaves beside the layers (a testnet
    # node's --kv-cache-mb, say); nodes not named keep kv_tokens(profile memory, model, layers held).
    kv_capacity: Mapping[str, int] | None = field(default=None, hash=False)
    # How a step that mixes prompt tokens and decode items is priced: "sum" (prefill + decode, Helix's
    # artifact) or "batched" (one pass over all its tokens, as the runtime's engine runs it; node.py).
    mixed_steps: str = "sum"
    # The batch policy's knobs (hetnode.policy.BatchConfig; the runtime's defaults): the smallest piece split
    # off a prompt chunk beside other work, and whether a node holding no KV admits a prompt larger than its
    # whole pool (the simulator's rule before the policy was shared; the runtime refuses such a prompt).
    min_chunk: int = MIN_CHUNK
    admit_oversized: bool = False
    # Which batch policy the nodes run (the runtime's `hetnode join --batching`): the shared one, or Splitwise's
    # machine-level scheduler with `prompt_tokens` prompt tokens a step at most (hetnode.policy.machine_batching).
    batching: str = "shared"
    prompt_tokens: int = PROMPT_TOKENS
    # A prefill replica's nodes batch at most this many prompt tokens a step (role_batching.py: ThunderServe's
    # and DistServe's prefill batching); None: every node takes the shared setting (the runtime's default).
    prefill_tokens: int | None = None
    # When a phase-split scheduler (cls, tstp, random-pairs) books the decode replica's KV: "admission" (Splitwise's
    # rule, the runtime's) or "handoff" (ThunderServe's KV queues on the prefill replicas; split_scheduler.py).
    decode_booking: str = ADMISSION
    # Splitwise's pools: the requests a decode queue holds before the pool lends (PoolScheduler.decode_batch).
    decode_batch: int | None = None
    # The coordinator's own time, as one server in arrival order (0: it takes none): seconds to start a request
    # (parse, route, send its first item) and to handle one item that came back (stream the token, send the
    # next item). Measured, not guessed: scripts/validate_sim.py measures both on the testnet.
    coordinator_request_s: float = 0.0
    coordinator_token_s: float = 0.0
    # KV hand-offs of phase-split routes (handoff.py): the operator's codec choice (the coordinator's --kv-codec),
    # how each link sends ("layerwise" or "whole", or a callable of the link's `KVTransfer` that says which),
    # and the codecs' pack and unpack rates in fp16 bytes/s (None: measured on this machine, as nodes do).
    kv_codec: str = AUTO
    kv_transfer: str | TransferMode = field(default=POLICY, hash=False)
    kv_codec_rates: Mapping[str, tuple[float, float]] | None = field(default=None, hash=False)
    # -- what Helix's simulator does differently (settings.py names them together as `--like helix`) --
    # A node's KV where the cluster file gives none: "estimate" (memory minus weights, `kv_tokens`) or
    # "measured" (the profile's measured pool, node_limits.py, where it has one for the node's layer count).
    kv_pool: str = "estimate"
    # Where a node holds more layers than its measured limits cover: "estimate" (memory minus weights, no step
    # caps) or "line" (the measured rows' line and the last row's caps, as Helix's simulator gave its separate
    # pipelines; node_limits.py).
    past_table: str = "estimate"
    # Per-step request caps from the profile's measured limits (Helix's prompt_max_requests and
    # decode_max_tokens); off: only the token budget bounds a step.
    step_caps: bool = False
    # The KV estimate charges each request this share of the expected output (the scheduler's output_ratio).
    output_ratio: float = 1.0
    # The expected output the KV estimate starts from (None: the workload's mean), and whether the scheduler
    # then follows the outputs that end (the runtime's) or keeps it (Helix's: 240 tokens, fixed).
    output_len: float | None = None
    learn_output: bool = True
    # Offline: Helix's loop (start N, add while the estimated KV use allows) instead of the backlog loop.
    offline_loop: OfflineLoop | None = None
    # "step": a node sends a step's items for one next hop as one message (the runtime's hops); "item": one
    # message per item, each queued on the link behind the last (Helix's simulator sends one request at a
    # time per idle link, so a receiving node often starts a step with one item).
    link_messages: str = "step"
    # Where a sampled token goes to run its next decode step: "hop", straight from the last hop to the first (the
    # runtime's decode loop), or "coordinator", last hop -> coordinator -> first hop, as Helix's simulator issues
    # each decode iteration anew from its source once the last one reached its sink (two coordinator links'
    # latencies a token: 100 ms on its geo cluster, whose coordinator links all cross regions).
    decode_loop: str = "hop"
    # How the swarm scheduler weighs its candidates: "node", by the candidate's measured throughput (what a node's
    # heartbeat reports, the runtime's), or "link", by the time requests recently took from the sender through the
    # link to the candidate and its step (SWARM's per-peer estimate, Helix's `SwarmNode.ema`: it sees the network).
    swarm_wiring: str = "node"
    # Costs outside the profile tables that Helix's simulator charges: a one-item decode step costs this many
    # times the table's, and the node holding layer 0 spends this long per token copying its input in.
    solo_decode_factor: float = 1.0
    first_layer_copy_s: float = 0.0
    # Where Helix's artifact charges them (node.py): the factor on the decode part of any step with exactly one
    # decode item, prompts beside it or not (off: only a step of one decode item alone), and the copy on every
    # node's first layer for the input it received (off: only the node holding the model's layer 0).
    solo_beside_prompts: bool = False
    copy_every_node: bool = False

    def __post_init__(self) -> None:
        if (self.max_batch_tokens < 1 or self.block_size < 1 or self.drain_s < 0
                or self.min_chunk < 1):
            raise ConfigError(f"bad simulation options: {self}")
        if not self.coordinator_request_s >= 0 or not self.coordinator_token_s >= 0:
            raise ConfigError(f"the coordinator's times must be >= 0: {self}")
        if self.mixed_steps not in MIXED_STEPS:
            raise ConfigError(f"mixed_steps must be one of {', '.join(MIXED_STEPS)}, not {self.mixed_steps!r}")
        if self.bin_s is not None and not self.bin_s > 0:
            raise ConfigError(f"bin_s must be > 0, not {self.bin_s}")
        if self.kv_codec not in OPERATOR_CHOICES:
            raise ConfigError(f"kv_codec must be one of {', '.join(OPERATOR_CHOICES)}, not {self.kv_codec!r}")
        if not callable(self.kv_transfer) and self.kv_transfer not in TRANSFER_MODES:
            raise ConfigError(f"kv_transfer must be one of {', '.join(TRANSFER_MODES)} or a callable, not "
                              f"{self.kv_transfer!r}")
        if self.batching not in BATCHINGS or self.prompt_tokens < 1:
            raise ConfigError(f"batching must be one of {', '.join(BATCHINGS)} ({self.batching!r}) and "
                              f"prompt_tokens >= 1 ({self.prompt_tokens})")
        if self.prefill_tokens is not None and self.prefill_tokens < 1:
            raise ConfigError(f"prefill_tokens must be >= 1 or None, not {self.prefill_tokens}")
        if self.decode_booking not in DECODE_BOOKINGS:
            raise ConfigError(f"decode_booking must be one of {', '.join(DECODE_BOOKINGS)}, not "
                              f"{self.decode_booking!r}")
        if self.kv_pool not in KV_POOLS:
            raise ConfigError(f"kv_pool must be one of {', '.join(KV_POOLS)}, not {self.kv_pool!r}")
        if self.past_table not in PAST_TABLE:
            raise ConfigError(f"past_table must be one of {', '.join(PAST_TABLE)}, not {self.past_table!r}")
        if self.link_messages not in LINK_MESSAGES:
            raise ConfigError(f"link_messages must be one of {', '.join(LINK_MESSAGES)}, not {self.link_messages!r}")
        if self.swarm_wiring not in SWARM_WIRINGS:
            raise ConfigError(f"swarm_wiring must be one of {', '.join(SWARM_WIRINGS)}, not {self.swarm_wiring!r}")
        if self.decode_loop not in DECODE_LOOPS:
            raise ConfigError(f"decode_loop must be one of {', '.join(DECODE_LOOPS)}, not {self.decode_loop!r}")
        if not 0 < self.output_ratio < math.inf or not self.solo_decode_factor > 0 or not self.first_layer_copy_s >= 0:
            raise ConfigError(f"output_ratio and solo_decode_factor must be > 0, first_layer_copy_s >= 0: {self}")
        for codec, rates in (self.kv_codec_rates or {}).items():
            if len(rates) != 2 or not all(x > 0 for x in rates):
                raise ConfigError(f"the rates of codec {codec} must be two positive numbers, not {rates}")


def _nice_bin(span: float) -> float:
    for step in (0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600):
        if span / step <= 150:
            return float(step)
    return span / 150


def make_runtime_scheduler(name: str, plan: PlacementPlan, nodes: Mapping[str, SimNode], *, seed: int,
                           avg_output_len: float, kv_capacity: Mapping[str, int], options: SimOptions,
                           regions: Mapping[str, str] | None = None, model: ModelSpec | None = None,
                           devices: Mapping[str, DeviceSpec] | None = None,
                           hop_delay: Callable[[str, str], float] | None = None) -> Scheduler:
    """The runtime's scheduler by name, with the simulated nodes' queues and throughput where it asks; a
    phase-split plan gets CLS (or Splitwise's pools) with the nodes' regions, and a Cronus plan its pairs'
    balancers fitted on the nodes' devices and refitted as they serve, as the coordinator's deployment builds
    them (`cronus_splitters` of what the nodes report: here their GPU tables, `devices`)."""
    from hetnode.coordinator.routing import make_scheduler, scheduler_for

    name = scheduler_for(plan, name)
    if name not in SCHEDULERS:
        raise ConfigError(f"unknown scheduler {name!r}; known: {', '.join(SCHEDULERS)}", key="--scheduler")
    kwargs: dict[str, Any] = {"kv_capacity": dict(kv_capacity), "avg_output_len": avg_output_len, "seed": seed}
    if options.high_water is not None:
        kwargs["high_water"] = options.high_water
    if options.queue_limit is not None:
        kwargs["queue_limit"] = options.queue_limit
    if options.output_ratio != 1.0:
        kwargs["output_ratio"] = options.output_ratio
    if not options.learn_output:
        kwargs["learn_output"] = False
    if name == "shortest-queue":
        kwargs["queue_len"] = lambda node: float(nodes[node].queued_tokens())
    if name == "swarm":
        for n in nodes.values():
            n.track_throughput = True
        kwargs["throughput"] = lambda node: float(nodes[node].rate.value)
        if options.swarm_wiring == "link":
            if hop_delay is None:
                raise ConfigError("swarm_wiring 'link' needs the simulation's per-link delays")
            kwargs["delay"] = hop_delay
    if name in ("cls", "splitwise", "tstp", "random-pairs"):  # the phase-split policies
        kwargs["regions"] = dict(regions or {})
    if options.decode_booking != ADMISSION:
        if name not in ("cls", "tstp", "random-pairs"):
            raise ConfigError(f"decode_booking {options.decode_booking!r} is a setting of the phase-split schedulers "
                              f"cls, tstp and random-pairs, not of {name!r}", key="--decode-booking")
        kwargs["decode_booking"] = options.decode_booking
    if name == "splitwise" and options.decode_batch is not None:
        kwargs["decode_batch"] = options.decode_batch
    if name == "cronus":
        if model is None or devices is None:
            raise ConfigError("a Cronus plan's scheduler needs the model and the nodes' devices to fit its balancers")
        kwargs["splitters"] = device_splitters(plan, model, devices)
        kwargs["refit_window"] = REFIT_WINDOW
    scheduler: Scheduler = make_scheduler(name, plan, **kwargs)
    return scheduler


def simulate(cluster: ClusterSpec, model: ModelSpec, profiles: ProfileTable, plan: PlacementPlan, *,
             workload: Workload, scheduler: str | Scheduler = "iwrr", duration_s: float = 1800.0,
             warmup_s: float = 30.0, seed: int = 0, slos: Mapping[str, float] | None = None,
             progress: bool = False, options: SimOptions | None = None, loss: Loss | None = None,
             replan: Replan | None = None) -> SimResult:
    """Simulate serving `workload` for `duration_s` seconds; measure over [warmup_s, duration_s). With `loss`,
    cluster nodes go down during the run, and with `replan` the coordinator switches to a new plan (replan.py)."""
    opts = options or SimOptions()
    whole_plan, whole_cluster = plan, cluster
    # A stage of tp GPUs runs as one node of those GPUs (tp_stages.py); `profiles` must cover those devices
    # (a roofline table of the merged cluster charges the stage's all-reduces over the link between its GPUs).
    plan, cluster = merge_tensor_parallel(plan, cluster)
    if not duration_s > 0 or not 0 <= warmup_s < duration_s:
        raise ConfigError(f"need 0 <= warmup ({warmup_s}) < duration ({duration_s})")
    if loss is not None:
        check_loss(loss, whole_cluster, duration_s)
    if replan is not None:
        _check_replan(replan, loss, model, whole_cluster, duration_s, scheduler)
    if plan.num_layers != model.num_layers:
        raise ConfigError(f"the plan is for {plan.num_layers} layers, the model {model.name} has {model.num_layers}")
    if not plan.placements:
        raise ConfigError("the plan places no layers")
    wall0 = time.perf_counter()
    window = (float(warmup_s), float(duration_s))
    horizon = duration_s if workload.offline else duration_s + opts.drain_s
    bin_s = opts.bin_s or _nice_bin(horizon)

    # Nodes holding layers, in the cluster file's order.
    ranges = plan.ranges()
    roles = {n: r.role for r in plan.replicas for n in r.nodes}
    nodes: list[SimNode] = []
    tokens: dict[int, int] = {}  # each node's KV pool in tokens, by index (a re-plan may reuse a name)
    for spec in cluster.nodes:
        if spec.name in ranges:
            nodes.append(_node(len(nodes), spec, ranges[spec.name], roles.get(spec.name), profiles, model, opts,
                               window, bin_s, tokens))
    kv_capacity = {n.name: tokens[n.index] for n in nodes}
    unknown = set(ranges) - {n.name for n in nodes}
    if unknown:
        raise ConfigError(f"the plan places layers on {', '.join(sorted(unknown))}, not in cluster {cluster.name}")
    by_name = {n.name: n for n in nodes}
    # A re-plan's nodes that load a shard are simulated from the start, idle and down until they serve; the
    # network then knows every node of both plans (the cluster's link rules name GPUs, merged or not).
    change: Transition | None = None
    links = cluster
    if replan is not None:
        change, links = _transition(whole_plan, whole_cluster, cluster, replan, loss, nodes, profiles, model,
                                    opts, window, bin_s, tokens)

    network = Network(links, model, nodes, window)
    sim = Simulation(network, per_item=opts.link_messages == "item", decode_loop=opts.decode_loop)
    if opts.swarm_wiring == "link" and scheduler == "swarm":  # kept only where a scheduler reads them
        sim.hop_delays = {}
    if isinstance(scheduler, str):
        expected = workload.mean_output if opts.output_len is None else opts.output_len

        def runtime_scheduler(p: PlacementPlan, named: Mapping[str, SimNode]) -> Scheduler:
            return make_runtime_scheduler(
                str(scheduler), p, named, seed=seed, avg_output_len=expected,
                kv_capacity={n: tokens[named[n].index] for n in p.ranges()}, options=opts,
                regions={s.name: s.region for s in links.nodes}, model=model,
                devices={s.name: replace(s.device_spec, memory_gb=s.memory_gb) for s in links.nodes},
                hop_delay=sim.hop_delay if sim.hop_delays is not None else None)

        sched = runtime_scheduler(plan, by_name)
        if change is not None:
            # Made now, so that a plan no scheduler can route is an error before the run; it starts to count at the
            # re-plan (every call passes the time).
            change.scheduler = runtime_scheduler(change.plan, change.by_name)
        scheduler_name = str(getattr(sched, "name", scheduler))
    else:
        sched, scheduler_name = scheduler, type(scheduler).__name__
    rates = opts.kv_codec_rates
    if rates is None and all(n.device_spec.kind != "cpu" for n in cluster.nodes):
        rates = device_rates(min(n.device_spec.mem_bandwidth_gbps for n in cluster.nodes) * 1e9 * MEMORY_EFFICIENCY)
    sim.handoff = SimHandoff(sim, model, codec=opts.kv_codec, transfer=opts.kv_transfer, rates=rates)
    coord = SimCoordinator(sched, nodes, num_layers=model.num_layers, send=sim.send, send_ids=sim.send_ids,
                           release=sim.release,
                           block_size=opts.block_size, window=window, bin_s=bin_s,
                           request_s=opts.coordinator_request_s, token_s=opts.coordinator_token_s,
                           handoff=sim.handoff)
    sim.coordinator = coord
    coord.by_name = by_name  # the nodes a re-plan adds take their names when it serves
    sim.handoff.by_name = by_name
    coord.purge = sim.purge
    replans = None
    if loss is not None or change is not None:
        replans = SimReplans(sim, coord, prefill_tokens=opts.prefill_tokens)
        if loss is not None:
            cells = stage_cells(whole_plan)
            replans.lose(loss, [by_name[name] for name, cell in cells.items()
                                if name in by_name and set(cell) & set(loss.nodes)])
        if change is not None:
            assert replan is not None
            replans.replan(replan, change)

    inputs, outputs = workload.inputs, workload.outputs
    if workload.offline and opts.offline_loop is not None:
        _kv_bound_loop(sim, coord, sched, workload, duration_s, opts.offline_loop, ranges, seed)
    elif workload.offline:
        _closed_loop(coord, workload, duration_s, _auto_inflight(workload, kv_capacity))
    else:
        def on_arrival(i: int, now: float) -> None:
            coord.arrive(SimRequest(i, now, inputs[i], outputs[i]), now)

        sim.on_arrival = on_arrival
        for i, t in enumerate(workload.arrivals):
            if t < duration_s:
                sim.arrive_at(t, i)

    bar = _progress_bar(progress, duration_s)
    try:
        report = None if bar is None else _reporter(bar)
        end = sim.run(duration_s, report)
        if not workload.offline:
            if bar is not None:
                bar.set_description("draining")
                bar.total = horizon
            end = max(end, sim.run(horizon, report))
        if bar is not None:
            bar.n = min(end, bar.total)
            bar.refresh()
    finally:
        if bar is not None:
            bar.close()
    end = max(end, duration_s)
    wall = time.perf_counter() - wall0

    description = workload.description
    if workload.offline and opts.offline_loop is not None:
        loop = opts.offline_loop
        when = {"token": "token", "finish": "finish", "prompt_or_end": "prompt's end and request's end",
                "replace": "request's end"}[loop.every]
        bound = (f" while the estimated KV use ({loop.measure}) <= {loop.kv_use:g}" if loop.bounded
                 else ", whatever the KV holds")
        description = (f"offline, Helix's loop: {loop.start} requests, then one per {when}{bound}; lengths from "
                       f"{workload.name}"
                       f"{', drawn at random' if loop.lengths == 'drawn' else ', in order'}"
                       f"{f', each {loop.delay_s:g} s after what adds it' if loop.delay_s else ''}")
    config = {
        "cluster": cluster.name, "model": model.name, "method": plan.method, "plan_max_flow": plan.max_flow,
        "plan_size": plan.size,
        "scheduler": scheduler_name, "profiles": profiles.source, "workload": workload.name,
        "workload_description": description, "offline": workload.offline,
        "rate": None if workload.offline else workload.rate, "duration_s": duration_s, "warmup_s": warmup_s,
        "seed": seed, "slos": dict(slos or {}),
        **{f"option_{k}": _option(v) for k, v in asdict(opts).items()},
    }
    records = [_record(r, window) for r in coord.requests]
    node_stats = [_node_stats(n, end, window) for n in nodes]
    names = [n.name for n in node_stats]
    # A node a re-plan added under the name of one it replaced (another shard of that GPU) is told apart.
    node_stats = [replace(n, name=f"{n.name} (re-plan)") if k != names.index(n.name) else n
                  for k, n in enumerate(node_stats)]
    node_stats += [NodeStats(s.name, s.device, 0, 0, 0.0, 0.0, 0, 0, 0.0, 0, 0, 0, 0, 0.0, 0.0, 0, 0.0, 0)
                   for s in links.nodes if s.name not in {n.name for n in nodes}]
    link_stats = [_link_stats(link, links, network, window) for link in network.links()]
    nbins = max(1, math.ceil(end / bin_s))
    series = TimeSeries(
        bin_s=bin_s,
        decode_tokens_per_s=tuple(v / bin_s for v in _pad(coord.decode_bins, nbins)),
        prompt_tokens_per_s=tuple(v / bin_s for v in _pad(coord.prompt_bins, nbins)),
        node_utilization={n.name: tuple(min(1.0, v / bin_s) for v in _pad(n.busy_bins, nbins)) for n in nodes},
    )
    summary = _summary(records, node_stats, link_stats, coord, window, slos or {})
    if replans is not None:
        summary["replan"] = replans.report
        # Attainment before the loss, while the coordinator re-plans and reloads, and once the new plan serves,
        # by the requests' arrival.
        edges = sorted({window[0], window[1], *(e["at"] for e in replans.report if e["event"] in ("loss", "ready")
                                                  and window[0] < e["at"] < window[1])})
        summary["slo_windows"] = [
            {"from": a, "to": b, "requests": len(rs), **slo_attainment(rs, slos or {})}
            for a, b in itertools.pairwise(edges)
            for rs in [[r for r in records if a <= r.arrival < b]]]
    if sim.handoff.installs:
        summary["kv_handoff"] = _handoff_summary(sim.handoff, records)
    return SimResult(config=config, summary=summary, requests=records, nodes=node_stats, links=link_stats,
                     timeseries=series, wall_s=wall, events=sim.processed, sim_end_s=end)


def _node(index: int, spec: NodeSpec, layers: tuple[int, int], role: str | None, profiles: ProfileTable,
          model: ModelSpec, opts: SimOptions, window: tuple[float, float], bin_s: float,
          tokens: dict[int, int]) -> SimNode:
    """The simulated node of `spec` holding `layers`, in a replica of `role` (None: none); its KV pool's tokens go
    to `tokens`."""
    first, last = layers
    profile = profiles.for_node(spec.name, spec.device)
    cap = (opts.kv_capacity or {}).get(spec.name)
    if cap is None:
        cap = node_kv_tokens(profile, model, last - first, measured=opts.kv_pool == "measured", past=opts.past_table)
    tokens[index] = cap
    caps = limits_for(profile.limits, last - first, opts.past_table) if opts.step_caps else None
    return SimNode(index, spec.name, spec.device, profile, first, last, kv_capacity_tokens=cap,
                   block_size=opts.block_size, max_batch_tokens=opts.max_batch_tokens, window=window,
                   bin_s=bin_s, mixed_steps=opts.mixed_steps, min_chunk=opts.min_chunk,
                   admit_oversized=opts.admit_oversized,
                   max_prompts=caps.max_prompts if caps else None,
                   max_decodes=caps.max_decodes if caps else None,
                   prompt_tokens=prompt_tokens_for(role, opts.prefill_tokens),
                   solo_decode_factor=opts.solo_decode_factor, first_layer_copy_s=opts.first_layer_copy_s,
                   solo_beside_prompts=opts.solo_beside_prompts, copy_every_node=opts.copy_every_node,
                   policy=batch_policy_for(opts.batching, opts.prompt_tokens))


def _check_replan(replan: Replan, loss: Loss | None, model: ModelSpec, cluster: ClusterSpec, duration_s: float,
                  scheduler: str | Scheduler) -> None:
    if not isinstance(scheduler, str):
        raise ConfigError("a re-plan makes its plan's scheduler by name, as the coordinator does: pass the "
                          "scheduler's name, not an object", key="--reschedule")
    if replan.plan.num_layers != model.num_layers:
        raise ConfigError(f"the re-plan is for {replan.plan.num_layers} layers, the model {model.name} has "
                          f"{model.num_layers}", key="--reschedule")
    if loss is not None and replan.at < loss.at:
        raise ConfigError(f"the re-plan at {replan.at:g} s comes before the loss at {loss.at:g} s",
                          key="--reschedule")
    if replan.at >= duration_s:
        raise ConfigError(f"the re-plan at {replan.at:g} s is outside the run [0, {duration_s:g}) s",
                          key="--reschedule")
    gone = set(loss.nodes if loss is not None else ()) & {p.node for p in replan.plan.placements}
    names = {n.name for n in cluster.nodes}
    unknown = {p.node for p in replan.plan.placements} - names
    if gone or unknown:
        raise ConfigError(f"the re-plan places layers on {', '.join(sorted(gone | unknown))}, which "
                          f"{'went down' if gone else f'cluster {cluster.name} does not have'}", key="--reschedule")


def _transition(whole_plan: PlacementPlan, whole_cluster: ClusterSpec, merged: ClusterSpec, replan: Replan,
                loss: Loss | None, nodes: list[SimNode], profiles: ProfileTable, model: ModelSpec, opts: SimOptions,
                window: tuple[float, float], bin_s: float, tokens: dict[int, int]) -> tuple[Transition, ClusterSpec]:
    """The nodes a re-plan keeps, drops and adds (the added ones appended to `nodes`, down until it serves), and
    a cluster that knows every node of both plans, with the whole cluster's link rules."""
    old_plan = merge_tensor_parallel(whole_plan, whole_cluster)[0]
    new_plan, new_cluster = merge_tensor_parallel(replan.plan, whole_cluster)
    by_name = {n.name: n for n in nodes}
    new_ranges = new_plan.ranges()
    kept, dropped, added = transition(stage_cells(whole_plan), old_plan.ranges(), stage_cells(replan.plan),
                                      new_ranges, by_name, loss.nodes if loss is not None else ())
    old_roles = {n: r.role for r in old_plan.replicas for n in r.nodes}
    new_roles = {n: r.role for r in new_plan.replicas for n in r.nodes}
    table = replan.profiles or profiles
    fresh = []
    for name in added:
        node = _node(len(nodes), new_cluster.node(name), new_ranges[name], new_roles.get(name), table, model, opts,
                     window, bin_s, tokens)
        node.down = True
        nodes.append(node)
        fresh.append(node)
    serving = {**{name: by_name[name] for name in kept}, **{n.name: n for n in fresh}}
    known = {n.name for n in merged.nodes}
    links = replace(whole_cluster, nodes=(*merged.nodes, *(n for n in new_cluster.nodes if n.name not in known)))
    change = Transition(kept=[(by_name[n], old_roles.get(n), new_roles.get(n)) for n in kept],
                        dropped=[by_name[n] for n in dropped], added=fresh, by_name=serving, plan=new_plan)
    return change, links


def measured_peak(cluster: ClusterSpec, model: ModelSpec, profiles: ProfileTable, plan: PlacementPlan, *,
                  trace: Trace, scheduler: str = "iwrr", duration_s: float = 600.0, warmup_s: float = 60.0,
                  seed: int = 0, options: SimOptions | None = None) -> float:
    """The cluster's peak in tokens/s (prompt + generated) as an offline run of this configuration measures
    it: Helix §6.2's "peak throughput", which the online setting loads to 75%. (The plan's max flow assumes
    every node runs full decode batches; per-request pipelines rarely do, so it is an upper bound.)"""
    result = simulate(cluster, model, profiles, plan, workload=offline(trace), scheduler=scheduler,
                      duration_s=duration_s, warmup_s=warmup_s, seed=seed, options=options)
    peak: float = result.summary["decode_throughput"] + result.summary["prompt_throughput"]
    if not peak > 0:
        raise ConfigError(f"an offline run of the {plan.method} plan served nothing: no peak to scale to")
    return peak


# -- workload drivers -----------------------------------------------------------------------------------------


def _auto_inflight(workload: Workload, kv_capacity: Mapping[str, int]) -> int:
    """The offline loop's bound on unfinished requests: what every node's KV together could hold."""
    per_request = workload.mean_input + workload.mean_output
    return max(workload.backlog, min(workload.max_inflight, math.ceil(sum(kv_capacity.values()) / per_request)))


def _closed_loop(coord: SimCoordinator, workload: Workload, duration_s: float, max_inflight: int) -> None:
    n = len(workload)
    counter = [0]

    def top_up(now: float) -> None:
        refused = 0
        while (now < duration_s and len(coord.waiting) < workload.backlog
               and coord.inflight + len(coord.waiting) < max_inflight):
            i = counter[0]
            counter[0] += 1
            r = SimRequest(i, now, workload.inputs[i % n], workload.outputs[i % n])
            coord.arrive(r, now)
            # A refused request (too long for any pipeline, or a full queue) is skipped; a whole pass of the
            # trace refused means nothing can be served now: try again when something finishes.
            refused = refused + 1 if r.rejected else 0
            if refused >= n:
                break

    coord.on_finish = top_up
    top_up(0.0)


def _kv_bound_loop(sim: Simulation, coord: SimCoordinator, sched: Scheduler, workload: Workload,
                   duration_s: float, loop: OfflineLoop, ranges: Mapping[str, tuple[int, int]], seed: int) -> None:
    """Helix's offline loop (offline_loop.py): `loop.start` requests at 0 (or `loop.delay_s` apart), then at
    each token (or finish, or a prompt's end and a request's) new ones while the scheduler's KV estimate allows,
    each arriving `loop.delay_s` after the event that adds it; it stops at one the scheduler had to queue. Its
    requests are the workload's in order, or drawn at random (`loop.lengths`). A loop that is not bounded by the
    KV (`every="replace"`) puts one request in place of each that ends, queued or not, and of each the scheduler
    refuses (as the closed loop does, at most once per workload request in a run: a count that nothing can serve
    stops)."""
    estimate = getattr(sched, "kv_estimate", None)
    if estimate is None and loop.bounded:
        raise ConfigError(f"Helix's offline loop reads the scheduler's KV estimate; {type(sched).__name__} has none")
    n = len(workload)
    counter = [0]
    refusals = [0]
    rng = random.Random(seed)
    names = list(estimate()) if estimate is not None else []
    layers = [ranges[name] for name in names] if loop.measure == "layer" else None

    def replaces(r: SimRequest) -> bool:
        # A fixed count in flight: a request the scheduler refused leaves its place to another.
        if r.rejected and not loop.bounded and refusals[0] < n:
            refusals[0] += 1
            return True
        return False

    def arrive(now: float, r: SimRequest, _: Any) -> None:
        r.arrival = now
        coord.arrive(r, now)
        if replaces(r):
            top_up(now)

    later = sim.register(arrive) if loop.delay_s > 0 else -1

    def start(now: float) -> bool:
        """Start one request (one in its place while the scheduler refuses them, for a fixed count); whether
        another may follow at once."""
        while True:
            i = counter[0]
            counter[0] += 1
            j = loop.index(i, n, rng)
            r = SimRequest(i, now, workload.inputs[j], workload.outputs[j])
            if later >= 0:
                # It reaches the scheduler later, so the estimate cannot tell yet whether another fits: one per
                # event (Helix's feeder adds one per event too; "finish" would otherwise add without end).
                sim.events.push(now + loop.delay_s, later, r)
                return False
            coord.arrive(r, now)
            if not replaces(r):
                return not coord.waiting and not r.rejected

    def use() -> float:
        if not loop.bounded:
            return 0.0
        assert estimate is not None
        kv = estimate()
        return loop.use(((kv[name].tokens, kv[name].capacity) for name in names), layers)

    def top_up(now: float) -> None:
        added = 0
        while now < duration_s and (not coord.waiting or not loop.bounded) and loop.admits(use(), added):
            added += 1
            if not start(now):
                return

    if loop.every == "token":
        coord.on_token = top_up
    else:
        coord.on_finish = top_up
    if loop.on_prompt:
        coord.on_first = top_up
    for k in range(loop.start):
        if later >= 0:
            # Helix issues its first requests `delay_s` apart from the start, not `delay_s` after it
            start(k * loop.delay_s - loop.delay_s)
        else:
            start(0.0)


# -- results ----------------------------------------------------------------------------------------------


def _option(value: Any) -> Any:
    """An option as the run's config records it (JSON-ready: a callable by its name)."""
    if isinstance(value, Mapping):
        return {k: list(v) if isinstance(v, tuple) else v for k, v in value.items()}
    if callable(value):
        return getattr(value, "__qualname__", repr(value))
    return value


def _handoff_summary(handoff: SimHandoff, records: list[RequestRecord]) -> dict[str, Any]:
    """KV moved between phases (per codec) and the time from a prefill's end to its decode's first step."""
    done = [r for r in records if r.measured and r.finished]
    return {**handoff.summary(), "prefill_end_to_decode_s": percentiles([r.handoff for r in done])}


def _pad(values: list[float], n: int) -> list[float]:
    return (values + [0.0] * n)[:n]


def _when(t: float) -> float:
    return t if t >= 0 else NAN


def _record(r: SimRequest, window: tuple[float, float]) -> RequestRecord:
    first, done, admitted = _when(r.first_token), _when(r.done), _when(r.admitted)
    tpot = (r.last_token - r.first_token) / (r.gen - 1) if r.gen > 1 and r.done >= 0 else NAN
    return RequestRecord(
        id=r.rid, arrival=r.arrival, input_len=r.input_len, output_len=r.output_len, generated=r.gen,
        admitted=admitted, first_token=first, finish=done, ttft=first - r.arrival, tpot=tpot, e2e=done - r.arrival,
        queue=admitted - r.arrival, kv_wait=r.kv_wait, max_tbt=r.max_tbt if r.gen > 1 else NAN, depth=r.depth,
        path=r.path, measured=window[0] <= r.arrival < window[1], rejected=r.rejected,
        handoff=r.decode_at - r.prefilled_at if r.decode_at >= 0 and r.prefilled_at >= 0 else NAN,
        kv_handed=r.handoff_end if r.handoff is not None else 0,
        decode_booked=r.booked_at if r.booked_at >= 0 and r.handoff is not None else NAN, moves=r.restarts)


def _node_stats(n: SimNode, end: float, window: tuple[float, float]) -> NodeStats:
    length = window[1] - window[0]
    n.kv_note(end)  # close the KV integral at the end
    cap = n.kv_capacity
    return NodeStats(
        name=n.name, device=n.device, first_layer=n.first_layer, last_layer=n.last_layer,
        utilization=n.window_busy_s / length, busy_s=n.busy_s, steps=n.steps, items=n.items,
        mean_batch=n.items / n.steps if n.steps else 0.0, max_batch=n.max_batch_items, tokens=n.tokens,
        prompt_tokens=n.prompt_tokens, kv_capacity_blocks=cap, kv_peak=n.kv_peak / cap if cap else NAN,
        kv_mean=n.kv_area / end / cap if cap and end > 0 else NAN, kv_waits=n.kv_waits, kv_wait_s=n.kv_wait_s,
        layer_ranges=len(n.ranges))


def _link_stats(link: Any, cluster: ClusterSpec, network: Network, window: tuple[float, float]) -> LinkStats:
    src, _, dst = link.name.partition("->")
    spec = cluster.link(src, dst)
    return LinkStats(
        name=link.name, src=src, dst=dst, bandwidth_mbps=spec.bandwidth_mbps, latency_ms=spec.latency_ms,
        utilization=link.window_busy_s / (window[1] - window[0]), messages=link.messages, items=link.items,
        bytes=link.bytes, queued_messages=link.queued_messages,
        mean_queue_s=link.queue_s / link.messages if link.messages else 0.0, max_queue_s=link.queue_max_s,
        mean_item_queue_s=link.queue_item_s / link.items if link.items else 0.0, prompt_items=link.pf_items,
        mean_prompt_queue_s=link.pf_queue_s / link.pf_items if link.pf_items else 0.0)


def _summary(records: list[RequestRecord], nodes: list[NodeStats], links: list[LinkStats], coord: SimCoordinator,
             window: tuple[float, float], slos: Mapping[str, float]) -> dict[str, Any]:
    length = window[1] - window[0]
    measured = [r for r in records if r.measured]
    done = [r for r in measured if r.finished]
    refused = sum(1 for r in measured if r.rejected)
    used = [n for n in nodes if n.last_layer > n.first_layer]
    busiest = max(links, key=lambda link: link.utilization, default=None)
    slowest = max(links, key=lambda link: link.mean_prompt_queue_s, default=None)
    return {
        "window_s": list(window),
        "requests": {
            "arrived": len(records), "measured": len(measured), "finished": len(done),
            "unfinished": len(measured) - len(done) - refused, "rejected": refused,
            "rejected_all": sum(1 for r in records if r.rejected), "still_queued": len(coord.waiting),
            "preemptions": coord.preemptions, "moved_lost": coord.lost_moves,
        },
        "decode_throughput": coord.window_generated / length,  # generated tokens/s
        "prompt_throughput": coord.window_prompt / length,  # prompt tokens/s
        "request_throughput": sum(1 for r in records if r.finished and window[0] <= r.finish < window[1]) / length,
        "latency": {m: percentiles([getattr(r, m) for r in done]) for m in LATENCY_METRICS},
        "helix_latency": {
            "prompt": step_percentiles([r.first_token - r.admitted for r in records
                                        if window[0] <= r.first_token < window[1]]),
            "decode_step": step_percentiles(coord.decode_gaps),
        },
        "slo_attainment": slo_attainment(measured, slos),
        "mean_depth": sum(r.depth for r in done) / len(done) if done else None,
        "node_utilization_mean": sum(n.utilization for n in used) / len(used) if used else 0.0,
        "kv_peak_max": max((n.kv_peak for n in used if not math.isnan(n.kv_peak)), default=0.0),
        "busiest_link": None if busiest is None else {"name": busiest.name, "utilization": busiest.utilization},
        "worst_prompt_queue_link": None if slowest is None else {
            "name": slowest.name, "mean_prompt_queue_s": slowest.mean_prompt_queue_s},
    }


# -- progress -----------------------------------------------------------------------------------------------


def _progress_bar(enabled: bool, total: float) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="sim s", desc="simulating", dynamic_ncols=True, leave=False,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} sim s [{elapsed}<{remaining}]")


def _reporter(bar: Any) -> Callable[[float], None]:
    def report(now: float) -> None:
        bar.n = min(now, bar.total)
        bar.refresh()

    return report
