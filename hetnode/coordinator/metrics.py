"""The coordinator's Prometheus metrics, on the REST port at /metrics: one registry per coordinator (never the
process-global one), so that several coordinators in one process (the tests) keep apart.

Requests are counted by the REST API as each ends (`observe_request`, the ApiMetrics interface of openai_api.py):
outcome, TTFT, TPOT and end-to-end latency, tokens. Everything else is read at scrape time from the state the
coordinator keeps anyway: the nodes as their heartbeats last reported them (queue, KV blocks, rates, leases
expired), the links as last probed, the plan and its re-plans, the moves, and the KV bytes the hops reported
sending per link and codec. A scrape therefore always shows the present, and a node that went away leaves the
per-node series with it.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hetnode.coordinator.daemon import Coordinator
from hetnode.coordinator.openai_api import RequestRecord

# From a few milliseconds (a short prompt on a fast pipeline) to minutes (a long generation over the wide area).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class CoordinatorMetrics:
    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("hetnode_requests", "Completion requests that ended, by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.ttft = Histogram("hetnode_request_ttft_seconds", "Time from a request's arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("hetnode_request_tpot_seconds",
                              "Time per output token after the first, per completed request", buckets=TPOT_BUCKETS,
                              registry=r)
        self.e2e = Histogram("hetnode_request_e2e_seconds", "Time from a completed request's arrival to its end",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("hetnode_prompt_tokens", "Prompt tokens of the requests served", registry=r)
        self.completion_tokens = Counter("hetnode_completion_tokens", "Tokens generated", registry=r)
        r.register(_Live(coordinator))

    def observe_request(self, record: RequestRecord) -> None:
        outcome = record.outcome
        self.requests.labels(record.endpoint, outcome).inc()
        self.prompt_tokens.inc(record.prompt_tokens if record.status == 200 else 0)
        self.completion_tokens.inc(record.completion_tokens)
        if record.time_to_first_token_s is not None:
            self.ttft.observe(record.time_to_first_token_s)
        if outcome == "completed":
            self.e2e.observe(record.duration_s)
            if record.tpot_s is not None:
                self.tpot.observe(record.tpot_s)


class _Live(Collector):
    """The coordinator's view at scrape time."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    def describe(self) -> Iterator[Metric]:
        return iter(())  # the families depend on the moment (members, links): not checked at registration

    def collect(self) -> Iterator[Metric]:
        c = self.coordinator
        reg = c.registry
        names = {p: r.name for p, r in reg.nodes.items()}
        node_labels = ["node", "peer", "region", "device"]
        up = GaugeMetricFamily("hetnode_node_up", "1 for a node that is up, 0 for one down, leaving or gone",
                               labels=[*node_labels, "state"])
        families = {
            "queued": GaugeMetricFamily("hetnode_node_queued_tokens", "Positions queued at a node (heartbeat)",
                                        labels=node_labels),
            "sessions": GaugeMetricFamily("hetnode_node_active_sessions", "Sessions holding KV at a node",
                                          labels=node_labels),
            "rate": GaugeMetricFamily("hetnode_node_tokens_per_second",
                                      "A node's moving average of positions per second over its steps",
                                      labels=node_labels),
            "blocks": GaugeMetricFamily("hetnode_node_kv_blocks", "A node's KV cache blocks, by state",
                                        labels=[*node_labels, "state"]),
        }
        expired = CounterMetricFamily("hetnode_node_kv_leases_expired",
                                      "Sessions a node freed because their lease ran out (since the node started)",
                                      labels=node_labels)
        for peer, record in sorted(reg.nodes.items()):
            labels = [record.name, str(peer), record.region, record.profile.device]
            up.add_metric([*labels, record.state], 1.0 if record.state == "up" else 0.0)
            if record.state != "up":
                continue
            load = record.load
            families["queued"].add_metric(labels, load.queued_tokens)
            families["sessions"].add_metric(labels, load.active_sessions)
            families["rate"].add_metric(labels, load.tokens_per_s)
            families["blocks"].add_metric([*labels, "used"], load.kv_blocks_used)
            families["blocks"].add_metric([*labels, "free"], load.kv_blocks_free)
            expired.add_metric(labels, load.leases_expired)
        yield up
        yield from families.values()
        yield expired

        bw = GaugeMetricFamily("hetnode_link_bandwidth_bits_per_second", "A directed link's bandwidth as probed",
                               labels=["src", "dst"])
        rtt = GaugeMetricFamily("hetnode_link_rtt_seconds", "A directed link's round-trip time as probed",
                                labels=["src", "dst"])
        for (src, dst), m in sorted(reg.links.items()):
            pair = [names.get(src, str(src)), names.get(dst, str(dst))]
            bw.add_metric(pair, m.bandwidth_mbps * 1e6)
            rtt.add_metric(pair, m.rtt_ms / 1000)
        yield bw
        yield rtt

        d = c.deployment
        if d is not None:
            version = GaugeMetricFamily("hetnode_plan_version", "Version of the newest plan (0: none yet)")
            version.add_metric([], d.plan.version if d.plan is not None else 0)
            yield version
            ready = GaugeMetricFamily("hetnode_plan_ready", "1 while a plan serves requests")
            ready.add_metric([], 1.0 if d.serving is not None else 0.0)
            yield ready
            queued = GaugeMetricFamily("hetnode_requests_queued",
                                       "Requests the serving plan's scheduler holds until a pipeline has room")
            queued.add_metric([], d.serving.scheduler.queue_len if d.serving is not None else 0)
            yield queued
            replans = CounterMetricFamily("hetnode_replans", "New plan versions, by what caused them",
                                          labels=["reason"])
            for kind, n in sorted(d.replans.items()):
                replans.add_metric([kind], n)
            yield replans
        g = c.generator
        if g is not None:
            inflight = GaugeMetricFamily("hetnode_requests_in_flight", "Requests being generated now")
            inflight.add_metric([], g.active_sessions)
            yield inflight
            moves = CounterMetricFamily("hetnode_request_moves", "Requests moved to another route, by how",
                                        labels=["kind"])
            moves.add_metric(["reprefill"], g.reroutes)
            moves.add_metric(["with_kv"], g.migrations)
            yield moves
            recomputed = CounterMetricFamily("hetnode_move_recomputed_tokens",
                                             "Positions computed again because a request moved: its whole context "
                                             "(reprefill), or what followed the KV it took along (with_kv)",
                                             labels=["kind"])
            recomputed.add_metric(["reprefill"], g.reprefilled_tokens)
            recomputed.add_metric(["with_kv"], g.recomputed_tokens)
            yield recomputed
            kv = CounterMetricFamily("hetnode_kv_transfer_bytes",
                                     "Packed KV bytes handed from one node to another, by codec (as the hops "
                                     "reported them when their sessions ended)", labels=["src", "dst", "codec"])
            for (src_name, dst_name, codec), n in sorted(g.kv_moved.items()):
                kv.add_metric([src_name, dst_name, codec], n)
            yield kv
            queued = CounterMetricFamily("hetnode_kv_queue_handoffs",
                                         "Hand-offs booked when they start (--decode-booking handoff, ThunderServe's "
                                         "KV queues), by whether the decode replica had room at the first token "
                                         "(at_once) or the prefill hops kept the KV until it had (waited)",
                                         labels=["start"])
            for start in ("at_once", "waited"):
                queued.add_metric([start], g.kv_queue[start])
            yield queued
            traces = GaugeMetricFamily("hetnode_traces_remembered", "Requests GET /v1/requests/{id} can show")
            traces.add_metric([], len(g.traces))
            yield traces
