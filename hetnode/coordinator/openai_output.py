"""One generation's tokens turned into the pieces of text an OpenAI answer carries, with their logprobs.

`run_generation` drives a `Generator` and hands a `Sink` each piece of text once it is safe to show (complete
characters, no possible start of a stop string), with the logprobs of the tokens whose text begins in it.
Non-streaming answers collect the pieces; streaming answers send each as a chunk. It decides the finish reason:
"stop" for a stop token (EOS) or a stop string, "length" when max_tokens ran out.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import trio
from transformers import PreTrainedTokenizerBase

from hetnode.coordinator.detokenize import IncrementalDetokenizer, StopMatcher, token_piece
from hetnode.coordinator.generation import Generator, TokenEvent
from hetnode.coordinator.openai_schema import GenerationRequest

# What OpenAI reports for a log-probability too small to represent (JSON has no -Infinity).
MIN_LOGPROB = -9999.0


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    offset: int  # where the token's text starts in the completion's text


@dataclass
class Generation:
    """How a generation went; filled in as it runs, so it tells the story of one cut short too."""

    finish_reason: str = "length"
    completion_tokens: int = 0  # every token generated, a final stop token included (it took a step)
    first_token_at: float | None = None  # trio.current_time() of the first token
    route: str = ""  # the nodes that serve it, when the generator says (`x-hetnode-route`)


class Sink(ABC):
    @abstractmethod
    async def begin(self) -> None:
        """The first token came (a stream sends its headers now: the generation did start)."""

    @abstractmethod
    async def piece(self, text: str, logprobs: list[TokenLogprob]) -> None:
        """Text safe to show, with the logprobs of the tokens whose text starts in it (text may be empty)."""


async def run_generation(generator: Generator, req: GenerationRequest, sink: Sink,
                         out: Generation | None = None) -> Generation:
    """Generate for `req`, feeding `sink`; raises GenerationError from the generator as it is.

    `out` (returned) is updated as tokens come, so that a caller sees how far a failed or cancelled one got.
    The generator's context is left as soon as the answer is complete (a stop string matched) or the task is
    cancelled (the client went away), which frees the session's KV.
    """
    out = Generation() if out is None else out
    detok = IncrementalDetokenizer(generator.tokenizer, req.prompt_ids)
    stops = StopMatcher(req.stop)
    want_logprobs = req.logprobs is not None
    produced = 0  # characters of text the tokens so far decode to (stop strings aside)
    emitted = 0  # characters handed to the sink
    waiting: list[TokenLogprob] = []  # logprobs of tokens whose text is not sent yet

    async def emit(text: str, *, last: bool = False) -> None:
        nonlocal emitted, waiting
        emitted += len(text)
        if last:
            ready, waiting = waiting, []
        else:
            ready = [lp for lp in waiting if lp.offset < emitted]  # offsets ascend: a prefix
            waiting = waiting[len(ready) :]
        if text or ready:
            await sink.piece(text, ready)

    async with generator.generate(req.prompt_ids, req.params) as events:
        out.route = getattr(events, "route", "")
        try:
            async for event in events:
                if out.first_token_at is None:
                    out.first_token_at = trio.current_time()
                    await sink.begin()
                out.completion_tokens += 1
                if event.stopped:  # a stop token is not part of the text
                    out.finish_reason = "stop"
                    break
                text = detok.push(event.token)
                if want_logprobs:
                    waiting.append(_logprob(event, produced))
                produced += len(text)
                safe, matched = stops.push(text)
                await emit(safe)
                if matched:
                    # The tokens whose text lies inside the stop string are not part of the answer.
                    out.finish_reason = "stop"
                    return out
        finally:
            await _aclose(events)
    safe, matched = stops.push(detok.flush())
    if matched:
        out.finish_reason = "stop"
        await emit(safe)
    else:
        await emit(safe + stops.flush(), last=True)
    return out


def _logprob(event: TokenEvent, offset: int) -> TokenLogprob:
    return TokenLogprob(event.token, _finite(event.logprob), tuple(event.top_logprobs or ()), offset)


def _finite(logprob: float | None) -> float:
    return MIN_LOGPROB if logprob is None or math.isnan(logprob) else max(logprob, MIN_LOGPROB)


async def _aclose(events: AsyncIterator[TokenEvent]) -> None:
    # An async generator left after a `break` would otherwise be finalized whenever the garbage collector gets
    # to it; closing it now runs its cleanup while the generator's context is still open.
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()


class TokenPieces:
    """Text and bytes of single tokens (for logprobs), cached: a vocabulary is finite and small."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids
        self._cache: dict[int, tuple[str, bytes]] = {}

    def ids(self) -> TokenPieces:
        """The same, but naming tokens "token_id:N" (vLLM's return_tokens_as_token_ids)."""
        return TokenPieces(self.tokenizer, as_ids=True)

    def __call__(self, token: int) -> tuple[str, bytes]:
        if self.as_ids:
            name = f"token_id:{token}"
            return name, name.encode()
        piece = self._cache.get(token)
        if piece is None:
            piece = self._cache[token] = token_piece(self.tokenizer, token)
        return piece


def completion_logprobs(entries: list[TokenLogprob], pieces: TokenPieces, top_k: int | None) -> dict[str, Any]:
    """/v1/completions' legacy shape: parallel arrays."""
    return {
        "tokens": [pieces(e.token)[0] for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{pieces(t)[0]: _finite(lp) for t, lp in e.top} for e in entries] if top_k else None,
        "text_offset": [e.offset for e in entries],
    }


def chat_logprobs(entries: list[TokenLogprob], pieces: TokenPieces) -> dict[str, Any]:
    """/v1/chat/completions' shape: one object per token, with its bytes (a token may hold part of a character)."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        text, raw = pieces(token)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(raw)}

    return {
        "content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries],
        "refusal": None,
    }
