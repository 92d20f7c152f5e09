"""Running a chain of stages in one process: generation end to end without a network.

This is what the distributed data path does, minus the wire: the items of a step go through stage 0, its
hidden states through stage 1, and so on; the last stage's tokens feed the next step. Tests compare it with
transformers, the benchmark times it, and it shows the networking layer the contract it has to keep: a
session's items reach every stage in position order, and `release` reaches every stage on every exit path.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hetnode.errors import ConfigError
from hetnode.ids import SessionId
from hetnode.node.engine.base import Engine, EngineError, ItemResult, StepItem
from hetnode.node.engine.sampling import GREEDY, SamplingParams


@dataclass(frozen=True)
class Request:
    session: SessionId
    prompt: Sequence[int]
    max_new_tokens: int
    sampling: SamplingParams = GREEDY
    arrival_step: int = 0  # join the batch at this step, so that prefill meets other sessions' decode


@dataclass
class Completion:
    session: SessionId
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "stop" (a stop token was sampled, and is included) or "length"
    logits: list[torch.Tensor] = field(default_factory=list)  # [V] per token, with sampling.return_logits


class LocalPipeline:
    """Stages that together hold every layer once, in order, run one after another in this process."""

    def __init__(self, stages: Sequence[Engine], *, prefill_chunk: int = 512) -> None:
        if not stages or not stages[0].is_first or not stages[-1].is_last:
            raise ConfigError("a pipeline needs a first stage (layer 0) and a last stage (the LM head)")
        for a, b in itertools.pairwise(stages):
            if a.last_layer != b.first_layer:
                raise ConfigError(f"stages do not chain: [.., {a.last_layer}) then [{b.first_layer}, ..)")
        if prefill_chunk < 1:
            raise ConfigError("prefill_chunk must be >= 1", key="prefill_chunk")
        self.stages = list(stages)
        self.prefill_chunk = prefill_chunk

    def step(self, items: Sequence[StepItem]) -> list[ItemResult]:
        """First-stage items (token ids) through every stage; returns the last stage's results."""
        results = self.stages[0].step(items)
        for stage in self.stages[1:]:
            items = [
                StepItem(it.session, it.start, hidden=r.hidden, sampling=it.sampling)
                for it, r in zip(items, results, strict=True)
            ]
            results = stage.step(items)
        return results

    def release(self, session: SessionId) -> None:
        for stage in self.stages:
            stage.release(session)

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """Generate for every request with continuous batching; every session's KV is freed on return."""
        if len({r.session for r in requests}) != len(requests):
            raise EngineError("two requests share a session id")
        done = {r.session: Completion(r.session) for r in requests}
        position = {r.session: 0 for r in requests}
        active = [r for r in requests if r.max_new_tokens > 0]
        for r in requests:
            if r.max_new_tokens <= 0 or not r.prompt:
                raise EngineError(f"request {r.session} needs a prompt and max_new_tokens >= 1")
        step = 0
        try:
            while active:
                batch = [r for r in active if r.arrival_step <= step]
                step += 1
                if not batch:
                    continue
                items = [self._next_item(r, position[r.session], done[r.session]) for r in batch]
                results = self.step(items)
                for r, it, res in zip(batch, items, results, strict=True):
                    position[r.session] = it.start + it.num_tokens
                    if res.token is None:
                        continue
                    out = done[r.session]
                    out.tokens.append(res.token)
                    if res.logits is not None:
                        out.logits.append(res.logits)
                    if res.stopped or len(out.tokens) >= r.max_new_tokens:
                        out.finish_reason = "stop" if res.stopped else "length"
                        active.remove(r)
                        self.release(r.session)
        finally:
            for r in requests:
                self.release(r.session)
        return [done[r.session] for r in requests]

    def _next_item(self, r: Request, pos: int, out: Completion) -> StepItem:
        prompt = list(r.prompt)
        if pos < len(prompt):
            chunk = prompt[pos : pos + self.prefill_chunk]
            last = pos + len(chunk) == len(prompt)
            return StepItem(r.session, pos, token_ids=chunk, sampling=r.sampling if last else None)
        return StepItem(r.session, pos, token_ids=[out.tokens[-1]], sampling=r.sampling)
