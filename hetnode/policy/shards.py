"""Whether a node loads weights for a new assignment: the node's own rule, which the simulator's re-plans follow.

A node keeps the shard it serves when a new plan assigns it the same layers: only its role, and with it its
step setting (`role_batching.py`), changes, so a lightweight reschedule's phase flip (ThunderServe §3.4) moves
no weights and the sessions on the node stay where they are. Any other layer range is a new shard to load.
"""

from __future__ import annotations

Layers = tuple[int, int]  # [first, last)


def reloads(held: Layers | None, assigned: Layers) -> bool:
    """Whether a node holding the layers `held` (None: none) loads weights to serve the layers `assigned`."""
    return held != assigned
