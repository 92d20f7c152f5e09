"""A request's lifecycle, decided once for the runtime and the simulator: when a hop samples, what follows a
sampled token (the next decode step on the same phase, a hand-off to the next phase, or the end), when the
coordinator has the last token, and whether a request whose route failed it moves or ends.

A move puts the request on a new route under a new session id. The new route holds no KV for it, so it
prefills the prompt and every token the coordinator has received (tokens still on their way from the old route
are dropped on arrival and sampled again), then samples the next token of the same stream with what is left
of max_tokens. Why the route failed decides whether it may move at all:

- "lost": a hop died, left, was replaced by a re-plan or could not pass a result on. Another route can serve it.
  Which requests a node that goes down takes with it is decided here too (`fails_when_down`).
- "preempted": a hop ran out of KV memory with nothing able to run and dropped its youngest session. The
  memory was there when the request started, so another route (or the same one later) can serve it.
- "full": a hop that starts from handed-over KV had no memory free to reserve for it when the route was
  installed (before any prefill). Another route, or the same one a moment later, can serve it.
- "refused": a hop's whole KV pool is smaller than the prompt. The scheduler refuses such requests up front
  from the nodes' real pools; a refusal that gets past it means the pools changed, and re-prefilling the
  prompt on the next route would only burn that route's compute on a likely refusal too, so it ends here.

A request moves at most `max_moves` times; after that it ends with the last failure's reason. The runtime's
coordinator (`PipelineGenerator`) and hops (`HopServer`) and the simulated ones (`SimCoordinator`) all ask
this object.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

Cause = Literal["lost", "preempted", "full", "refused"]
CAUSES: tuple[Cause, ...] = ("lost", "preempted", "full", "refused")
# What follows a sampled token: the phase's next decode step, the route's next phase, or nothing.
Next = Literal["loop", "handoff", "end"]


@dataclass(frozen=True, slots=True)
class Restart:
    prefill_end: int  # tokens the new route prefills before it samples
    max_tokens: int  # tokens it may still generate


@dataclass(frozen=True, slots=True)
class Lifecycle:
    max_moves: int = 3

    def __post_init__(self) -> None:
        if self.max_moves < 0:
            raise ValueError(f"max_moves must be >= 0, not {self.max_moves}")

    # -- on the route ------------------------------------------------------------------------------------

    def restart(self, prompt_len: int, received: int, max_tokens: int) -> Restart:
        """What a route runs for a request of `prompt_len` prompt tokens after `received` tokens (0 at the start)."""
        if not 0 <= received < max_tokens:
            raise ValueError(f"a request with {received} of {max_tokens} tokens has nothing left to run")
        return Restart(prompt_len + received, max_tokens - received)

    @staticmethod
    def samples(end: int, prefill_end: int) -> bool:
        """Whether a phase's last hop samples after an item that ends at position `end`: a prompt chunk before
        the end of the prefill does not, the chunk that completes it and every decode item do."""
        return end >= prefill_end

    @staticmethod
    def after_token(kind: str, generated: int, max_tokens: int, stopped: bool) -> Next:
        """What follows the `generated`-th token a route sampled (counted from its start), in a phase of `kind`.
        A route stops by itself at a stop token or at its max_tokens; a prefill phase hands the session over
        to the next phase, which decodes."""
        if stopped or generated >= max_tokens:
            return "end"
        return "handoff" if kind == "prefill" else "loop"

    # -- at the coordinator ------------------------------------------------------------------------------

    @staticmethod
    def ends(received: int, max_tokens: int, stopped: bool) -> bool:
        """Whether the token that brings the request to `received` tokens is its last."""
        return stopped or received >= max_tokens

    @staticmethod
    def fails_when_down(node: str, phases: Sequence[Collection[str]], *, left: bool,
                        holding: Collection[str] = ()) -> bool:
        """Whether a request whose route runs its phases on the nodes `phases` (each phase's, in route order) fails
        for cause "lost" when `node` goes down. A node that died takes every session it is part of, an earlier
        phase's included (KV it computed may still have been on its way); one that left gracefully finished
        sending the KV it computed before it went, so only a session whose last phase runs through it fails,
        unless the node is one of `holding`: those that keep KV the next phase still waits for (a hand-off booked
        when it starts, ThunderServe's KV queues, that had not started when the node's drain ran out)."""
        if left and node not in holding:
            return bool(phases) and node in phases[-1]
        return any(node in phase for phase in phases)

    def moves(self, cause: Cause, moves_done: int) -> bool:
        """Whether a request whose route failed it for `cause`, after `moves_done` moves, moves once more."""
        if cause not in CAUSES:
            raise ValueError(f"unknown failure cause {cause!r}")
        return cause != "refused" and moves_done < self.max_moves
