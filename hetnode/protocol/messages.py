"""Every message that crosses the network: frozen typed structs, one tagged union per protocol id.

Decoding validates types and bounds (msgspec), so a handler only ever sees well-formed values. Strings and
lists that come from the network carry a maximum length; the frame limit bounds the rest.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec

from hetnode.ids import ProtocolId
from hetnode.policy.lifecycle import Cause

# Protocol ids: bump the version when a change is not backward compatible.
CTL_PROTOCOL = ProtocolId("/hetnode/ctl/1")
PROBE_PROTOCOL = ProtocolId("/hetnode/probe/1")
DISCOVER_PROTOCOL = ProtocolId("/hetnode/discover/1")
INFER_PROTOCOL = ProtocolId("/hetnode/infer/2")
# KV hand-offs between phases travel apart from the data path, so a large transfer never delays activations.
KV_PROTOCOL = ProtocolId("/hetnode/kv/1")

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


class CodecRate(msgspec.Struct, frozen=True, array_like=True):
    """How fast a node packs and unpacks KV with one codec, in bytes of fp16 KV per second (measured there)."""

    codec: Annotated[str, msgspec.Meta(max_length=16)]
    pack: Annotated[float, msgspec.Meta(gt=0)]
    unpack: Annotated[float, msgspec.Meta(gt=0)]


class Load(msgspec.Struct, frozen=True, kw_only=True):
    queued_tokens: Count = 0
    active_sessions: Count = 0
    kv_blocks_used: Count = 0
    kv_blocks_free: Count = 0
    leases_expired: Count = 0  # sessions freed because their coordinator went silent, since start
    tokens_per_s: NonNeg = 0.0  # a moving average of the tokens its steps ran per second (0: not measured yet)
    # The same over steps that prefill (a prompt chunk in the batch): what re-prefilling a context would take.
    prefill_tokens_per_s: NonNeg = 0.0
    # Tokens per KV block: with the block counts, the real size of the node's KV pool. 0: not reported (no
    # shard loaded, or a node from before the field), and the coordinator keeps its planner's estimate.
    kv_block_size: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0
    kv_codec_rates: Annotated[list[CodecRate], msgspec.Meta(max_length=8)] = []  # empty until a shard loads


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


# Trace ids: the REST API's request ids (`X-Request-Id`), carried to every hop in Install.
TraceStr = Annotated[str, msgspec.Meta(max_length=128)]
MAX_HOP_REPORTS = 1024


class KVSent(msgspec.Struct, frozen=True, array_like=True):
    """KV one hop sent for one session to one peer with one codec (the packed bytes on the wire)."""

    dst: PeerStr
    codec: Annotated[str, msgspec.Meta(max_length=16)]
    bytes: Count
    frames: Count


class HopReport(msgspec.Struct, frozen=True, kw_only=True):
    """How one session went on one hop, measured on the hop's own clock (durations only, so the coordinator needs
    no synchronised clocks): sent up with the next heartbeat once the session ends there."""

    session: Annotated[str, msgspec.Meta(max_length=128)]
    trace: TraceStr = ""
    phase: Count = 0  # its place on the route
    hop: Count = 0
    steps: Count = 0  # batch steps that ran some of the session's positions here
    tokens: Count = 0  # positions those steps ran for the session
    step_s: NonNeg = 0.0  # the durations of those steps, summed (each step also ran other sessions' items)
    wait_s: NonNeg = 0.0  # from the Install to the session's first step here (upstream hops, handed-over KV)
    active_s: NonNeg = 0.0  # from the Install to its last step here
    kv_wait_s: NonNeg = 0.0  # a phase that starts from handed-over KV: from the Install until all of it arrived
    kv_received_bytes: Count = 0
    kv_sent: Annotated[list[KVSent], msgspec.Meta(max_length=1024)] = []
    end: Literal["released", "failed", "expired", "handed_over"] = "released"


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
    # How the sessions that ended here since the last heartbeat went, for their requests' traces (best effort:
    # a heartbeat that is lost takes its reports with it).
    hops: Annotated[list[HopReport], msgspec.Meta(max_length=MAX_HOP_REPORTS)] = []


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
    # Most prompt tokens one step of this node batches (a prefill replica's, policy/role_batching.py); None: no cap
    # beyond the node's token budget.
    prompt_tokens: Annotated[int, msgspec.Meta(ge=1, le=1 << 24)] | None = None


class AssignmentStatus(_Msg, tag="assign_status", frozen=True, kw_only=True):
    plan_version: Count
    state: Literal["loading", "ready", "failed"]
    detail: Text = ""


class Leave(_Msg, tag="leave", frozen=True, kw_only=True):
    """The node is going. With `drain_s` > 0 it first keeps serving for up to that long while its sessions move
    elsewhere with their KV (it is routed nothing new meanwhile), and says Leave again, without it, when done."""

    reason: Text = ""
    drain_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 0.0


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

# -- /hetnode/infer/2: the data path ------------------------------------------------------------------------
# A session's route is installed once on each of its hops (Install, from the coordinator); after that only
# compact Items travel: one message per next hop per step, carrying every item for that hop, followed by one raw
# frame with all their tensors stacked along the first axis (token ids for a phase's first hop, hidden states
# after it). Each peer keeps one outbound stream per destination, so a session's items arrive in order.

SessionStr = Annotated[str, msgspec.Meta(max_length=128)]
MAX_HOPS = 256
MAX_PHASES = 4
MAX_ITEMS = 4096  # items in one Items or Tokens message (a step's batch for one peer)
MAX_TOKENS_PER_SESSION = 1 << 20
PhaseKind = Literal["prefill", "decode", "mixed"]
CodecName = Literal["fp16", "bf16", "fp32", "int8", "int4", "int2"]  # how KV travels (`hetnode.kv.codecs`)


class Hop(msgspec.Struct, frozen=True, kw_only=True):
    """One node of a phase's pipeline and the layers it runs there."""

    peer: PeerStr
    first_layer: Count
    last_layer: Count  # exclusive


class KVLink(msgspec.Struct, frozen=True, kw_only=True):
    """The codec a hand-off uses from one hop of a phase to one hop of the next (chosen per link)."""

    src: PeerStr
    dst: PeerStr
    codec: CodecName


class Phase(msgspec.Struct, frozen=True, kw_only=True):
    """A pipeline of hops that runs a token range of the session.

    `mixed` prefills the context from `first_token` and decodes on the same hops (Helix). `prefill` stops after
    the first sampled token and hands the KV to the next phase; `decode` starts from handed-over KV. Phases may
    cut the model at different layers. `last_token` bounds a partial prefill (Cronus: tokens [0, k) on a weak
    node); None runs to the end of the context."""

    kind: PhaseKind = "mixed"
    hops: Annotated[list[Hop], msgspec.Meta(min_length=1, max_length=MAX_HOPS)]
    first_token: Count = 0
    last_token: Count | None = None
    # The codecs of this phase's hand-off to the next, per link; a link not listed sends fp16.
    kv_links: Annotated[list[KVLink], msgspec.Meta(max_length=MAX_HOPS * 4)] = []


class Route(msgspec.Struct, frozen=True, kw_only=True):
    """The phases one session runs through, in order."""

    phases: Annotated[list[Phase], msgspec.Meta(min_length=1, max_length=MAX_PHASES)]


class Sampling(msgspec.Struct, frozen=True, kw_only=True):
    """The wire form of the last hop's sampling parameters."""

    temperature: Annotated[float, msgspec.Meta(ge=0, le=100)] = 0.0
    top_k: Annotated[int, msgspec.Meta(ge=0, le=1 << 22)] = 0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    seed: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)] | None = None
    stop_token_ids: Annotated[list[Count], msgspec.Meta(max_length=64)] = []
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None


class Install(_Msg, tag="install", frozen=True, kw_only=True):
    """Serve `session` along `route` (sent by the coordinator to every hop, once per session).

    The session prefills `prefill_end` tokens (the prompt, or after a move the prompt and what was generated
    before), then samples up to `max_tokens` tokens; the last hop of a decode phase feeds each token straight
    back to the phase's first hop and stops by itself at a stop token or at `max_tokens`. Hops accept the
    session's messages only from the peers the route names; the session is freed when the coordinator's lease
    (renewed by Renew) runs out."""

    session: SessionStr
    route: Route
    sampling: Sampling
    prefill_end: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS_PER_SESSION)]
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS_PER_SESSION)]
    lease_s: Annotated[float, msgspec.Meta(gt=0, le=3600)]
    # The session starts from that session's KV, which its hops (the route's first phase, not installed)
    # hand over on an Export: a hop that is on both phases serves the last.
    adopts: SessionStr | None = None
    trace: TraceStr = ""  # the request's trace id: the hop logs it and reports it back (HopReport)
    # ThunderServe's KV queues (the phase-split schedulers' decode_booking "handoff"): the prefill phase's hops
    # keep the KV they compute until the coordinator's SendKV, and the next phase's hops reserve theirs on its
    # Reserve, not at this Install. Only for a prefill phase of the whole context followed by a decode phase.
    kv_queued: bool = False


class Item(msgspec.Struct, frozen=True, array_like=True):
    """Positions [start, start + count) of a session; its rows of the message's tensor follow the previous
    item's."""

    session: SessionStr
    start: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS_PER_SESSION)]
    count: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS_PER_SESSION)]


class Items(_Msg, tag="items", frozen=True, kw_only=True):
    items: Annotated[list[Item], msgspec.Meta(min_length=1, max_length=MAX_ITEMS)]
    tensor: TensorMeta


class Token(msgspec.Struct, frozen=True, kw_only=True):
    session: SessionStr
    position: Count  # where the token stands in the session's context (the length of what came before it)
    token: Count
    logprob: float | None = None
    top_logprobs: Annotated[list[tuple[Count, float]], msgspec.Meta(max_length=20)] | None = None
    stopped: bool = False  # a stop token: the session ends here
    last: bool = False  # the session's last token (stop token or max_tokens): the hops expect nothing more


class Tokens(_Msg, tag="tokens", frozen=True, kw_only=True):
    """Sampled tokens, streamed from a last hop to the coordinators of their sessions (one message per step)."""

    tokens: Annotated[list[Token], msgspec.Meta(min_length=1, max_length=MAX_ITEMS)]


class Failed(_Msg, tag="failed", frozen=True, kw_only=True):
    """`hop_peer` cannot go on with the session (or could not pass its result on); the coordinator moves it."""

    session: SessionStr
    hop_peer: PeerStr
    reason: Text
    unreachable: PeerStr = ""  # the next hop, when passing the result on to it failed (a suspect, not proof)
    cause: Cause = "lost"  # why, as the lifecycle policy reads it: whether the request may move


class Ready(_Msg, tag="ready", frozen=True, kw_only=True):
    """A hop of a phase that starts from handed-over KV has reserved that KV for `session` (sent to the
    coordinator, which starts the prefill only when every such hop is ready)."""

    session: SessionStr


class HandedOver(_Msg, tag="handed_over", frozen=True, kw_only=True):
    """A hop of a phase before the last has computed its whole span of `session` and queued all of that KV to the
    next phase: its part of the request is done (hop -> coordinator; Cronus's partial prefill instance can take
    its next prompt)."""

    session: SessionStr
    end: Count  # the positions [0, end) it computed


class Reserve(_Msg, tag="reserve", frozen=True, kw_only=True):
    """The hand-off of a kv_queued `session` may start: reserve the KV handed to this hop now, waiting for room
    behind earlier such reservations, and answer Ready (coordinator -> a hop of the decode phase)."""

    session: SessionStr


class SendKV(_Msg, tag="send_kv", frozen=True, kw_only=True):
    """Every hop of the decode phase of a kv_queued `session` has reserved its KV: send the KV this hop kept
    since the prefill, then free it and answer HandedOver (coordinator -> a hop of the prefill phase)."""

    session: SessionStr


class Release(_Msg, tag="release", frozen=True, kw_only=True):
    """Free the session's KV on this hop (the coordinator sends it to every hop when the session ends)."""

    session: SessionStr


class Renew(_Msg, tag="renew", frozen=True, kw_only=True):
    """The coordinator's sessions on this hop that are still alive: their leases start over."""

    sessions: Annotated[list[SessionStr], msgspec.Meta(max_length=65536)]


class Freeze(_Msg, tag="freeze", frozen=True, kw_only=True):
    """Stop running `session` here and keep its KV: it is about to move with it (coordinator -> a hop of the phase
    that holds the session's KV). The hop answers Frozen once nothing more of the session leaves it."""

    session: SessionStr


class Frozen(_Msg, tag="frozen", frozen=True, kw_only=True):
    """`session` is frozen on this hop, which has computed its positions [0, end)."""

    session: SessionStr
    end: Count


class Export(_Msg, tag="export", frozen=True, kw_only=True):
    """Hand the frozen `session`'s KV on to the session `to`, whose route names this hop in its first phase
    (ending at the position the KV ends) and the hops that receive it in the next; then free the session here."""

    session: SessionStr
    to: SessionStr
    route: Route


InferMessage = (Install | Items | Tokens | Failed | Ready | HandedOver | Reserve | SendKV | Release | Renew | Freeze
                | Frozen | Export | ErrorReply)
infer_decoder = msgspec.msgpack.Decoder(InferMessage)


class KV(_Msg, tag="kv", frozen=True, kw_only=True):
    """Keys and values of layers [first_layer, first_layer + layers) at positions [start, start + count) of a
    session, from the hop of one phase that computed them to the hop of the next that holds those layers. The
    payload (`tensor`: uint8 [bytes]) is the codec's packing, of exactly the codec's size for that shape."""

    session: SessionStr
    first_layer: Count
    layers: Annotated[int, msgspec.Meta(ge=1, le=1024)]
    start: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS_PER_SESSION)]
    count: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS_PER_SESSION)]
    codec: CodecName
    tensor: TensorMeta


KVMessage = KV | ErrorReply
kv_decoder = msgspec.msgpack.Decoder(KVMessage)

ALL_MESSAGE_TYPES: tuple[type[msgspec.Struct], ...] = (
    ErrorReply, Join, Welcome, Refuse, Heartbeat, Members, ProbeOrder, LinkReport, Assignment, AssignmentStatus, Leave,
    Ping, Pong, BulkStart, BulkDone, DiscoverRequest, DiscoverReply,
    Install, Items, Tokens, Failed, Ready, HandedOver, Reserve, SendKV, Release, Renew, Freeze, Frozen, Export, KV,
)
