"""A discrete-event simulator of hetnode serving at paper scale (Helix §6.1's simulator, Splitwise §V-B's).

It models compute nodes (per-step time from a profile table, the runtime's dynamic batching, KV memory),
directed links (alpha-beta with a FIFO queue each) and the coordinator, which runs the runtime's own scheduler
object on the simulated clock over a plan from the runtime's planner. `simulate` runs one experiment;
`hetnode sim` is its command line. docs/simulator.md describes the model and its approximations.

The names below load lazily, so that `hetnode`'s argument parser can import `hetnode.testnet.sim.cli`
without numpy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hetnode.testnet.sim.metrics import LinkStats, NodeStats, RequestRecord, SimResult, TimeSeries
    from hetnode.testnet.sim.runner import SCHEDULERS, SimOptions, simulate
    from hetnode.testnet.sim.workload import (
        Trace,
        Workload,
        helix_online_rate,
        load_azure_trace,
        load_trace,
        offline,
        poisson,
        replay,
        sampled,
    )

_WHERE = {
    **dict.fromkeys(("LinkStats", "NodeStats", "RequestRecord", "SimResult", "TimeSeries"), "metrics"),
    **dict.fromkeys(("SCHEDULERS", "SimOptions", "simulate"), "runner"),
    **dict.fromkeys(("Trace", "Workload", "helix_online_rate", "load_azure_trace", "load_trace", "offline",
                     "poisson", "replay", "sampled"), "workload"),
}

__all__ = [
    "SCHEDULERS",
    "LinkStats",
    "NodeStats",
    "RequestRecord",
    "SimOptions",
    "SimResult",
    "TimeSeries",
    "Trace",
    "Workload",
    "helix_online_rate",
    "load_azure_trace",
    "load_trace",
    "offline",
    "poisson",
    "replay",
    "sampled",
    "simulate",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
