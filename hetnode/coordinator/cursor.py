"""Where one generation stands: which item to run next (prefill chunks, then one decode token at a time), and
when it is finished. Both generators (local and pipeline) drive sessions with it, so they cannot disagree on
positions, chunking or stopping.
"""

from __future__ import annotations

from hetnode.coordinator.generation import GenerationError, GenerationParams
from hetnode.ids import SessionId
from hetnode.node.engine.base import StepItem


class SessionCursor:
    def __init__(self, session: SessionId, prompt_ids: list[int], params: GenerationParams,
                 prefill_chunk: int = 512) -> None:
        if not prompt_ids:
            raise GenerationError("the prompt is empty", status=400, code="invalid_prompt")
        if params.max_tokens < 1:
            raise GenerationError("max_tokens must be at least 1", status=400, code="invalid_max_tokens")
        self.session = session
        self.prompt = list(prompt_ids)
        self.params = params
        self.prefill_chunk = prefill_chunk
        self.position = 0  # tokens the pipeline holds KV for
        self.generated: list[int] = []
        self.finished = False
        self.finish_reason = ""

    def next_item(self) -> StepItem:
        """The next item to send to the first stage."""
        if self.finished:
            raise RuntimeError("the session is finished")
        if self.position < len(self.prompt):
            chunk = self.prompt[self.position:self.position + self.prefill_chunk]
            last = self.position + len(chunk) == len(self.prompt)
            return StepItem(self.session, self.position, token_ids=chunk,
                            sampling=self.params.sampling if last else None)
        return StepItem(self.session, self.position, token_ids=[self.generated[-1]],
                        sampling=self.params.sampling)

    def advance(self, item: StepItem, token: int | None, stopped: bool) -> bool:
        """Record the result of `item`; True when a token came out of it."""
        self.position = item.start + item.num_tokens
        if token is None:
            return False
        self.generated.append(token)
        if stopped:
            self.finished, self.finish_reason = True, "stop"
        elif len(self.generated) >= self.params.max_tokens:
            self.finished, self.finish_reason = True, "length"
        return True
