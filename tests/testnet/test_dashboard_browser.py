"""GET /dashboard in a real headless Chromium against a live multi-process testnet (the shipped demo cluster,
a tiny model): the page shows every node in its region, the plan's flows and history, a completed request in
the stats, a node that leaves as gone, and the browser's console logs no error. Skipped where selenium or the
system's Chromium and chromedriver are missing (Debian: `apt-get install chromium chromium-driver`)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest
from testnet_helpers import start_testnet, stop_testnet

from hetnode.models.tiny import write_tiny_model
from hetnode.planner.cluster import load_cluster
from hetnode.testnet.browser import browser_missing, open_browser, wait_for
from hetnode.testnet.launcher import resolve_cluster_file

pytestmark = pytest.mark.slow

KEY = "dash-k3y"
# The upper bound of each wait on the page (it polls every second), not an expected duration: generous, since
# the testnet's processes share a loaded machine.
PAGE_WAIT_S = 90


def test_dashboard_shows_the_live_cluster_in_chromium(tmp_path: Path) -> None:
    missing = browser_missing()
    if missing is not None:
        pytest.skip(missing)
    cluster = load_cluster(resolve_cluster_file("demo"))
    names = sorted(n.name for n in cluster.nodes)
    model = write_tiny_model(tmp_path / "llama", "llama")
    state = start_testnet(tmp_path / "tn", str(model), cluster=resolve_cluster_file("demo"),
                          extra=("--api-key", KEY))
    driver = open_browser()
    try:
        api = state["api"]
        driver.get(f"{api}/dashboard#key={KEY}")
        page = wait_for(driver, lambda p: p["cards"] == dict.fromkeys(names, "up"), "every node up", PAGE_WAIT_S)
        assert "#" not in driver.current_url  # the key left the address bar
        # Each node sits in its region's band; the plan's flows and its history show once there is a plan.
        assert set(page["regions"]) == {n.region for n in cluster.nodes}
        wait_for(driver, lambda p: p["flows"] > 0 and p["history"] > 0, "the plan's flows and history", PAGE_WAIT_S)

        r = httpx.post(f"{api}/v1/completions", timeout=120, headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": str(model), "prompt": [1, 2, 3, 4], "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        # A whole answer that the client read and then closed its connection on is a completed request, not one
        # whose client left (hypercorn reports that close to the route as a disconnect).
        page = wait_for(driver, lambda p: "1 completed" in p["stats"], "one completed request", PAGE_WAIT_S)
        assert "0 failed" in page["stats"] and "0 left" in page["stats"], page["stats"]

        victim = names[-1]
        os.kill(next(int(p["pid"]) for p in state["procs"] if p["name"] == victim), signal.SIGTERM)
        page = wait_for(driver, lambda p: p["cards"].get(victim) in ("left", "down")
                        and p["rows"].get(victim) in ("left", "down"), f"{victim} gone", PAGE_WAIT_S)
        assert all(s == "up" for n, s in page["cards"].items() if n != victim), page["cards"]
        assert page["status"] == "live", page["status_text"]

        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
    finally:
        driver.quit()
        stop_testnet(tmp_path / "tn")
