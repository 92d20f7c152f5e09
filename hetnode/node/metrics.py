"""A node's Prometheus metrics: one registry per node (never the process-global one), so that several nodes in one
process (the in-process tests, the testnet's) keep apart.

Events are counted where they happen (a step, a KV frame sent or received, a session ending); what the node holds
at a moment (queue, KV blocks, rates, links as probed, the plan version) is read when the registry is scraped, so
a scrape always shows the present and no gauge can go stale. `hetnode join --metrics ADDR` serves the registry
(metrics_http.py); without it the counters cost a few increments per step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hetnode.protocol.messages import Load

# Steps last from a millisecond (a decode step of a small shard) to seconds (a long prompt on a slow device).
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class LinkView:
    """One link from this node as last probed."""

    bandwidth_mbps: float
    rtt_ms: float


@dataclass(frozen=True)
class NodeView:
    """What the node holds now, for a scrape (NodeDaemon fills it in; a bare HopServer reports its load only)."""

    load: Load
    links: Mapping[str, LinkView]
    plan_version: int | None
    peer_names: Mapping[str, str]


class NodeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.step_seconds = Histogram("hetnode_node_step_seconds", "Duration of one batch step of this node's shard",
                                      buckets=STEP_BUCKETS, registry=r)
        self.batch_tokens = Histogram("hetnode_node_batch_tokens", "Positions one batch step ran",
                                      buckets=SIZE_BUCKETS, registry=r)
        self.batch_items = Histogram("hetnode_node_batch_items", "Items (sessions' pieces) one batch step ran",
                                     buckets=SIZE_BUCKETS, registry=r)
        self.tokens = Counter("hetnode_node_tokens", "Positions this node's steps ran", ["kind"], registry=r)
        self.kv_sent = Counter("hetnode_node_kv_sent_bytes", "Packed KV bytes handed to other hops",
                               ["peer", "codec"], registry=r)
        self.kv_received = Counter("hetnode_node_kv_received_bytes", "Packed KV bytes received from other hops",
                                   ["peer", "codec"], registry=r)
        self.sessions_ended = Counter("hetnode_node_sessions_ended", "Sessions that ended on this hop, by how",
                                      ["end"], registry=r)
        self.view: Callable[[], NodeView] | None = None
        r.register(_Live(self))

    def observe_step(self, items: int, tokens: int, prefill: bool, seconds: float) -> None:
        self.step_seconds.observe(seconds)
        self.batch_tokens.observe(tokens)
        self.batch_items.observe(items)
        self.tokens.labels("prefill" if prefill else "decode").inc(tokens)


class _Live(Collector):
    """The node's state at scrape time."""

    def __init__(self, metrics: NodeMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> Iterator[Metric]:
        return iter(())  # the families depend on the moment (links, plan): not checked at registration

    def collect(self) -> Iterator[Metric]:
        view_of = self.metrics.view
        if view_of is None:
            return
        view = view_of()
        load = view.load
        yield _gauge("hetnode_node_queued_tokens", "Positions queued for this node's batch loop", load.queued_tokens)
        yield _gauge("hetnode_node_active_sessions", "Sessions holding KV on this node", load.active_sessions)
        blocks = GaugeMetricFamily("hetnode_node_kv_blocks", "KV cache blocks of this node's shard, by state",
                                   labels=["state"])
        blocks.add_metric(["used"], load.kv_blocks_used)
        blocks.add_metric(["free"], load.kv_blocks_free)
        yield blocks
        yield _gauge("hetnode_node_tokens_per_second", "Moving average of positions per second over steps",
                     load.tokens_per_s)
        yield _gauge("hetnode_node_prefill_tokens_per_second",
                     "Moving average of positions per second over steps that prefill", load.prefill_tokens_per_s)
        expired = CounterMetricFamily("hetnode_node_kv_leases_expired",
                                      "Sessions freed because their coordinator stopped renewing their lease")
        expired.add_metric([], load.leases_expired)
        yield expired
        if view.plan_version is not None:
            yield _gauge("hetnode_node_plan_version", "Plan version of this node's assignment", view.plan_version)
        bw = GaugeMetricFamily("hetnode_node_link_bandwidth_bits_per_second",
                               "Bandwidth to a peer, as last probed", labels=["peer", "peer_name"])
        rtt = GaugeMetricFamily("hetnode_node_link_rtt_seconds", "Round-trip time to a peer, as last probed",
                                labels=["peer", "peer_name"])
        for peer, link in sorted(view.links.items()):
            labels = [peer, view.peer_names.get(peer, "")]
            bw.add_metric(labels, link.bandwidth_mbps * 1e6)
            rtt.add_metric(labels, link.rtt_ms / 1000)
        yield bw
        yield rtt


def _gauge(name: str, doc: str, value: float, labels: Sequence[str] = ()) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    family.add_metric([], value)
    return family
