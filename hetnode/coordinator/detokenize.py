"""Text out of generated tokens, as it becomes safe to show: incremental detokenization and stop strings.

Two things can make the text of the tokens so far unsafe to send yet:

- A token may carry only part of a UTF-8 character (byte-level BPE splits emoji and most non-Latin characters
  over several tokens); decoded on its own it shows U+FFFD. `IncrementalDetokenizer` waits for the rest.
- The text may end with the beginning of a stop string. Once sent it cannot be taken back, so `StopMatcher`
  holds back the longest tail that could still become a stop string.

`token_piece` names single tokens for logprobs, in OpenAI's vocabulary (text, or `bytes:\\x..` and raw bytes
for a token that is part of a character).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"
# Prompt tokens decoded along with the first generated ones: tokenizers whose decoding depends on the token
# before (SentencePiece drops the leading space of the first token of a string) then get it right.
PROMPT_CONTEXT_TOKENS = 5


def _decode(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> str:
    text = tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert isinstance(text, str)
    return text


class IncrementalDetokenizer:
    """Feeds on token ids; returns each new stretch of text once its characters are complete.

    Decoding everything generated on every token costs O(n^2); instead two offsets bound a window (as vLLM and
    TGI do): text before `_read` was returned already, and `_prefix` starts a little earlier so that the window
    decodes in context. The concatenation of what `push` and `flush` return equals decoding all the generated
    tokens at once (for byte-level BPE exactly; SentencePiece gets the spaces the prompt context implies).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self._ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)

    def push(self, token: int) -> str:
        self._ids.append(token)
        done = _decode(self.tokenizer, self._ids[self._prefix : self._read])
        text = _decode(self.tokenizer, self._ids[self._prefix :])
        # A trailing U+FFFD is (almost always) a character whose remaining bytes are still to come.
        if len(text) > len(done) and not text.endswith(REPLACEMENT):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(done) :]
        return ""

    def flush(self) -> str:
        """At the end of the generation: what is still held, incomplete characters shown as U+FFFD."""
        done = _decode(self.tokenizer, self._ids[self._prefix : self._read])
        text = _decode(self.tokenizer, self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(done) :] if len(text) > len(done) else ""


class StopMatcher:
    """Finds the first stop string in a stream of text pieces, releasing only text that cannot be part of one.

    Any occurrence of a stop string starts in the held tail: text is released only when no suffix of it is a
    prefix of a stop string, so a match is found however it straddles the pieces (or tokens).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.matched: str | None = None

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string just matched). After a match, the rest is discarded."""
        if self.matched is not None:
            return "", True
        held = self._held + text
        first = -1
        for stop in self.stops:
            at = held.find(stop)
            if at >= 0 and (first < 0 or at < first):
                first, self.matched = at, stop
        if first >= 0:
            self._held = ""
            return held[:first], True
        keep = self._possible_start(held)
        self._held = held[len(held) - keep :]
        return held[: len(held) - keep], False

    def flush(self) -> str:
        """At the end of the generation, the held tail did not become a stop string: it is text after all."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _possible_start(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = max((len(s) for s in self.stops), default=1) - 1
        for k in range(min(longest, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-to-printable-character table, inverted (the alphabet of byte-level BPE token strings)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def token_piece(tokenizer: PreTrainedTokenizerBase, token: int) -> tuple[str, bytes]:
    """(the token's text for logprobs, its UTF-8 bytes). Part of a character shows as OpenAI does: `bytes:\\xe2`."""
    text = tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert isinstance(text, str)
    if REPLACEMENT not in text:
        return text, text.encode()
    raw = _raw_bytes(tokenizer, token)
    if raw is None:
        return text, text.encode()
    try:
        return raw.decode(), raw
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


def _raw_bytes(tokenizer: PreTrainedTokenizerBase, token: int) -> bytes | None:
    piece = tokenizer.convert_ids_to_tokens(token)
    if not isinstance(piece, str):
        return None
    if m := _BYTE_FALLBACK.fullmatch(piece):  # SentencePiece byte fallback
        return bytes([int(m.group(1), 16)])
    table = _byte_level_decoder()
    if piece and all(c in table for c in piece):  # byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM2)
        return bytes(table[c] for c in piece)
    return None
