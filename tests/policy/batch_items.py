"""The work item the batch-policy tests queue: what the policy reads of a session's next step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class It:
    session: str
    start: int
    num_tokens: int
    prefill_end: int = 0

    def __post_init__(self) -> None:
        if not self.prefill_end:
            object.__setattr__(self, "prefill_end", self.start + self.num_tokens)
