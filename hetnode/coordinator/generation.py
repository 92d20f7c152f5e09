"""What the REST API asks of whatever generates tokens: the `Generator` interface.

Two implementations: `hetnode.coordinator.sessions.PipelineGenerator` runs each request through a pipeline of
nodes over the network; `hetnode.coordinator.local.LocalGenerator` runs the whole model in this process (the
single-process reference of the benchmarks, and a real engine for the API's tests).

A generation is an async context manager yielding an async iterator of `TokenEvent`s; leaving the context, on
any path (done, client gone, error), releases the session's KV everywhere.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from transformers import PreTrainedTokenizerBase

from hetnode.errors import HetnodeError
from hetnode.models.config import ModelConfig
from hetnode.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerationParams:
    """max_tokens counts generated tokens; sampling carries the stop token ids (EOS) and logprobs."""

    max_tokens: int
    sampling: SamplingParams
    trace_id: str = ""  # the REST request's id (X-Request-Id), carried to every hop; "" gets a fresh one


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    stopped: bool = False  # the token is a stop token (EOS): generation ends; it is not part of the text


class GenerationError(HetnodeError):
    """A generation that cannot start or cannot go on; `status` is the HTTP status the API answers with."""

    def __init__(self, message: str, *, status: int = 503, code: str = "unavailable") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class Generator(Protocol):
    model_name: str
    model_config: ModelConfig
    tokenizer: PreTrainedTokenizerBase

    def generate(self, prompt_ids: list[int], params: GenerationParams,
                 ) -> AbstractAsyncContextManager[AsyncIterator[TokenEvent]]:
        """Tokens as they are produced, up to params.max_tokens, ending early after a stop token.

        Raises GenerationError (on entering, or while iterating) when the request cannot be served."""
        ...
