"""GET /dashboard and GET /v1/stats in process: the page is open and holds no data, the JSON is behind the key,
the page loads nothing from another origin, and the stats follow the registry and the requests' records."""

from __future__ import annotations

import re

import httpx
import trio

from hetnode.coordinator.api import build_app
from hetnode.coordinator.daemon import Coordinator, CoordinatorConfig
from hetnode.coordinator.dashboard import dashboard_routes
from hetnode.coordinator.live_stats import LiveStats
from hetnode.coordinator.openai_api import RequestRecord
from hetnode.node.daemon import NodeConfig, NodeDaemon
from hetnode.protocol.memory import MemoryNetwork
from hetnode.protocol.messages import HardwareProfile
from hetnode.protocol.probe import ProbeSettings

PROFILE = HardwareProfile(device="t4", device_type="t4", memory_bytes=16 << 30, matmul_tflops=65,
                          mem_bandwidth_gbps=300, dtype="float16", emulated=True)
AUTH = {"Authorization": "Bearer k3y"}


async def test_page_is_open_data_is_behind_the_key_and_stats_follow_the_cluster() -> None:
    net = MemoryNetwork()
    async with trio.open_nursery() as nursery, net.transport("coord") as ct, net.transport("n1") as nt:
        coord = Coordinator(CoordinatorConfig(token="t"), ct)
        await nursery.start(coord.run)
        live = LiveStats(trio.current_time)
        app = build_app(coord, api_key="k3y", extra_routes=dashboard_routes(coord, live))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
            page = await client.get("/dashboard")
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            csp = page.headers["content-security-policy"]
            assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "script-src 'self'" in csp
            # Every file the page names is served, without the key, with its type; nothing else is open.
            refs = re.findall(r'(?:src|href)="(/[^"]*)"', page.text)
            assert sorted(refs) == ["/dashboard/dashboard.css", "/dashboard/dashboard.js"]
            for ref, kind in zip(sorted(refs), ("text/css", "text/javascript"), strict=True):
                r = await client.get(ref)
                assert r.status_code == 200 and r.headers["content-type"].startswith(kind), ref
                assert "://" not in r.text.replace("http://www.w3.org/2000/svg", ""), f"{ref} names another origin"
            # The page's files are the only routes open beside /healthz, and the document says so.
            doc = (await client.get("/openapi.json", headers=AUTH)).json()
            open_paths = {path for path, ops in doc["paths"].items() if ops["get"].get("security") == []}
            assert open_paths == {"/dashboard", *refs, "/healthz"}
            assert (await client.get("/dashboard/other.js")).status_code == 401  # no other path is open
            r = await client.get("/v1/stats")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"

            s = (await client.get("/v1/stats", headers=AUTH)).json()
            assert s["serving"] is False and s["nodes"] == {"up": 0, "known": 0}
            assert s["requests"]["requests"] == 0 and s["kv"]["used_share"] == 0.0

            node = NodeDaemon(NodeConfig(bootstrap=("/memory/coord/p2p/coord",), token="t", name="n1",
                                         profile=PROFILE, region="us",
                                         probe=ProbeSettings(first_bytes=1024, max_bytes=2048)), nt)
            await nursery.start(node.run)
            assert (await client.get("/v1/cluster?min_up=1&timeout=30", headers=AUTH)).json()["satisfied"]
            live.observe_request(RequestRecord("chat.completions", 200, True, 12, 9, "stop", False, 0.25, 1.05))
            live.observe_request(RequestRecord("completions", 503, False, 12, 0, None, False, None, 0.1))
            s = (await client.get("/v1/stats", headers=AUTH)).json()
            assert s["nodes"] == {"up": 1, "known": 1}
            r = s["requests"]
            assert r["requests"] == 2 and r["outcomes"]["completed"] == 1 and r["outcomes"]["server_error"] == 1
            assert r["ttft_s"]["p50"] == 0.25 and abs(r["tpot_s"]["p50"] - 0.1) < 1e-9
            assert sum(b["requests"] for b in r["series"]) == 2
        nursery.cancel_scope.cancel()
