"""The REST API in process: API key, error shape, body limits, the cluster view and the plan, and their long-polls."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from hetnode.coordinator.api import build_app
from hetnode.coordinator.daemon import Coordinator, CoordinatorConfig
from hetnode.models.resolve import load_config
from hetnode.models.tiny import write_tiny_model
from hetnode.models.tokenizer import load_tokenizer
from hetnode.node.daemon import NodeConfig, NodeDaemon
from hetnode.node.engine import EngineConfig
from hetnode.node.hops import HopServer
from hetnode.protocol.memory import MemoryNetwork
from hetnode.protocol.messages import HardwareProfile
from hetnode.protocol.probe import ProbeSettings

PROFILE = HardwareProfile(device="l4", device_type="l4", memory_bytes=24 << 30, matmul_tflops=242,
                          mem_bandwidth_gbps=300, dtype="float16", emulated=True)


async def test_api_key_error_shape_and_cluster_view() -> None:
    net = MemoryNetwork()
    async with trio.open_nursery() as nursery, net.transport("coord") as ct, net.transport("n1") as nt:
        coord = Coordinator(CoordinatorConfig(token="t"), ct)
        await nursery.start(coord.run)
        app = build_app(coord, api_key="k3y")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
            assert (await client.get("/healthz")).status_code == 200  # open, for load balancers
            r = await client.get("/v1/cluster")
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert "missing API key" in r.json()["error"]["message"]
            r = await client.get("/v1/cluster", headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401 and "invalid API key" in r.json()["error"]["message"]
            auth = {"Authorization": "Bearer k3y"}
            r = await client.get("/v1/nope", headers=auth)
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
            r = await client.post("/v1/cluster", headers=auth)
            assert r.status_code == 405 and "error" in r.json()
            r = await client.get("/v1/cluster?min_up=x", headers=auth)
            assert r.status_code == 400 and "bad query parameter" in r.json()["error"]["message"]
            r = await client.get("/v1/cluster?min_ups=1", headers=auth)  # misspelt: refused, not ignored
            assert r.status_code == 400 and "unknown query parameter(s): min_ups" in r.json()["error"]["message"]
            r = await client.post("/v1/cluster", headers={**auth, "Content-Length": str(64 << 20)}, content=b"")
            assert r.status_code == 413

            node = NodeDaemon(NodeConfig(bootstrap=("/memory/coord/p2p/coord",), token="t", name="n1",
                                         profile=PROFILE, region="eu",
                                         probe=ProbeSettings(first_bytes=1024, max_bytes=2048)), nt)
            await nursery.start(node.run)
            # Long-poll: returns once the node's link to the coordinator is measured, no sleeping here.
            r = await client.get("/v1/cluster?min_up=1&min_links=1&timeout=30", headers=auth)
            view = r.json()
            assert r.status_code == 200 and view["satisfied"] is True
            (n,) = view["nodes"]
            assert n["name"] == "n1" and n["state"] == "up" and n["region"] == "eu"
            assert n["profile"]["device"] == "l4" and n["profile"]["emulated"] is True
            (link,) = view["links"]
            assert link["src_name"] == "n1" and link["dst_name"] == "coordinator"
            assert link["bandwidth_mbps"] > 0 and link["rtt_ms"] >= 0
            r = await client.get("/v1/cluster?max_up=0&timeout=0.2", headers=auth)
            assert r.json()["satisfied"] is False
        nursery.cancel_scope.cancel()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama") / "m", "llama")


@asynccontextmanager
async def serving_api(nursery: trio.Nursery, transport: Any, model: Path,
                      **config: Any) -> AsyncIterator[httpx.AsyncClient]:
    """A coordinator serving `model` on `transport`, and a client of its REST API (API key "k3y")."""
    coord = Coordinator(CoordinatorConfig(token="t", **config), transport)
    coord.enable_serving(model=str(model), model_config=load_config(model), tokenizer=load_tokenizer(model))
    await nursery.start(coord.run)
    app = build_app(coord, api_key="k3y")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
        yield client


async def test_replan_endpoint_is_admin_and_checks_its_body(tiny_model: Path) -> None:
    net = MemoryNetwork()
    async with trio.open_nursery() as nursery, net.transport("coord") as ct:
        auth = {"Authorization": "Bearer k3y"}
        async with serving_api(nursery, ct, tiny_model) as client:
            assert (await client.post("/v1/plan", json={"method": "petals"})).status_code == 401
            r = await client.post("/v1/plan", json={"method": "magic"}, headers=auth)
            assert r.status_code == 400 and "unknown method 'magic'" in r.json()["error"]["message"]
            r = await client.post("/v1/plan", content=b"{not json", headers=auth)
            assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
            r = await client.post("/v1/plan", json={"method": "helix", "extra": 1}, headers=auth)
            assert r.status_code == 400
            r = await client.post("/v1/plan", json={"method": "petals", "reason": "try petals"}, headers=auth)
            assert r.status_code == 409 and "no nodes are up" in r.json()["error"]["message"]
            r = await client.get("/v1/plan", headers=auth)
            assert r.status_code == 200 and r.json()["plan"] is None and "no nodes" in r.json()["problem"]
        nursery.cancel_scope.cancel()


async def test_plan_long_poll_waits_for_a_ready_plan_and_checks_its_query(tiny_model: Path) -> None:
    net = MemoryNetwork()
    cpu = HardwareProfile(device="cpu", device_type="cpu", memory_bytes=8 << 30, matmul_tflops=0.1,
                          mem_bandwidth_gbps=30.0, dtype="float32")
    probe = ProbeSettings(first_bytes=1024, max_bytes=1024)
    async with trio.open_nursery() as nursery, net.transport("coord") as ct, net.transport("n1") as nt:
        auth = {"Authorization": "Bearer k3y"}
        async with serving_api(nursery, ct, tiny_model, probe=probe) as client:
            for query, why in (("ready=maybe", "ready must be true or false"), ("min_nodes=x", "bad query parameter"),
                               ("timeout=61", "timeout must be between 0 and 60"),
                               ("min_node=1", "unknown query parameter(s): min_node")):
                r = await client.get(f"/v1/plan?{query}", headers=auth)
                assert r.status_code == 400 and why in r.json()["error"]["message"], (query, r.text)
            r = await client.get("/v1/plan?ready=true&timeout=0.2", headers=auth)  # no node: no plan by then
            assert r.status_code == 200 and r.json()["satisfied"] is False and r.json()["plan"] is None
            assert (await client.get("/v1/plan", headers=auth)).json()["satisfied"] is True  # nothing asked

            hops = HopServer(nt, lambda peer: node.is_member(peer),
                             engine_config=EngineConfig(num_kv_blocks=64, block_size=4))
            node = NodeDaemon(NodeConfig(bootstrap=("/memory/coord/p2p/coord",), token="t", name="n1",
                                         profile=cpu, probe=probe), nt, hops)
            await nursery.start(hops.run)
            await nursery.start(node.run)
            # One request, no polling: it returns when the node has loaded its shard.
            r = await client.get("/v1/plan?ready=true&min_nodes=1&min_version=1&timeout=30", headers=auth)
            view = r.json()
            assert r.status_code == 200 and view["satisfied"] is True, view
            assert view["plan"]["ready"] is True and view["plan"]["version"] >= 1
            assert {s["name"] for s in view["plan"]["shards"]} == {"n1"}
            version = view["plan"]["version"]
            r = await client.get(f"/v1/plan?min_version={version + 1}&timeout=0.2", headers=auth)
            assert r.json()["satisfied"] is False and r.json()["plan"]["version"] == version
            r = await client.get("/v1/plan?min_nodes=2&timeout=0.2", headers=auth)
            assert r.json()["satisfied"] is False
            # Its real KV pool comes with a heartbeat after its ready report: the scheduler counts it from then.
            r = await client.get("/v1/plan?kv_reported=true&timeout=30", headers=auth)
            assert r.json()["satisfied"] is True and r.json()["plan"]["kv_reported"] is True
        nursery.cancel_scope.cancel()
