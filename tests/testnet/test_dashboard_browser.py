"""GET /dashboard in a real headless Chromium against a live multi-process testnet (the shipped demo cluster,
a tiny model): the page shows every node, a node that leaves shows as gone within seconds, a request shows in
the stats, and the browser's console logs no error. Skipped where Debian's chromium and chromium-driver are
missing (`apt-get install chromium chromium-driver`; scripts/setup --test installs them where it can)."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from testnet_helpers import start_testnet, stop_testnet

from hetnode.models.tiny import write_tiny_model
from hetnode.planner.cluster import load_cluster
from hetnode.testnet.launcher import resolve_cluster_file

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is a test dependency: scripts/setup --test")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
KEY = "dash-k3y"
# Upper bounds of the waits on the page, not expected durations: the page polls every second.
PAGE_WAIT_S = 60
LEAVE_WAIT_S = 10


def open_browser() -> Any:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("no system Chromium and chromedriver (Debian: apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))


def node_states(driver: Any) -> dict[str, str]:
    cards = driver.find_elements(By.CSS_SELECTOR, "#graph g.node[data-state]")
    return {c.get_attribute("data-name"): c.get_attribute("data-state") for c in cards}


def test_dashboard_shows_the_live_cluster_in_chromium(tmp_path: Path) -> None:
    driver = open_browser()
    cluster_file = resolve_cluster_file("demo")
    names = sorted(n.name for n in load_cluster(cluster_file).nodes)
    model = write_tiny_model(tmp_path / "llama", "llama")
    state = start_testnet(tmp_path / "tn", str(model), cluster=cluster_file, extra=("--api-key", KEY))
    try:
        api = state["api"]
        driver.get(f"{api}/dashboard#key={KEY}")
        wait = WebDriverWait(driver, PAGE_WAIT_S)
        wait.until(lambda d: node_states(d) == dict.fromkeys(names, "up"))
        assert "#" not in driver.current_url  # the key left the address bar
        # The graph places each node in its region's band, and draws the plan's flows once there is a plan.
        regions = {e.get_attribute("data-region") for e in driver.find_elements(By.CSS_SELECTOR, "#graph .region")}
        assert regions == {n.region for n in load_cluster(cluster_file).nodes}
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#graph path.edge.flow"))
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#history tbody tr"))

        r = httpx.post(f"{api}/v1/completions", timeout=120, headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": str(model), "prompt": [1, 2, 3, 4], "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        wait.until(lambda d: "1 ok" in d.find_element(By.ID, "stats").text)

        victim = names[-1]
        os.kill(next(int(p["pid"]) for p in state["procs"] if p["name"] == victim), signal.SIGTERM)
        WebDriverWait(driver, LEAVE_WAIT_S).until(lambda d: node_states(d).get(victim) in ("left", "down"))
        assert all(s == "up" for n, s in node_states(driver).items() if n != victim)
        row = driver.find_element(By.CSS_SELECTOR, f'#nodes tr[data-name="{victim}"]')
        assert row.get_attribute("data-state") in ("left", "down")
        assert driver.find_element(By.ID, "status").get_attribute("data-state") == "live"

        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
    finally:
        driver.quit()
        stop_testnet(tmp_path / "tn")
