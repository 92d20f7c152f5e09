"""Prompt text to token ids, off the event loop, with the checks that must come before it.

Tokenizing takes time in proportion to the text (about 0.7 s per million characters for SmolLM2), so three
multi-megabyte prompts tokenized on the event loop, or one after another in a single worker thread, held up
every other request for many seconds. Three things prevent that:

- A prompt whose character count no tokenization could fit into the context is refused before tokenizing
  (`PromptTokenizer.max_chars`). The bound is sound: no token of the vocabulary spells more characters than
  its longest entry (byte-level BPE writes one character per byte, and a character takes at least one byte),
  so a prompt of more than context x that many characters takes more than context tokens.
- Tokenizing runs in worker threads (the Rust tokenizer releases the GIL while it works), never more than two
  at once, so that it cannot take every thread of trio's pool.
- Prompts go to one of two lanes by size, each with its own thread and its own copy of the tokenizer: a short
  prompt never waits behind a long one. One copy per thread also keeps a fast tokenizer from being used by
  two threads at once (it mutates its settings on calls made with other options, and a concurrent call then
  fails with "Already borrowed").
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from typing import Any

import trio
from transformers import PreTrainedTokenizerBase

from hetnode.models.tokenizer import chat_prompt_ids

# Prompts up to this many characters take the short lane (a few milliseconds of tokenizing at most).
SHORT_PROMPT_CHARS = 16_384

_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str) -> int | None:
    """Where `text` holds a lone surrogate (JSON's "\\ud800" escape decodes to one), or None.

    Such a string is not Unicode text: the tokenizer cannot take it, nor can anything that encodes it as UTF-8.
    """
    m = _SURROGATE.search(text)
    return None if m is None else m.start()


def max_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most characters one token of `tokenizer` can stand for: its longest vocabulary entry (added
    tokens included). Byte-level entries spell each byte as one character, byte-fallback entries ("<0x41>")
    spell one byte with six: either way at least as many characters as the text the token covers."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


class PromptTokenizer:
    """Two lanes of one worker thread each; see the module docstring."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, context_len: int,
                 short_chars: int = SHORT_PROMPT_CHARS) -> None:
        self.tokenizer = tokenizer
        self.short_chars = short_chars
        self.max_chars = context_len * max_token_chars(tokenizer)
        self._short = (tokenizer, trio.CapacityLimiter(1))
        self._long = (copy.deepcopy(tokenizer), trio.CapacityLimiter(1))

    async def encode(self, text: str) -> list[int]:
        tokenizer, limiter = self._lane(len(text))
        ids = await trio.to_thread.run_sync(tokenizer.encode, text, limiter=limiter)
        return [int(t) for t in ids]

    async def chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Token ids of `messages` under the model's chat template; raises what the template raises."""
        tokenizer, limiter = self._lane(sum(len(str(m.get("content", ""))) for m in messages))
        return await trio.to_thread.run_sync(chat_prompt_ids, tokenizer, messages, limiter=limiter)

    def _lane(self, chars: int) -> tuple[PreTrainedTokenizerBase, trio.CapacityLimiter]:
        return self._short if chars <= self.short_chars else self._long
