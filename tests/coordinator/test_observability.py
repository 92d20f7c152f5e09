"""/metrics and request traces on a live in-process network: a coordinator and two nodes over the memory transport,
real engines, a phase-split plan (prefill on one node, decode on the other, the KV handed over in int8).

After serving requests through the REST app, the coordinator's /metrics (parsed with prometheus_client's own text
parser) counts exactly the requests served, their tokens and latencies, and the KV bytes the prefill node says it
sent; each node's registry agrees; GET /v1/requests/{id} shows each request's route, phases, hops with their
steps and KV, and the codec chosen; every answer carries its X-Request-Id.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hetnode.coordinator.api import build_app, serve_api
from hetnode.coordinator.daemon import Coordinator, CoordinatorConfig
from hetnode.coordinator.dashboard import dashboard_routes
from hetnode.coordinator.deployment import PlanningConfig
from hetnode.coordinator.live_stats import LiveStats
from hetnode.coordinator.metrics import CoordinatorMetrics
from hetnode.coordinator.observe_api import observe_routes
from hetnode.coordinator.openai_api import openai_routes
from hetnode.coordinator.sessions import PipelineGenerator
from hetnode.models.resolve import load_config
from hetnode.models.tiny import write_tiny_model
from hetnode.models.tokenizer import load_tokenizer
from hetnode.node.daemon import NodeConfig, NodeDaemon
from hetnode.node.engine import EngineConfig
from hetnode.node.hops import HopServer
from hetnode.policy.kv_codec import KVCodecPolicy
from hetnode.protocol.memory import MemoryNetwork
from hetnode.protocol.messages import HardwareProfile
from hetnode.protocol.probe import ProbeSettings

KEY = "k3y"
PROMPTS = [[5, 6, 7, 8], list(range(20, 45)), [9] * 11]
MAX_TOKENS = 6
PROBE = ProbeSettings(first_bytes=1024, max_bytes=1024)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama") / "m", "llama")


@dataclass
class Live:
    coord: Coordinator
    gen: PipelineGenerator
    nodes: list[NodeDaemon]
    client: httpx.AsyncClient


@asynccontextmanager
async def split_network(model: Path) -> AsyncIterator[Live]:
    net = MemoryNetwork()
    cfg = load_config(model)
    profile = HardwareProfile(device="cpu", device_type="cpu", memory_bytes=8 << 30, matmul_tflops=0.1,
                              mem_bandwidth_gbps=30.0, dtype="float32")
    async with trio.open_nursery() as nursery, net.transport("coord") as ct:
        # Heartbeats every 0.2 s: the hops' reports reach the traces soon after a request ends.
        coord = Coordinator(CoordinatorConfig(token="t", heartbeat_interval_s=0.2, probe_interval_s=3600,
                                              probe=PROBE), ct)
        gen = coord.enable_serving(model=str(model), model_config=cfg, tokenizer=load_tokenizer(model),
                                   planning=PlanningConfig(method="split"))
        gen.kv_codecs = KVCodecPolicy("int8")  # a named codec: every hand-off moves its KV, in int8
        await nursery.start(coord.run)
        nodes: list[NodeDaemon] = []
        async with net.transport("n0") as t0, net.transport("n1") as t1:
            for name, t in (("n0", t0), ("n1", t1)):
                hops = HopServer(t, lambda peer, name=name: nodes[int(name[1])].is_member(peer),
                                 engine_config=EngineConfig(num_kv_blocks=256, block_size=4))
                node = NodeDaemon(NodeConfig(bootstrap=("/memory/coord/p2p/coord",), token="t", name=name,
                                             profile=profile, probe=PROBE), t, hops)
                nodes.append(node)
                await nursery.start(hops.run)
                await nursery.start(node.run)
            assert coord.deployment is not None
            plan = await coord.deployment.wait_ready(30)
            assert plan is not None and plan.placement.method == "split"
            metrics = CoordinatorMetrics(coord)
            live = LiveStats(trio.current_time)  # the dashboard's, fed beside /metrics as `hetnode coordinator` does
            app = build_app(coord, api_key=KEY, extra_routes=[*openai_routes(gen, metrics=[metrics, live]),
                                                              *observe_routes(metrics, gen),
                                                              *dashboard_routes(coord, live)])
            # Served by hypercorn over TCP, as `hetnode coordinator` does (its disconnect events differ from
            # httpx's ASGI transport's: a finished answer must not count as a client that left).
            url = await nursery.start(serve_api, app, "127.0.0.1", 0)
            async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"},
                                         timeout=60) as client:
                yield Live(coord, gen, nodes, client)
        nursery.cancel_scope.cancel()


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a scrape, by name and labels (prometheus_client's parser: the format must be right)."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(scrape: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in scrape.items() if n == name and set(labels.items()) <= ls)


def reported(gen: PipelineGenerator, rid: str) -> bool:
    """Every hop of every session of the request has reported (its heartbeat came)."""
    trace = gen.traces.get(rid)
    return trace is not None and trace.status != "running" and all(
        len(s.hops) == sum(len(p["hops"]) for p in s.route["phases"]) for s in trace.sessions)


async def test_metrics_and_traces_follow_the_requests_served(tiny_model: Path) -> None:
    async with split_network(tiny_model) as live:
        client, gen = live.client, live.gen
        ids: list[str] = []
        usage = 0
        for i, prompt in enumerate(PROMPTS):
            headers = {"X-Request-Id": "client-id.1"} if i == 0 else {}
            body: dict[str, Any] = {"model": gen.model_name, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                    "temperature": 0}
            if i == 2:  # a streamed one: its id is in the headers sent at the first token
                body |= {"stream": True, "stream_options": {"include_usage": True}}
            r = await client.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
            rid = r.headers["x-request-id"]
            if i == 0:
                assert rid == "client-id.1"  # a well-formed id of the client's is kept
            ids.append(rid)
            if i == 2:
                chunks = [line for line in r.text.splitlines() if line.startswith("data: {")]
                usage += httpx.Response(200, content=chunks[-1][6:]).json()["usage"]["completion_tokens"]
            else:
                usage += r.json()["usage"]["completion_tokens"]
        assert len(set(ids)) == len(ids)
        assert await live.coord.wait_until(lambda: all(reported(gen, rid) for rid in ids), 20)

        kv_in_traces = 0
        for rid in ids:
            r = await client.get(f"/v1/requests/{rid}")
            assert r.status_code == 200, r.text
            trace = r.json()
            assert trace["id"] == rid and trace["status"] == "completed" and trace["moves"] == []
            assert trace["completion_tokens"] >= 1 and trace["time_to_first_token_s"] > 0
            assert all(trace["phases"][k] is not None for k in ("queue_s", "prefill_s", "decode_s"))
            [session] = trace["sessions"]
            assert [p["kind"] for p in session["route"]["phases"]] == ["prefill", "decode"]
            assert {k["codec"] for k in session["route"]["phases"][0]["kv_links"]} == {"int8"}
            by_phase = {h["phase"]: h for h in session["hops"]}
            assert by_phase[0]["steps"] >= 1 and by_phase[0]["step_s"] > 0 and by_phase[0]["end"] == "handed_over"
            assert by_phase[1]["kv_received_bytes"] > 0 and by_phase[1]["kv_wait_s"] > 0
            sent = by_phase[0]["kv_sent"]
            assert sent and {k["codec"] for k in sent} == {"int8"} and all(k["bytes"] > 0 for k in sent)
            assert sum(k["bytes"] for k in sent) == by_phase[1]["kv_received_bytes"]
            kv_in_traces += sum(k["bytes"] for k in sent)

        r = await client.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        scrape = samples(r.text)
        assert total(scrape, "hetnode_requests_total", endpoint="completions", outcome="completed") == len(PROMPTS)
        assert total(scrape, "hetnode_requests_total") == len(PROMPTS)
        # The dashboard's stats saw the same records, by the same outcomes.
        stats = (await client.get("/v1/stats")).json()["requests"]
        assert stats["totals"] == {"completed": len(PROMPTS), "cancelled": 0, "client_error": 0, "server_error": 0}
        assert stats["ttft_s"]["p50"] is not None
        assert total(scrape, "hetnode_request_ttft_seconds_count") == len(PROMPTS)
        assert total(scrape, "hetnode_request_e2e_seconds_count") == len(PROMPTS)
        assert total(scrape, "hetnode_completion_tokens_total") == usage
        assert total(scrape, "hetnode_prompt_tokens_total") == sum(len(p) for p in PROMPTS)
        assert total(scrape, "hetnode_kv_transfer_bytes_total", codec="int8") == kv_in_traces > 0
        assert total(scrape, "hetnode_node_up") == 2
        assert total(scrape, "hetnode_requests_in_flight") == 0
        version = total(scrape, "hetnode_plan_version")
        assert version >= 1 and total(scrape, "hetnode_replans_total") == version
        assert total(scrape, "hetnode_request_moves_total") == 0

        # Each node's own registry: the prefill node sent exactly the KV the coordinator counted.
        node_scrapes = [samples(generate_latest(n.hops.metrics.registry).decode())  # type: ignore[union-attr]
                        for n in live.nodes]
        assert sum(total(s, "hetnode_node_kv_sent_bytes_total", codec="int8") for s in node_scrapes) == kv_in_traces
        assert sum(total(s, "hetnode_node_kv_received_bytes_total") for s in node_scrapes) == kv_in_traces
        assert all(total(s, "hetnode_node_step_seconds_count") >= 1 for s in node_scrapes)
        assert all(total(s, "hetnode_node_plan_version") == version for s in node_scrapes)
        assert all(total(s, "hetnode_node_kv_blocks", state="used") == 0 for s in node_scrapes)

        # Unknown and malformed ids, and the key: OpenAI's error shape, with an id on every answer.
        r = await client.get("/v1/requests/no-such-request")
        assert r.status_code == 404 and r.json()["error"]["code"] == "request_not_found"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"} and r.headers["x-request-id"]
        r = await client.get("/v1/requests/bad%20id")
        assert r.status_code == 400 and r.json()["error"]["param"] == "id"
        r = await client.get("/metrics", headers={"Authorization": "Bearer wrong", "X-Request-Id": "x" * 200})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert len(r.headers["x-request-id"]) == 32  # the malformed id was replaced by a fresh one
