"""Incremental detokenization and stop strings, on the tiny byte-level BPE tokenizer (no model needed)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetnode.coordinator.detokenize import REPLACEMENT, IncrementalDetokenizer, StopMatcher, token_piece
from hetnode.models.tiny import build_tiny_tokenizer

TOKENIZER = build_tiny_tokenizer()


def pieces(text: str, prompt: str = "Hello") -> list[str]:
    detok = IncrementalDetokenizer(TOKENIZER, TOKENIZER.encode(prompt))
    out = [detok.push(t) for t in TOKENIZER.encode(text)]
    return [*out, detok.flush()]


@pytest.mark.parametrize("text", ["héllo € 😀 café", "日本語のテキスト", "plain ascii, then 🎉🎉", "👩‍👩‍👧"])
def test_multibyte_characters_never_come_out_half(text: str) -> None:
    ids = TOKENIZER.encode(text)
    assert len(ids) > len(text.split()), "the tokenizer should split these characters over several tokens"
    out = pieces(text)
    assert "".join(out) == text
    assert not any(REPLACEMENT in p for p in out)


@given(st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=40))
def test_pieces_join_to_the_whole_decode(text: str) -> None:
    ids = TOKENIZER.encode(text)
    assert "".join(pieces(text)) == TOKENIZER.decode(ids, skip_special_tokens=True)


def test_invalid_bytes_come_out_at_the_end() -> None:
    lead_byte = TOKENIZER.encode("é")[0]  # the first byte of a two-byte character, alone: never completed
    detok = IncrementalDetokenizer(TOKENIZER)
    assert detok.push(TOKENIZER.encode("a")[0]) == "a"
    assert detok.push(lead_byte) == ""
    assert detok.flush() == REPLACEMENT


def run_stops(stops: list[str], chunks: list[str]) -> tuple[list[str], bool]:
    m = StopMatcher(stops)
    out: list[str] = []
    for chunk in chunks:
        text, hit = m.push(chunk)
        out.append(text)
        if hit:
            return out, True
    out.append(m.flush())
    return out, False


def test_stop_string_split_over_pieces_is_held_back_then_cut() -> None:
    out, hit = run_stops(["STOP"], ["abc S", "T", "O", "P tail"])
    assert hit and "".join(out) == "abc "
    assert out == ["abc ", "", "", ""]  # "S", "ST", "STO" might have been the start of STOP


def test_false_start_is_released() -> None:
    out, hit = run_stops(["STOP"], ["abc ST", "AR", "t"])
    assert not hit and out == ["abc ", "STAR", "t", ""]
    out, hit = run_stops(["STOP"], ["abc ST"])
    assert not hit and "".join(out) == "abc ST"  # held text is shown when the generation ends


def test_earliest_of_several_stops_wins() -> None:
    out, hit = run_stops(["world", "lo w"], ["hello world"])
    assert hit and "".join(out) == "hel"
    out, hit = run_stops(["\n\n", "END"], ["a\n", "b\n", "\nc"])
    assert hit and "".join(out) == "a\nb"


@given(st.text(alphabet="abAB", max_size=30), st.lists(st.text(alphabet="abAB", min_size=1, max_size=4),
                                                       min_size=1, max_size=4), st.data())
def test_stops_match_str_find_however_split(text: str, stops: list[str], data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    # Generation stops at the first chunk after which some stop string has appeared, cut where the earliest
    # one starts: a longer stop string that would have matched earlier never gets to complete.
    want, expect_hit = text, False
    for end in [*cuts, len(text)]:
        hits = [i for i in (text[:end].find(s) for s in stops) if i >= 0]
        if hits:
            want, expect_hit = text[: min(hits)], True
            break
    out, hit = run_stops(stops, chunks)
    assert hit == expect_hit
    assert "".join(out) == want


def test_token_pieces_for_logprobs() -> None:
    assert token_piece(TOKENIZER, TOKENIZER.encode("a")[0]) == ("a", b"a")
    first, second = TOKENIZER.encode("é")
    assert token_piece(TOKENIZER, first) == ("bytes:\\xc3", b"\xc3")
    assert token_piece(TOKENIZER, second) == ("bytes:\\xa9", b"\xa9")
    assert token_piece(TOKENIZER, TOKENIZER.eos_token_id) == ("<|im_end|>", b"<|im_end|>")
