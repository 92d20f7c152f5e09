"""The per-hand-off codec choice: cheapest of pack + transfer + unpack among the allowed codecs, or re-prefill."""

from __future__ import annotations

import math

import pytest

from hetnode.policy import REPREFILL, CodecOption, KVCodecChoice, KVCodecPolicy, LinkEstimate

FP16 = 30 * 512 * 3 * 64 * 2 * 2  # SmolLM2-135M's KV for 512 tokens, K and V at fp16: 11.8 MB
# Sizes as hetnode.kv.codecs computes them at group 64; rates of the order bench_kv.py measures on one core.
OPTIONS = [
    CodecOption("fp16", FP16, pack_rate=10e9, unpack_rate=10e9),
    CodecOption("int8", FP16 * 68 // 128, pack_rate=1.4e9, unpack_rate=2.9e9),
    CodecOption("int4", FP16 * 36 // 128, pack_rate=1.2e9, unpack_rate=2.0e9),
    CodecOption("int2", FP16 * 20 // 128, pack_rate=1.1e9, unpack_rate=1.8e9),
]
WAN = LinkEstimate(bandwidth=100e6 / 8, latency=0.05)  # the demo testnet's cross-region link
LAN = LinkEstimate(bandwidth=80e9 / 8, latency=1e-4)


def test_a_slow_link_picks_int4_and_prices_it() -> None:
    choice = KVCodecPolicy().choose(FP16, OPTIONS, WAN)
    int4 = OPTIONS[2]
    expected = FP16 / 1.2e9 + 0.05 + int4.wire_bytes / WAN.bandwidth + FP16 / 2.0e9
    assert choice == KVCodecChoice("int4", int4.wire_bytes, pytest.approx(expected))


def test_a_fast_link_keeps_fp16() -> None:
    choice = KVCodecPolicy().choose(FP16, OPTIONS, LAN)
    assert (choice.codec, choice.wire_bytes) == ("fp16", FP16)
    assert choice.seconds == pytest.approx(3 * FP16 / 10e9 + 1e-4)


def test_between_them_the_cpu_cost_decides() -> None:
    # A link where int4's smaller payload no longer pays for its slower packing than int8's.
    slow_int4 = [*OPTIONS[:2], CodecOption("int4", OPTIONS[2].wire_bytes, pack_rate=0.2e9, unpack_rate=0.2e9)]
    assert KVCodecPolicy().choose(FP16, slow_int4, LinkEstimate(1e9 / 8, 0.01)).codec == "int8"


def test_auto_never_picks_int2_and_the_operator_restricts_the_choice() -> None:
    assert KVCodecPolicy("auto").choose(FP16, OPTIONS, LinkEstimate(1e6, 0.1)).codec == "int4"
    assert KVCodecPolicy("int8").choose(FP16, OPTIONS, WAN).codec == "int8"
    assert KVCodecPolicy("fp16").choose(FP16, OPTIONS, WAN).codec == "fp16"
    assert KVCodecPolicy("int4").choose(FP16, OPTIONS, LAN).codec == "int4"


def test_reprefill_when_recomputing_the_prompt_is_cheaper_still() -> None:
    policy = KVCodecPolicy()
    assert policy.choose(FP16, OPTIONS, WAN, reprefill_s=0.1) == KVCodecChoice(REPREFILL, 0, 0.1)
    assert policy.choose(FP16, OPTIONS, WAN, reprefill_s=5.0).codec == "int4"
    assert policy.choose(FP16, OPTIONS, LinkEstimate(1e3, 1.0), reprefill_s=None).codec == "int4"  # no prompt there
    # The operator's restriction applies to the codecs, not to re-prefilling.
    assert KVCodecPolicy("fp16").choose(FP16, OPTIONS, WAN, reprefill_s=0.5).codec == REPREFILL


def test_a_tie_goes_to_the_more_precise_codec() -> None:
    same = [CodecOption(name, 1000, math.inf, math.inf) for name in ("int4", "int8", "fp16")]
    assert KVCodecPolicy().choose(4000, same, LAN).codec == "fp16"


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="one of auto, fp16, fp32, int8, int4"):
        KVCodecPolicy("int3")
    with pytest.raises(ValueError, match="int2"):
        KVCodecPolicy("int2")  # a codec on the wire, but not one an operator may ask for
    with pytest.raises(ValueError, match="no measured rates for allowed codec"):
        KVCodecPolicy().choose(FP16, OPTIONS[1:], WAN)
    with pytest.raises(ValueError, match="fp16_bytes"):
        KVCodecPolicy().choose(0, OPTIONS, WAN)
    with pytest.raises(ValueError, match="reprefill_s"):
        KVCodecPolicy().choose(FP16, OPTIONS, WAN, reprefill_s=-1.0)
    with pytest.raises(ValueError, match="bandwidth"):
        LinkEstimate(0.0, 0.01)
    with pytest.raises(ValueError, match="latency"):
        LinkEstimate(1e6, math.nan)
    with pytest.raises(ValueError, match="rates"):
        CodecOption("int4", 10, pack_rate=math.nan, unpack_rate=1e9)
    with pytest.raises(ValueError, match="wire_bytes"):
        CodecOption("int4", 0, pack_rate=1e9, unpack_rate=1e9)


def test_choose_handoff_codecs_per_link_and_a_reprefill_only_when_every_link_would_rather() -> None:
    from hetnode.policy.kv_codec import HandoffLink, choose_handoff, reprefill_seconds

    sizes = {o.name: o.wire_bytes for o in OPTIONS} | {"fp16": FP16}
    rates = {o.name: o.pack_rate for o in OPTIONS}
    slow = HandoffLink(sizes, rates, {o.name: o.unpack_rate for o in OPTIONS}, WAN)
    fast = HandoffLink(sizes, rates, {o.name: o.unpack_rate for o in OPTIONS}, LinkEstimate(1e12, 0.0))
    unmeasured = HandoffLink(sizes, {}, {}, None)
    policy = KVCodecPolicy()
    assert choose_handoff(policy, [slow, fast, unmeasured]) == (["int4", "fp16", "fp16"], False)
    slow_s = policy.choose(FP16, OPTIONS, WAN).seconds
    assert choose_handoff(policy, [slow], reprefill_s=slow_s / 2) == (["int4"], True)
    assert choose_handoff(policy, [slow, fast], reprefill_s=slow_s / 2)[1] is False  # the fast link moves its KV
    assert choose_handoff(policy, [slow, unmeasured], reprefill_s=slow_s / 2)[1] is False
    assert choose_handoff(KVCodecPolicy("int8"), [slow], reprefill_s=0.0) == (["int8"], False)  # only under auto
    assert reprefill_seconds(100, [1000.0, 500.0]) == pytest.approx(0.3)
    assert reprefill_seconds(100, [1000.0, 0.0]) is None and reprefill_seconds(100, []) is None
