"""Every wire message: hypothesis round trips through MessagePack, and validation of what comes off the wire."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetnode.protocol import messages as m

DECODERS = {
    m.CTL_PROTOCOL: (m.ctl_decoder, m.CtlMessage),
    m.PROBE_PROTOCOL: (m.probe_decoder, m.ProbeMessage),
    m.DISCOVER_PROTOCOL: (m.discover_decoder, m.DiscoverMessage),
    m.INFER_PROTOCOL: (m.infer_decoder, m.InferMessage),
    m.KV_PROTOCOL: (m.kv_decoder, m.KVMessage),
}


def _union_members(union: object) -> set[type]:
    return set(getattr(union, "__args__", ()))


def decoder_for(cls: type) -> msgspec.msgpack.Decoder[object]:
    for decoder, union in DECODERS.values():
        if cls in _union_members(union):
            return decoder
    raise AssertionError(f"{cls.__name__} is in no protocol's union")


def test_every_message_type_belongs_to_a_protocol() -> None:
    for cls in m.ALL_MESSAGE_TYPES:
        decoder_for(cls)


short_text = st.text(max_size=40)
peer = st.text(min_size=1, max_size=60)
count = st.integers(min_value=0, max_value=1 << 40)
unit = st.floats(min_value=0, max_value=1e9, allow_nan=False)
addrs = st.lists(st.text(max_size=80), max_size=4)
profile = st.builds(m.HardwareProfile, device=short_text, device_type=short_text,
                    num_devices=st.integers(1, 64), memory_bytes=count, matmul_tflops=unit,
                    mem_bandwidth_gbps=unit, dtype=short_text, emulated=st.booleans(), host=short_text)
codec = st.sampled_from(["fp16", "bf16", "fp32", "int8", "int4", "int2"])
rate = st.builds(m.CodecRate, codec, st.floats(1e-3, 1e12), st.floats(1e-3, 1e12))
load = st.builds(m.Load, queued_tokens=count, active_sessions=count, kv_blocks_used=count, kv_blocks_free=count,
                 leases_expired=count, kv_codec_rates=st.lists(rate, max_size=3))
member = st.builds(m.MemberInfo, peer_id=peer, name=short_text, region=short_text, addrs=addrs)
link = st.builds(m.LinkMeasurement, dst=peer, bandwidth_mbps=unit, rtt_ms=unit, measured_at=unit)
meta = st.builds(m.TensorMeta, dtype=st.sampled_from(sorted(m.DTYPES)),
                 shape=st.lists(st.integers(0, 4096), max_size=4))
hop = st.builds(m.Hop, peer=peer, first_layer=count, last_layer=count)
kv_link = st.builds(m.KVLink, src=peer, dst=peer, codec=codec)
phase = st.builds(m.Phase, kind=st.sampled_from(["prefill", "decode", "mixed"]), hops=st.lists(hop, min_size=1,
                  max_size=4), first_token=count, last_token=st.none() | count,
                  kv_links=st.lists(kv_link, max_size=3))
kv_sent = st.builds(m.KVSent, peer, codec, count, count)
hop_report = st.builds(m.HopReport, session=short_text, trace=short_text, phase=count, hop=count, steps=count,
                       tokens=count, step_s=unit, wait_s=unit, active_s=unit, kv_wait_s=unit, kv_received_bytes=count,
                       kv_sent=st.lists(kv_sent, max_size=3),
                       end=st.sampled_from(["released", "failed", "expired", "handed_over"]))
route = st.builds(m.Route, phases=st.lists(phase, min_size=1, max_size=m.MAX_PHASES))
position = st.integers(0, m.MAX_TOKENS_PER_SESSION)
positive = st.integers(1, m.MAX_TOKENS_PER_SESSION)
sampling = st.builds(m.Sampling, temperature=st.floats(0, 100), top_k=st.integers(0, 1000),
                     top_p=st.floats(1e-6, 1.0), seed=st.none() | st.integers(0, (1 << 63) - 1),
                     stop_token_ids=st.lists(count, max_size=4), logprobs=st.none() | st.integers(0, 20))

BUILT: list[type] = []


def built(cls: type, **fields: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    BUILT.append(cls)
    return st.builds(cls, **fields)


MESSAGES = st.one_of(
    built(m.ErrorReply, code=short_text, message=short_text),
    built(m.Join, token=short_text, name=short_text, region=short_text, profile=profile, listen_addrs=addrs,
              software=short_text),
    built(m.Welcome, peer_id=peer, heartbeat_interval_s=st.floats(0.01, 100),
              heartbeat_deadline_s=st.floats(0.01, 100), members=st.lists(member, max_size=4)),
    built(m.Refuse, reason=short_text),
    built(m.Heartbeat, seq=count, load=load, hops=st.lists(hop_report, max_size=3)),
    built(m.Members, version=count, members=st.lists(member, max_size=4)),
    built(m.ProbeOrder, order=count, targets=st.lists(peer, max_size=4)),
    built(m.LinkReport, order=count, links=st.lists(link, max_size=4), failed=st.lists(peer, max_size=3)),
    built(m.Assignment, plan_version=count, model=short_text, first_layer=count, last_layer=count,
              role=st.sampled_from(["idle", "mixed", "prefill", "decode"])),
    built(m.AssignmentStatus, plan_version=count, state=st.sampled_from(["loading", "ready", "failed"]),
              detail=short_text),
    built(m.Leave, reason=short_text),
    built(m.Ping, seq=count, pad=st.binary(max_size=64)),
    built(m.Pong, seq=count, pad=st.binary(max_size=64)),
    built(m.BulkStart, total_bytes=st.integers(1, 64 << 20), chunk_bytes=st.integers(1, 1 << 20)),
    built(m.BulkDone, received_bytes=count),
    built(m.DiscoverRequest),
    built(m.DiscoverReply, coordinator=peer, addrs=addrs),
    built(m.Install, session=short_text, route=route, sampling=sampling, prefill_end=positive, max_tokens=positive,
              lease_s=st.floats(0.001, 3600), trace=short_text, kv_queued=st.booleans()),
    built(m.Items, items=st.lists(st.builds(m.Item, short_text, position, positive), min_size=1, max_size=4),
              tensor=meta),
    built(m.Tokens, tokens=st.lists(st.builds(
        m.Token, session=short_text, position=count, token=count, logprob=st.none() | st.floats(-100, 0),
        stopped=st.booleans(), last=st.booleans(),
        top_logprobs=st.none() | st.lists(st.tuples(count, st.floats(-100, 0)), max_size=3)), min_size=1, max_size=3)),
    built(m.Failed, session=short_text, hop_peer=peer, reason=short_text, unreachable=st.just("") | peer,
              cause=st.sampled_from(["lost", "preempted", "full", "refused"])),
    built(m.Ready, session=short_text),
    built(m.HandedOver, session=short_text, end=count),
    built(m.Reserve, session=short_text),
    built(m.SendKV, session=short_text),
    built(m.Freeze, session=short_text),
    built(m.Frozen, session=short_text, end=count),
    built(m.Export, session=short_text, to=short_text, route=route),
    built(m.KV, session=short_text, first_layer=count, layers=st.integers(1, 1024), start=position, count=positive,
              codec=codec, tensor=meta),
    built(m.Renew, sessions=st.lists(short_text, max_size=4)),
    built(m.Release, session=short_text),
)


def test_the_strategies_cover_every_message_type() -> None:
    assert sorted(c.__name__ for c in BUILT) == sorted(c.__name__ for c in m.ALL_MESSAGE_TYPES)


@settings(max_examples=400)
@given(MESSAGES)
def test_round_trip(msg: msgspec.Struct) -> None:
    raw = msgspec.msgpack.encode(msg)
    assert decoder_for(type(msg)).decode(raw) == msg


@given(st.binary(max_size=256))
def test_random_bytes_never_decode_into_something_unchecked(raw: bytes) -> None:
    for decoder, union in DECODERS.values():
        try:
            msg = decoder.decode(raw)
        except msgspec.DecodeError:
            continue
        assert type(msg) in _union_members(union)  # whatever decodes is a fully validated message


@pytest.mark.parametrize("bad", [
    {"t": "heartbeat", "seq": -1, "load": {}},  # negative count
    {"t": "heartbeat", "seq": "1", "load": {}},  # wrong type
    {"t": "join", "token": "x" * 300, "name": "n", "profile": {}, "listen_addrs": []},  # token too long
    {"t": "welcome", "peer_id": "p", "heartbeat_interval_s": 0, "heartbeat_deadline_s": 1, "members": []},
    {"t": "nonsense"},  # unknown tag
    {"seq": 1},  # no tag
])
def test_invalid_control_messages_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(msgspec.ValidationError):
        m.ctl_decoder.decode(msgspec.msgpack.encode(bad))


def test_oversized_lists_and_tensors_are_refused() -> None:
    with pytest.raises(msgspec.ValidationError):
        m.ctl_decoder.decode(msgspec.msgpack.encode({"t": "links", "links": [], "failed": ["p"] * 5000}))
    with pytest.raises(msgspec.ValidationError):  # a shape dimension over 2**31
        m.infer_decoder.decode(msgspec.msgpack.encode({
            "t": "items", "items": [["s", 0, 1]], "tensor": {"dtype": "float32", "shape": [1 << 40]}}))
    with pytest.raises(msgspec.ValidationError):  # more items than a step carries
        m.infer_decoder.decode(msgspec.msgpack.encode({
            "t": "items", "items": [["s", i, 1] for i in range(m.MAX_ITEMS + 1)],
            "tensor": {"dtype": "int64", "shape": [m.MAX_ITEMS + 1]}}))
    with pytest.raises(msgspec.ValidationError):  # a route of more phases than any design has
        hops = [{"peer": "p", "first_layer": 0, "last_layer": 1}]
        m.infer_decoder.decode(msgspec.msgpack.encode({
            "t": "install", "session": "s", "route": {"phases": [{"hops": hops}] * (m.MAX_PHASES + 1)},
            "sampling": {}, "prefill_end": 1, "max_tokens": 1, "lease_s": 1}))
