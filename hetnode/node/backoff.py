"""How long a node waits before it tries again to join: exponential backoff, capped, with jitter.

The doubling finds a coordinator that is back within a second of a short blip without hammering one that is
down for long; the cap keeps a node that has waited many minutes from sleeping through a coordinator's return
for many more; the jitter spreads out the nodes of a cluster that all lost the coordinator at the same moment,
so that a restarted coordinator is not hit by every join at once (and not again at every doubling).
"""

from __future__ import annotations

JITTER = 0.25  # each wait is its nominal length times a factor in [1 - JITTER, 1 + JITTER)


def backoff_delay(attempt: int, *, initial_s: float, max_s: float, u: float) -> float:
    """The wait before retry `attempt` (0 for the first): initial_s x 2^attempt, at most max_s, scaled by a
    jitter factor that `u` in [0, 1) picks (pass `random.random()`)."""
    if attempt < 0 or not 0 <= u < 1:
        raise ValueError(f"need attempt >= 0 and u in [0, 1), got {attempt} and {u}")
    # 2 ** attempt overflows a float past ~1024 attempts: the cap is reached long before.
    nominal = max_s if attempt >= 64 else min(max_s, initial_s * 2.0**attempt)
    return nominal * (1 - JITTER + 2 * JITTER * u)
