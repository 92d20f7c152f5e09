"""The node's /metrics listener: serves the node's own registry in the Prometheus text format, answers what it does
not serve with a clear status, and survives hostile clients (oversized, malformed, silent, too many at once)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from hetnode.cli import build_parser
from hetnode.node import metrics_http
from hetnode.node.metrics import LinkView, NodeMetrics, NodeView
from hetnode.planner.cluster import NodeSpec
from hetnode.protocol.messages import Load
from hetnode.testnet.launcher import join_args


def node_metrics() -> NodeMetrics:
    m = NodeMetrics()
    m.view = lambda: NodeView(Load(queued_tokens=7, kv_blocks_used=3, kv_blocks_free=5, leases_expired=2),
                              {"peerB": LinkView(bandwidth_mbps=100.0, rtt_ms=20.0)}, 4, {"peerB": "node-b"})
    m.observe_step(items=2, tokens=9, prefill=True, seconds=0.02)
    m.kv_sent.labels("peerB", "int8").inc(1234)
    return m


async def raw(host: str, port: int, data: bytes) -> bytes:
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        await stream.send_all(data)
        out = b""
        while chunk := await stream.receive_some(65536):
            out += chunk
        return out


async def test_serves_the_registry_and_refuses_the_rest(nursery: trio.Nursery) -> None:
    url = await nursery.start(metrics_http.serve_metrics, node_metrics().registry, "127.0.0.1", 0)
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        r = await client.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=")
        values = {(s.name, tuple(sorted(s.labels.items()))): s.value
                  for f in text_string_to_metric_families(r.text) for s in f.samples}
        assert values[("hetnode_node_queued_tokens", ())] == 7
        assert values[("hetnode_node_kv_blocks", (("state", "used"),))] == 3
        assert values[("hetnode_node_kv_leases_expired_total", ())] == 2
        assert values[("hetnode_node_plan_version", ())] == 4
        assert values[("hetnode_node_link_bandwidth_bits_per_second", (("peer", "peerB"), ("peer_name", "node-b")))] \
            == 100e6
        assert values[("hetnode_node_link_rtt_seconds", (("peer", "peerB"), ("peer_name", "node-b")))] == 0.02
        assert values[("hetnode_node_kv_sent_bytes_total", (("codec", "int8"), ("peer", "peerB")))] == 1234
        assert values[("hetnode_node_step_seconds_count", ())] == 1
        assert values[("hetnode_node_tokens_total", (("kind", "prefill"),))] == 9
        assert (await client.get("/healthz")).text == "ok\n"
        assert (await client.get("/other")).status_code == 404
        r = await client.post("/metrics", content=b"x")
        assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD"
    host, port = url.removeprefix("http://").rsplit(":", 1)
    assert (await raw(host, int(port), b"GARBAGE\r\n\r\n")).startswith(b"HTTP/1.1 400 ")
    huge = b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * (metrics_http.MAX_HEAD_BYTES + 10) + b"\r\n\r\n"
    assert (await raw(host, int(port), huge)).startswith(b"HTTP/1.1 431 ")
    assert (await raw(host, int(port), b"GET /metrics HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 200 ")


async def test_silent_clients_are_timed_out_and_extra_ones_refused(nursery: trio.Nursery,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # Real sockets: the real clock, with a short head timeout (a MockClock could jump while bytes are in flight).
    monkeypatch.setattr(metrics_http, "HEAD_TIMEOUT_S", 2.0)
    url = await nursery.start(metrics_http.serve_metrics, node_metrics().registry, "127.0.0.1", 0)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    silent = [await trio.open_tcp_stream(host, int(port)) for _ in range(metrics_http.MAX_CONNECTIONS)]
    await trio.testing.wait_all_tasks_blocked()
    # Every slot is taken by a client that says nothing: the next one is told so at once (it sends nothing
    # either, so that the answer is not lost to a reset when the listener closes without reading).
    assert (await raw(host, int(port), b"")).startswith(b"HTTP/1.1 503 ")
    # The silent ones are answered 408 once their time is up, and the listener serves again.
    for stream in silent:
        assert (await stream.receive_some(1024)).startswith(b"HTTP/1.1 408 ")
        await stream.aclose()
    await trio.testing.wait_all_tasks_blocked()
    assert (await raw(host, int(port), b"GET /metrics HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 200 ")


def test_testnet_metrics_give_every_node_a_listener_on_a_free_port(tmp_path: Path) -> None:
    args = build_parser().parse_args(["testnet", "up", "--metrics"])
    cmd = join_args(args, NodeSpec("n0", "cpu", "r1", 8.0), "/ip4/127.0.0.1/tcp/4001/p2p/x", tmp_path, [])
    assert build_parser().parse_args(cmd).metrics == "127.0.0.1:0"
    off = join_args(build_parser().parse_args(["testnet", "up"]), NodeSpec("n0", "cpu", "r1", 8.0), "/x", tmp_path,
                    [])
    assert build_parser().parse_args(off).metrics is None  # off by default
