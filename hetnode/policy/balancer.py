"""Join the least-loaded: the NoDG and FuDG baselines' load balancer (EcoServe §4.1's vLLM, Sarathi, DistServe
and MoonCake deployments each spread requests over identical instances by their load).

Pure: the loads are the caller's measure (requests held, KV tokens); ties go to the lowest index, so a run is
deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence


def least_loaded(loads: Sequence[float]) -> int:
    """The index of the smallest load."""
    if not loads:
        raise ValueError("no instance to choose from")
    return min(range(len(loads)), key=lambda k: (loads[k], k))
