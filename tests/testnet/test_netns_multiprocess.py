"""`hetnode testnet up --netns`: every process in its own network namespace on a bridge, bandwidth limited by the
kernel (tc htb). The nodes join over those addresses, the probes measure the kernel's rates, SmolLM2 is served,
and `testnet down` removes every namespace, veth and the bridge."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx
import pytest
from testnet_helpers import start_testnet, stop_testnet

from hetnode.testnet.netns import netns_problem

pytestmark = pytest.mark.slow

# Low rates, so that the kernel and not the CPU (py-libp2p's Noise runs in Python) is what limits a probe, even
# on a loaded machine.
CLUSTER = """
name = "netns2"
description = "2 cpu nodes in two regions; 8 Mbit/s between regions, 24 Mbit/s inside one"

[coordinator]
region = "a"

[[nodes]]
name = "node-0"
device = "cpu"
region = "a"

[[nodes]]
name = "node-1"
device = "cpu"
region = "b"

[links.default]
bandwidth_mbps = 8.0
latency_ms = 1.0

[links.intra_region]
bandwidth_mbps = 24.0
latency_ms = 0.5
"""
WANT = {("coordinator", "node-0"): 24.0, ("node-0", "coordinator"): 24.0}  # the rest: 8


@pytest.mark.alone
def test_netns_testnet_serves_and_probes_measure_the_kernel_rates(tmp_path: Path) -> None:
    problem = netns_problem()
    if problem:
        pytest.skip(f"network namespaces unavailable: {problem}")
    cluster = tmp_path / "netns2.toml"
    cluster.write_text(CLUSTER)
    state_dir = tmp_path / "tn"
    # Probe rounds every 10 s: the first ones compete with loading the shards, a later one reads the kernel rates.
    state = start_testnet(state_dir, "smollm2-135m", cluster=cluster, extra=("--netns", "--probe-interval", "10"))
    tag = state["netns"]["tag"]
    try:
        api = state["api"]
        assert api.startswith("http://10.231.") and state["bootstrap"].startswith("/ip4/10.231.")
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert sum(f"hn{tag}-" in line for line in names.splitlines()) == 3
        deadline = time.monotonic() + 240
        text = ""
        while time.monotonic() < deadline:  # a client-side deadline: 503 until the first plan is ready
            r = httpx.post(f"{api}/v1/completions", timeout=60, json={
                "model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
            if r.status_code == 200:
                text = r.json()["choices"][0]["text"]
                break
            assert r.status_code == 503, r.text
            time.sleep(0.5)
        assert "Paris" in text
        # The links are re-probed on every membership change and every probe interval; loading shards competes
        # for the CPU with the first probes, so wait for a round in which every link reads its kernel rate.
        measured: dict[tuple[str, str], float] = {}
        while time.monotonic() < deadline:
            view = httpx.get(f"{api}/v1/cluster", timeout=10).json()
            measured = {(lk["src_name"], lk["dst_name"]): lk["bandwidth_mbps"] for lk in view["links"]}
            if len(measured) == 6 and all(abs(bw / WANT.get(k, 8.0) - 1) <= 0.15 for k, bw in measured.items()):
                break
            time.sleep(2)
        print("probed Mbit/s:", {f"{a}->{b}": round(bw, 1) for (a, b), bw in sorted(measured.items())})
        assert len(measured) == 6, measured
        for key, bw in measured.items():
            assert abs(bw / WANT.get(key, 8.0) - 1) <= 0.15, (key, bw, measured)
    finally:
        stop_testnet(state_dir)
    left = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"hv{tag}" not in left and f"hnb{tag}" not in left
    assert f"hn{tag}-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
