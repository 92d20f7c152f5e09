"""Every message that crosses the network: frozen typed structs, one tagged union per protocol id.

Decoding validates types and bounds (msgspec), so a handler only ever sees well-formed values. Strings and
lists that come from the network carry a maximum length; the frame limit bounds the rest.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec

from hetnode.ids import ProtocolId

# Protocol ids: bump the version when a change is not backward compatible.
CTL_PROTOCOL = ProtocolId("/hetnode/ctl/1")
PROBE_PROTOCOL = ProtocolId("/hetnode/probe/1")
DISCOVER_PROTOCOL = ProtocolId("/hetnode/discover/1")
INFER_PROTOCOL = ProtocolId("/hetnode/infer/1")

Name = Annotated[str, msgspec.Meta(max_length=128)]
Text = Annotated[str, msgspec.Meta(max_length=4096)]
PeerStr = Annotated[str, msgspec.Meta(max_length=128)]
Addr = Annotated[str, msgspec.Meta(max_length=512)]
Addrs = Annotated[list[Addr], msgspec.Meta(max_length=32)]
NonNeg = Annotated[float, msgspec.Meta(ge=0)]
Count = Annotated[int, msgspec.Meta(ge=0)]

DTYPES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int8": 1, "uint8": 1,
}
DType = Literal["float32", "float16", "bfloat16", "int64", "int32", "int8", "uint8"]


class _Msg(msgspec.Struct, frozen=True, tag_field="t", kw_only=True):
    """Base of every wire message; the class's tag names it on the wire."""


# -- shared pieces ------------------------------------------------------------------------------------------


class ErrorReply(_Msg, tag="error", frozen=True, kw_only=True):
    """Sent before a stream is reset because of something the peer did wrong."""

    code: Name
    message: Text


class TensorMeta(msgspec.Struct, frozen=True):
    """Header of a raw tensor frame: row-major, little-endian."""

    dtype: DType
    shape: Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=1 << 31)]], msgspec.Meta(max_length=8)]

    def nbytes(self) -> int:
        return DTYPES[self.dtype] * math.prod(self.shape)


class HardwareProfile(msgspec.Struct, frozen=True, kw_only=True):
    """What a node reports about its accelerator; `emulated` marks numbers taken from the papers' tables."""

    device: Name  # "cpu", "cuda:NVIDIA A100-SXM4-80GB", "a100", "2xl4", ...
    device_type: Name  # the key for cost tables: "cpu", "a100", "l4", "2xt4", ...
    num_devices: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    memory_bytes: Count
    matmul_tflops: NonNeg
    mem_bandwidth_gbps: NonNeg
    dtype: Name
    emulated: bool = False
    host: Name = ""


class Load(msgspec.Struct, frozen=True, kw_only=True):
    queued_tokens: Count = 0
    active_sessions: Count = 0
    kv_blocks_used: Count = 0
    kv_blocks_free: Count = 0
    # Tokens per KV block: with the block counts, the real size of the node's KV pool. 0: not reported (no
    # shard loaded, or a node from before the field), and the coordinator keeps its planner's estimate.
    kv_block_size: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0


class MemberInfo(msgspec.Struct, frozen=True, kw_only=True):
    peer_id: PeerStr
    name: Name
    region: Name
    addrs: Addrs


class LinkMeasurement(msgspec.Struct, frozen=True, kw_only=True):
    """One directed link, from the reporting node to `dst`, as last measured."""

    dst: PeerStr
    bandwidth_mbps: NonNeg  # megabits per second
    rtt_ms: NonNeg
    measured_at: NonNeg  # unix time


# -- /hetnode/ctl/1: node <-> coordinator, one long-lived stream per membership ---------------------------


class Join(_Msg, tag="join", frozen=True, kw_only=True):
    token: Annotated[str, msgspec.Meta(max_length=256)]
    name: Name
    region: Name = ""
    profile: HardwareProfile
    listen_addrs: Addrs
    software: Name = ""


class Welcome(_Msg, tag="welcome", frozen=True, kw_only=True):
    peer_id: PeerStr  # the id the coordinator saw on the connection
    heartbeat_interval_s: Annotated[float, msgspec.Meta(gt=0)]
    heartbeat_deadline_s: Annotated[float, msgspec.Meta(gt=0)]
    members: Annotated[list[MemberInfo], msgspec.Meta(max_length=4096)]


class Refuse(_Msg, tag="refuse", frozen=True, kw_only=True):
    reason: Text


class Heartbeat(_Msg, tag="heartbeat", frozen=True, kw_only=True):
    seq: Count
    load: Load


class Members(_Msg, tag="members", frozen=True, kw_only=True):
    """The full membership, pushed whenever it changes (nodes check probe and data streams against it)."""

    version: Count
    members: Annotated[list[MemberInfo], msgspec.Meta(max_length=4096)]


class ProbeOrder(_Msg, tag="probe_order", frozen=True, kw_only=True):
    """Measure the links from this node to `targets`, one after another, and answer with a LinkReport."""

    order: Count
    targets: Annotated[list[PeerStr], msgspec.Meta(max_length=4096)]


class LinkReport(_Msg, tag="links", frozen=True, kw_only=True):
    order: Count = 0  # the ProbeOrder this answers
    links: Annotated[list[LinkMeasurement], msgspec.Meta(max_length=4096)]
    failed: Annotated[list[PeerStr], msgspec.Meta(max_length=4096)] = []


class Assignment(_Msg, tag="assign", frozen=True, kw_only=True):
    """The layers and role a node serves under a plan version (the data path fills these in)."""

    plan_version: Count
    model: Name = ""
    first_layer: Count = 0
    last_layer: Count = 0  # exclusive
    role: Literal["idle", "mixed", "prefill", "decode"] = "idle"


class AssignmentStatus(_Msg, tag="assign_status", frozen=True, kw_only=True):
    plan_version: Count
    state: Literal["loading", "ready", "failed"]
    detail: Text = ""


class Leave(_Msg, tag="leave", frozen=True, kw_only=True):
    reason: Text = ""


CtlMessage = (
    Join | Welcome | Refuse | Heartbeat | Members | ProbeOrder | LinkReport | Assignment | AssignmentStatus | Leave
    | ErrorReply
)
ctl_decoder = msgspec.msgpack.Decoder(CtlMessage)


# -- /hetnode/probe/1: node <-> node (and node -> coordinator) link measurement ---------------------------


class Ping(_Msg, tag="ping", frozen=True, kw_only=True):
    seq: Count
    pad: Annotated[bytes, msgspec.Meta(max_length=4096)] = b""


class Pong(_Msg, tag="pong", frozen=True, kw_only=True):
    seq: Count
    pad: Annotated[bytes, msgspec.Meta(max_length=4096)] = b""


class BulkStart(_Msg, tag="bulk", frozen=True, kw_only=True):
    """Raw frames of `chunk_bytes` (the last may be shorter) follow, `total_bytes` in all."""

    total_bytes: Annotated[int, msgspec.Meta(ge=1, le=64 << 20)]
    chunk_bytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]


class BulkDone(_Msg, tag="bulk_done", frozen=True, kw_only=True):
    received_bytes: Count


ProbeMessage = Ping | Pong | BulkStart | BulkDone | ErrorReply
probe_decoder = msgspec.msgpack.Decoder(ProbeMessage)


# -- /hetnode/discover/1: anyone may ask any member where the coordinator is ------------------------------


class DiscoverRequest(_Msg, tag="discover", frozen=True, kw_only=True):
    pass


class DiscoverReply(_Msg, tag="discover_reply", frozen=True, kw_only=True):
    coordinator: PeerStr
    addrs: Addrs


DiscoverMessage = DiscoverRequest | DiscoverReply | ErrorReply
discover_decoder = msgspec.msgpack.Decoder(DiscoverMessage)

# -- /hetnode/infer/1: the data path (coordinator -> stage 1 -> ... -> last stage -> coordinator) ---------
# Each peer keeps one outbound stream per destination and sends messages down it in order; a Forward is
# followed by one raw frame with its tensor (token ids for the first stage, hidden states after it).

SessionStr = Annotated[str, msgspec.Meta(max_length=128)]
MAX_STAGES = 256


class Stage(msgspec.Struct, frozen=True, kw_only=True):
    peer: PeerStr
    first_layer: Count
    last_layer: Count  # exclusive


class Sampling(msgspec.Struct, frozen=True, kw_only=True):
    """The wire form of the last stage's sampling parameters."""

    temperature: Annotated[float, msgspec.Meta(ge=0, le=100)] = 0.0
    top_k: Annotated[int, msgspec.Meta(ge=0, le=1 << 22)] = 0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    seed: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)] | None = None
    stop_token_ids: Annotated[list[Count], msgspec.Meta(max_length=64)] = []
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None


class Forward(_Msg, tag="forward", frozen=True, kw_only=True):
    """Run `tensor` (positions [start, start + n)) of `session` through route[stage] and pass it on."""

    session: SessionStr
    start: Count
    route: Annotated[list[Stage], msgspec.Meta(min_length=1, max_length=MAX_STAGES)]
    stage: Count
    reply_to: PeerStr  # who gets TokenOut / StageFailed: the coordinator
    sampling: Sampling | None = None  # only on items that sample (the last prefill chunk, every decode)
    tensor: TensorMeta


class TokenOut(_Msg, tag="token", frozen=True, kw_only=True):
    session: SessionStr
    start: Count  # the item this token came out of
    token: Count
    logprob: float | None = None
    top_logprobs: Annotated[list[tuple[Count, float]], msgspec.Meta(max_length=20)] | None = None
    stopped: bool = False


class ChunkDone(_Msg, tag="chunk_done", frozen=True, kw_only=True):
    """The last stage finished a prefill chunk that does not sample."""

    session: SessionStr
    start: Count


class StageFailed(_Msg, tag="stage_failed", frozen=True, kw_only=True):
    """`stage_peer` could not run the item (or pass its result on); the coordinator moves the request."""

    session: SessionStr
    start: Count
    stage_peer: PeerStr
    reason: Text
    unreachable: PeerStr = ""  # the next stage, when passing the result on to it failed (a suspect, not proof)


class Release(_Msg, tag="release", frozen=True, kw_only=True):
    """Free the session's KV on this stage (sent to every stage of the route)."""

    session: SessionStr


InferMessage = Forward | TokenOut | ChunkDone | StageFailed | Release | ErrorReply
infer_decoder = msgspec.msgpack.Decoder(InferMessage)

ALL_MESSAGE_TYPES: tuple[type[msgspec.Struct], ...] = (
    ErrorReply, Join, Welcome, Refuse, Heartbeat, Members, ProbeOrder, LinkReport, Assignment, AssignmentStatus, Leave,
    Ping, Pong, BulkStart, BulkDone, DiscoverRequest, DiscoverReply,
    Forward, TokenOut, ChunkDone, StageFailed, Release,
)
