"""A request whose route failed it (a node died or left, a hop refused or preempted it): move it or end it.

A move puts the request on a new route under a new session id. The new route holds no KV for it, so it
prefills the prompt and every token the coordinator has received (tokens still on their way from the old route
are dropped on arrival and sampled again), then samples the next token of the same stream with what is left
of max_tokens. A request moves at most `max_moves` times; after that it ends with the last failure's reason.
The runtime's coordinator (`PipelineGenerator`) and the simulated one (`SimCoordinator`) both ask this object.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Restart:
    prefill_end: int  # tokens the new route prefills before it samples
    max_tokens: int  # tokens it may still generate


@dataclass(frozen=True, slots=True)
class MovePolicy:
    max_moves: int = 3

    def __post_init__(self) -> None:
        if self.max_moves < 0:
            raise ValueError(f"max_moves must be >= 0, not {self.max_moves}")

    def may_move(self, moves_done: int) -> bool:
        """Whether a request that has moved `moves_done` times may move once more."""
        return moves_done < self.max_moves

    def restart(self, prompt_len: int, received: int, max_tokens: int) -> Restart:
        """What the new route runs for a request of `prompt_len` prompt tokens after `received` tokens."""
        if not 0 <= received < max_tokens:
            raise ValueError(f"a request with {received} of {max_tokens} tokens has nothing left to move")
        return Restart(prompt_len + received, max_tokens - received)
