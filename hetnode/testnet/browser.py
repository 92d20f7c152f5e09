"""A headless Chromium on GET /dashboard, for the dashboard's browser test and its screenshot script
(scripts/dashboard_screenshot.py): both drive the page with this code.

It uses the system's Chromium and chromedriver (Debian: `apt-get install chromium chromium-driver`) through
selenium, a test extra (`scripts/setup --test`); nothing is downloaded. `browser_missing` says why a browser
cannot be opened here, so a test can skip with that reason.

The page redraws every second by replacing its elements, so an element found in one call can be gone by the
next (selenium's StaleElementReferenceException). Everything here therefore reads the page in one script run
inside the browser (`snapshot`), which sees one consistent drawing.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

# One consistent view of the drawn page: the node cards and table rows by state, the regions, the counts of
# flows and plan-history rows, the stats panel's text and the connection status.
_SNAPSHOT_JS = """
const states = (sel) => Object.fromEntries([...document.querySelectorAll(sel)]
  .map((e) => [e.getAttribute("data-name"), e.getAttribute("data-state")]));
return {
  cards: states("#graph g.node[data-state]"),
  rows: states("#nodes tbody tr[data-state]"),
  regions: [...document.querySelectorAll("#graph .region")].map((e) => e.getAttribute("data-region")),
  flows: document.querySelectorAll("#graph path.edge.flow").length,
  history: document.querySelectorAll("#history tbody tr").length,
  stats: document.getElementById("stats").innerText,
  status: document.getElementById("status").getAttribute("data-state"),
  status_text: document.getElementById("status").textContent,
};
"""


def browser_missing() -> str | None:
    """Why no browser can be opened here, or None when one can."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (a test extra: scripts/setup --test)"
    if CHROMIUM is None or CHROMEDRIVER is None:
        return "no system Chromium and chromedriver (Debian: apt-get install chromium chromium-driver)"
    return None


def open_browser(width: int = 1400, height: int = 1000) -> Any:
    """A headless Chromium whose console log is kept (`driver.get_log("browser")`); quit it when done."""
    missing = browser_missing()
    if missing is not None:
        raise RuntimeError(missing)
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))


def snapshot(driver: Any) -> dict[str, Any]:
    result: dict[str, Any] = driver.execute_script(_SNAPSHOT_JS)
    return result


def wait_for(driver: Any, condition: Callable[[dict[str, Any]], bool], what: str, timeout_s: float) -> dict[str, Any]:
    """Wait (selenium's WebDriverWait: the condition is re-read until it holds) until `condition` holds on the
    page's snapshot, and return that snapshot; past `timeout_s`, fail naming `what`, with the last snapshot and
    the browser's console log, which is what tells why the page did not get there."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    last: list[dict[str, Any]] = []

    def holds(d: Any) -> dict[str, Any] | None:
        last[:] = [snapshot(d)]
        return last[0] if condition(last[0]) else None

    try:
        result: dict[str, Any] = WebDriverWait(driver, timeout_s).until(holds)
        return result
    except TimeoutException:
        raise AssertionError(f"the dashboard did not show {what} within {timeout_s:g} s; last drawn: "
                             f"{last[-1] if last else None}; console: {driver.get_log('browser')}") from None
