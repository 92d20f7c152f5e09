"""docs/dashboard.png: a screenshot of GET /dashboard on a running `hetnode testnet up` (the shipped demo
cluster serving SmolLM2) after a few requests, taken in headless Chromium with the browser test's own code
(hetnode/testnet/browser.py).

    .venv/bin/python scripts/dashboard_screenshot.py [--out docs/dashboard.png] [--requests 6]

Needs the system's Chromium and chromedriver (Debian: apt-get install chromium chromium-driver) and selenium
(scripts/setup --test). The PNG is reduced to a 256-colour palette (the page is flat colours and text), which
keeps it small without blurring the text.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from PIL import Image

from hetnode.planner.cluster import load_cluster
from hetnode.testnet.browser import browser_missing, open_browser, wait_for
from hetnode.testnet.launcher import resolve_cluster_file

HETNODE = [sys.executable, "-m", "hetnode"]
KEY = "dashboard-shot"
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "What is 2 + 2?",
    "Name a large mammal.",
    "What color is the sky?",
]
WAIT_S = 300  # upper bound of each wait (the first request waits for the nodes to load their layers)


def ask(api: str, question: str) -> int:
    r = httpx.post(f"{api}/v1/chat/completions", timeout=WAIT_S, headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "smollm2-135m", "messages": [{"role": "user", "content": question}],
                         "max_tokens": 32, "temperature": 0})
    return r.status_code


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    p.add_argument("--requests", type=int, default=len(QUESTIONS), choices=range(1, len(QUESTIONS) + 1))
    args = p.parse_args()
    missing = browser_missing()
    if missing is not None:
        print(f"dashboard_screenshot: {missing}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="hetnode-shot-") as tmp:
        state_dir = Path(tmp) / "tn"
        up = subprocess.run([*HETNODE, "testnet", "up", "--cluster", "demo", "--model", "smollm2-135m", "--detach",
                             "--state-dir", str(state_dir), "--api-key", KEY], capture_output=True, text=True,
                            timeout=WAIT_S)
        if up.returncode != 0:
            print(up.stdout + up.stderr, file=sys.stderr)
            return 1
        try:
            api = next(line.split()[1] for line in up.stdout.splitlines() if line.startswith("API:"))
            # Every node measures its links before the picture, so the graph shows them.
            n = len(load_cluster(resolve_cluster_file("demo")).nodes)
            httpx.get(f"{api}/v1/cluster", params={"min_up": n, "min_links": n * (n + 1), "timeout": 60},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=90)
            # Two at a time: requests that overlap, as they do on a served cluster.
            with ThreadPoolExecutor(2) as pool:
                statuses = list(pool.map(lambda q: ask(api, q), QUESTIONS[:args.requests]))
            print(f"answers: {statuses}")
            driver = open_browser(1400, 1000)
            try:
                driver.get(f"{api}/dashboard#key={KEY}")
                done = statuses.count(200)
                wait_for(driver, lambda s: len(s["cards"]) == n and set(s["cards"].values()) == {"up"}
                         and s["flows"] > 0 and f"{done} completed" in s["stats"], "the cluster and its requests",
                         WAIT_S)
                # The whole page in one picture: a viewport as tall as the page (a window's height also counts
                # the browser's own bars, which headless Chromium leaves out of the picture).
                height = driver.execute_script("return document.documentElement.scrollHeight")
                driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                                       {"width": 1400, "height": height, "deviceScaleFactor": 1, "mobile": False})
                wait_for(driver, lambda s: s["status"] == "live", "a live page", WAIT_S)
                raw = Path(tmp) / "raw.png"
                driver.save_screenshot(str(raw))
            finally:
                driver.quit()
            args.out.parent.mkdir(parents=True, exist_ok=True)
            Image.open(raw).convert("RGB").quantize(colors=256).save(args.out, optimize=True)
            print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB)")
        finally:
            subprocess.run([*HETNODE, "testnet", "down", "--state-dir", str(state_dir)], capture_output=True,
                           timeout=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
