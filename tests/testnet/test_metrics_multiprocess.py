"""/metrics and traces on a multi-process testnet over libp2p (`testnet up --metrics`): a phase-split plan of a
tiny Llama, prefill on two nodes and decode on a third, the KV handed over in int8.

After serving requests, the coordinator's /metrics counts them, every node's own /metrics listener shows its steps,
the KV bytes the prefill nodes' listeners count equal the coordinator's per-link totals, and each request's trace
(by the X-Request-Id its answer carried) shows its two phases, the codec, and every hop's report.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_split_multiprocess import P2_D1, cluster_file
from testnet_helpers import start_testnet, stop_testnet

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7], list(range(20, 45)), list(range(100, 170))]


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    r = httpx.get(url, timeout=10)
    assert r.status_code == 200, r.text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def total(values: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in values.items() if n == name and set(labels.items()) <= ls)


def until(condition: Any, what: str, timeout_s: float = 30.0) -> None:
    """Poll a condition another process makes true (the nodes' heartbeats bring their reports), bounded."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s:g} s"
        time.sleep(0.2)


def test_metrics_and_traces_across_processes(tmp_path: Path) -> None:
    from hetnode.models.tiny import write_tiny_model

    model = str(write_tiny_model(tmp_path / "llama", "llama"))
    state_dir = tmp_path / "tn"
    state = start_testnet(state_dir, model, cluster=cluster_file(tmp_path / "cluster.toml", model, P2_D1),
                          extra=("--placement", "split", "--kv-codec", "int8", "--compute-dilation", "1",
                                 "--metrics"))
    try:
        api = state["api"]
        nodes = {p["name"]: p["metrics"] for p in state["procs"] if p["role"] == "node"}
        assert len(nodes) == 3 and all(url.startswith("http://127.0.0.1:") for url in nodes.values())
        ids = []
        for prompt in PROMPTS:
            r = httpx.post(f"{api}/v1/completions", timeout=300, json={
                "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            ids.append(r.headers["x-request-id"])

        def traced(rid: str) -> dict[str, Any]:
            r = httpx.get(f"{api}/v1/requests/{rid}", timeout=10)
            assert r.status_code == 200, r.text
            body: dict[str, Any] = r.json()
            return body

        def all_reported() -> bool:
            return all(len(s["hops"]) == sum(len(p["hops"]) for p in s["route"]["phases"])
                       for rid in ids for s in traced(rid)["sessions"])

        until(all_reported, "every hop's report reaching the coordinator")
        for rid in ids:
            trace = traced(rid)
            assert trace["status"] == "completed"
            [session] = trace["sessions"]
            assert [p["kind"] for p in session["route"]["phases"]] == ["prefill", "decode"]
            assert {k["codec"] for k in session["route"]["phases"][0]["kv_links"]} == {"int8"}
            assert all(h["steps"] >= 1 for h in session["hops"])

        coord = scrape(f"{api}/metrics")
        assert total(coord, "hetnode_requests_total", outcome="completed") == len(PROMPTS)
        assert total(coord, "hetnode_request_ttft_seconds_count") == len(PROMPTS)
        assert total(coord, "hetnode_node_up") == 3
        per_node = {name: scrape(f"{url}/metrics") for name, url in nodes.items()}
        assert all(total(s, "hetnode_node_step_seconds_count") >= 1 for s in per_node.values())
        sent = sum(total(s, "hetnode_node_kv_sent_bytes_total", codec="int8") for s in per_node.values())
        assert sent > 0 and total(coord, "hetnode_kv_transfer_bytes_total", codec="int8") == sent
        # Every node shows its links to the others as it measured them (once the probes are all in).
        r = httpx.get(f"{api}/v1/cluster", params={"min_links": 6, "timeout": 60}, timeout=70)
        assert r.json()["satisfied"], r.text
        # The coordinator's count includes the nodes' links to it, so a node may still be probing its peers.
        def peers_probed(url: str) -> int:
            return len([v for (n, ls), v in scrape(f"{url}/metrics").items()
                        if n == "hetnode_node_link_bandwidth_bits_per_second" and v > 0
                        and dict(ls)["peer_name"] in nodes])

        until(lambda: all(peers_probed(url) >= 2 for url in nodes.values()),
              "every node showing its links to the two others", timeout_s=90)
        until(lambda: all(total(scrape(f"{url}/metrics"), "hetnode_node_kv_blocks", state="used") == 0
                          for url in nodes.values()), "every node freeing its KV")
    finally:
        stop_testnet(state_dir)
