"""A hop's KV hand-offs: what it sends the next phase, what it takes from the previous one, and the moves that
keep a session's KV (Freeze, then Export to the hops of its new route).

A hop of a phase that hands off sends the KV its steps compute to the hops of the next phase that hold those
layers, on the KV protocol (its own streams and outbox: KV never delays activations or tokens). The transfer
policy (`hetnode.policy.KVTransferPolicy`) picks per link and step: whole after the step, or layer group by
layer group from inside it (Splitwise §IV-C, `hetnode.kv.stream`), which hides the transfer behind the rest
of the forward. The receiving hop takes any number of layer-group frames per token range, each checked on its
own, and lets the session's items run once every layer has all its positions.

A session that moves with its KV (its node leaves, or a re-plan takes the node's layers) is frozen on the hops of
its last phase, which then export what they computed to the hops of the new route that hold the same layers,
in chunks of positions, each packed with its link's codec.

`KVHandoffs` is a part of `HopServer` (hops.py), kept in its own file: it uses the server's sessions, outboxes
and failure reporting, declared below for the type checker.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import trio

from hetnode.errors import ProtocolError
from hetnode.ids import NodeId, SessionId
from hetnode.kv.codecs import CODECS
from hetnode.kv.stream import LayerStream, StreamPart
from hetnode.models.config import ModelConfig
from hetnode.node.batcher import Work
from hetnode.node.engine import Engine, EngineError, LayerDone, TorchEngine
from hetnode.node.hop_session import HopSession
from hetnode.node.metrics import NodeMetrics
from hetnode.policy import KVTransferChoice, KVTransferPolicy
from hetnode.protocol.messages import (
    KV,
    ErrorReply,
    Export,
    Freeze,
    Frozen,
    HandedOver,
    Ready,
    Reserve,
    SendKV,
    TensorMeta,
)
from hetnode.protocol.outbox import Outbox
from hetnode.protocol.routes import KVPeer, kv_targets, places_of, route_problem
from hetnode.protocol.transport import Transport

if TYPE_CHECKING:
    from hetnode.policy import Cause

log = logging.getLogger(__name__)

_HANDED_MEMORY = 4096  # sessions handed to the next phase recently: a send that fails still reaches their coordinator
_KV_WAIT_S = 10.0  # how long a frozen hop waits for handed-over KV still on its way before it answers
_EXPORT_CHUNK = 512  # positions per KV message of a move (the prefill path sends one per chunk of that size too)


class KVHandoffs:
    # The server's state and services these methods use (HopServer sets them).
    transport: Transport
    sessions: dict[SessionId, HopSession]
    kv_outbox: Outbox
    outbox: Outbox
    kv_transfer: KVTransferPolicy
    kv_bytes_sent: int
    kv_bytes_received: int
    kv_frames_sent: int
    metrics: NodeMetrics
    _released: OrderedDict[SessionId, None]
    _handed: OrderedDict[SessionId, NodeId]
    _nursery: trio.Nursery | None

    link_mbps: Callable[[NodeId], float | None]

    if TYPE_CHECKING:
        def _refuse(self, peer: NodeId, code: str, message: str) -> None: ...
        def _report(self, coordinator: NodeId, sid: SessionId, reason: str, unreachable: NodeId | None = None,
                    cause: Cause = "lost") -> None: ...
        def _fail_session(self, session: HopSession, reason: str, unreachable: NodeId | None = None,
                          cause: Cause = "lost") -> None: ...
        def _fail_local(self, sid: SessionId, reason: str) -> None: ...
        def _drop(self, sid: SessionId, end: str = "released") -> None: ...
        async def _submit(self, peer: NodeId, works: list[Work]) -> None: ...

    # -- KV hand-offs ------------------------------------------------------------------------------------

    def _stream_for(self, works: Sequence[Work]) -> LayerDone | None:
        """The step's layer hook (in the event loop, before the step): the KV of the sessions this hop hands off,
        for each target the transfer policy streams, sent group by group from inside the step."""
        parts: list[StreamPart] = []
        engine: Engine | None = None
        for work in works:
            session: HopSession = work.ctx
            if not session.kv_to or session.kv_queued or self.sessions.get(session.id) is not session:
                continue
            start, end = session.kv_sent, _handoff_end(session, work.item.start + work.item.num_tokens)
            if end <= start:
                continue
            engine = session.loop.engine
            for t in session.kv_to:
                if t.codec not in CODECS:
                    continue  # the whole hand-off after the step reports it
                try:
                    choice = self._transfer_choice(t, end - start, engine.config)
                except ValueError as exc:  # a measured bandwidth the policy cannot use: the hand-off goes whole
                    log.warning("KV to %s goes whole after the step: %s", t.peer, exc)
                    continue
                if choice.mode == "layerwise":
                    parts.append(StreamPart(session.id, t.peer, t.codec, start, end, t.first_layer, t.last_layer,
                                            choice.group_layers))
        if not parts:
            return None
        assert engine is not None
        src, token = engine, trio.lowlevel.current_trio_token()

        def export(sid: SessionId, start: int, end: int, layers: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
            return src.export_kv(sid, start, end, layers)

        def send(part: StreamPart, first: int, last: int, data: memoryview) -> bool:
            # In the step's thread. Handed to the event loop without waiting for it: a wait per group, for a
            # loop that shares two cores with the step, cost ~0.5 ms a frame here. Callbacks run in order, so a
            # session's groups are posted in order, and none after one that failed (the session is gone then).
            try:
                token.run_sync_soon(self._send_streamed, part, first, last, data)
            except trio.RunFinishedError:
                return False
            return True

        return LayerStream(parts, export, send)

    def _transfer_choice(self, t: KVPeer, tokens: int, cfg: ModelConfig) -> KVTransferChoice:
        """How the transfer policy sends `tokens` positions of target `t`'s layers over its link (whole or layer
        group by layer group), at its codec's packed size; ValueError for a bandwidth it cannot use."""
        layers = t.last_layer - t.first_layer
        per = CODECS[t.codec].packed_size(layers, tokens, cfg.num_kv_heads, cfg.head_dim) / (layers * tokens)
        return self.kv_transfer.choose(tokens, layers, per, self.link_mbps(NodeId(t.peer)))

    def _send_streamed(self, part: StreamPart, first: int, last: int, data: memoryview) -> None:
        """In the event loop: post one group streamed from inside a step (never raises: trio runs it as a
        callback, where an exception would end the run)."""
        try:
            session = self.sessions.get(part.session)
            if session is None or session.kv_sent != part.start:
                return  # released or failed while the step ran (or an earlier group failed)
            if not self._post_kv(session, part.target, part.codec, first, last, part.start, part.end, data):
                return
            if session.kv_stream_end != part.end:
                session.kv_streamed, session.kv_stream_end = {}, part.end
            session.kv_streamed[part.target] = last
        except Exception:
            log.exception("posting streamed KV of session %s failed", part.session)

    def _post_kv(self, session: HopSession, peer: str, codec: str, first: int, last: int, start: int, end: int,
                 data: memoryview) -> bool:
        """Queue the KV of layers [first, last) at positions [start, end) for `peer`; False (and the session
        failed) when its queue is full."""
        msg = kv_frame(session.id, codec, first, last, start, end, data)
        self._count_sent(session, peer, codec, len(data))
        if not self.kv_outbox.post(NodeId(peer), msg, data):
            self._fail_session(session, f"could not queue the KV for {peer}", unreachable=NodeId(peer))
            return False
        return True

    def _count_sent(self, session: HopSession, peer: str, codec: str, nbytes: int) -> None:
        self.kv_bytes_sent += nbytes
        self.kv_frames_sent += 1
        if peer != self.transport.peer_id:  # a hop that keeps the KV itself moves nothing over a link
            self.metrics.kv_sent.labels(peer, codec).inc(nbytes)
        session.stats.sent(peer, codec, nbytes)

    async def _hand_off(self, handing: list[tuple[HopSession, int]]) -> None:
        """Send the next phase the KV this step computed that its layer hook has not streamed already, each layer
        to the hop that holds it, packed with the codec of that link; a session whose whole range has gone is
        done here and frees its KV."""
        ends: dict[SessionId, tuple[HopSession, int]] = {}
        for session, end in handing:
            ends[session.id] = (session, _handoff_end(session, end))
        jobs: list[tuple[HopSession, int, int, list[tuple[KVPeer, int]]]] = []
        for session, end in ends.values():
            if end <= session.kv_sent:
                continue
            streamed = session.kv_streamed if session.kv_stream_end == end else {}
            rest = [(t, streamed.get(t.peer, t.first_layer)) for t in session.kv_to]
            jobs.append((session, session.kv_sent, end, [(t, lo) for t, lo in rest if lo < t.last_layer]))
        if not jobs:
            return
        loop = jobs[0][0].loop

        def export(engine: Engine) -> list[list[tuple[KVPeer, int, memoryview]]]:
            # In the worker thread: the copies and the packing run beside the event loop, between steps.
            out = []
            for session, start, end, rest in jobs:
                parts = []
                for t, lo in rest:
                    keys, values = engine.export_kv(session.id, start, end, (lo, t.last_layer))
                    parts.append((t, lo, CODECS[t.codec].pack(keys, values)))
                out.append(parts)
            return out

        packed: list[list[tuple[KVPeer, int, memoryview]]] = [[] for _ in jobs]
        if any(rest for _, _, _, rest in jobs):  # not when the step streamed everything
            try:
                packed = await loop.run_engine(export)
            except (EngineError, ValueError) as exc:
                for session, _, _, _ in jobs:
                    self._fail_local(session.id, f"could not export the KV to hand over: {exc}")
                return
        for (session, start, end, _), parts in zip(jobs, packed, strict=True):
            if self.sessions.get(session.id) is not session:
                continue
            session.kv_sent = end
            session.kv_streamed, session.kv_stream_end = {}, 0
            if not all(self._post_kv(session, t.peer, t.codec, lo, t.last_layer, start, end, data)
                       for t, lo, data in parts):
                continue  # the session failed at the first KV it could not queue
            if session.span_end is not None and end >= session.span_end:
                self._handed_over(session, end)

    def _handed_over(self, session: HopSession, end: int) -> None:
        """Everything this hop computed for the session is on its way: its KV is not needed here. Its coordinator
        is remembered a while, so a send that fails later is still reported."""
        self._drop(session.id, "handed_over")
        self.outbox.post(session.coordinator, HandedOver(session=session.id, end=end))
        self._handed[session.id] = session.coordinator
        if len(self._handed) > _HANDED_MEMORY:
            self._handed.popitem(last=False)

    # -- KV queues (ThunderServe's): the hand-off starts on the coordinator's word ----------------------------

    def _on_reserve(self, peer: NodeId, msg: Reserve) -> None:
        """The coordinator booked a kv_queued session's decode KV: reserve it here, waiting for room (in the
        background: the coordinator's stream also carries the releases that make the room)."""
        sid = SessionId(msg.session)
        session = self.sessions.get(sid)
        if session is None or session.coordinator != peer:
            self._refuse(peer, "not_yours", f"session {sid} is not the sender's to reserve KV for here")
            return
        if not session.kv_queued or session.kv_end == 0 or session.kv_booked:
            why = "it reserved already" if session.kv_booked else "it is handed no queued KV here"
            self._refuse(peer, "unexpected", f"Reserve for session {sid}: {why}")
            return
        assert self._nursery is not None  # (sessions exist only while the server runs)
        session.kv_booked = True
        self._nursery.start_soon(self._reserve_queued, session)

    async def _reserve_queued(self, session: HopSession) -> None:
        loop = session.loop
        ok = await loop.reserve_queued(session.id, session.kv_end)
        if self.sessions.get(session.id) is not session:
            if ok:
                loop.release(session.id)  # released or failed while it waited: the room goes back
            return
        if not ok:
            # The pool could never hold it (the scheduler's estimate was larger than the real pool), or the shard
            # stopped: another route may serve it.
            self._fail_session(session, f"no KV memory here can hold the {session.kv_end} tokens handed over",
                               cause="full")
            return
        session.kv_reserved = True
        self.outbox.post(session.coordinator, Ready(session=session.id))

    def _on_send_kv(self, peer: NodeId, msg: SendKV) -> None:
        """Every decode hop of a kv_queued session has reserved: send the KV kept here since its prefill."""
        sid = SessionId(msg.session)
        session = self.sessions.get(sid)
        if session is None or session.coordinator != peer:
            self._refuse(peer, "not_yours", f"session {sid} is not the sender's to hand over here")
            return
        problem = ""
        if not session.kv_queued or not session.kv_to:
            problem = "this hop keeps no queued KV for it"
        elif session.kv_booked:
            problem = "its KV is on its way already"
        elif session.span_end is None or session.computed < session.span_end:
            problem = f"this hop has computed [0, {session.computed}) of [0, {session.span_end}) so far"
        if problem:
            self._refuse(peer, "unexpected", f"SendKV for session {sid}: {problem}")
            return
        assert self._nursery is not None
        session.kv_booked = True
        # In the background: the export waits for the worker (a step may be running), and the coordinator's
        # stream must not wait with it.
        self._nursery.start_soon(self._send_kept, session)

    async def _send_kept(self, session: HopSession) -> None:
        """Send each target its layers of positions [kv_sent, span_end), read back from the paged cache: layer
        group by layer group (the transfer policy's groups, as a prefill step would stream them), each group in
        chunks of positions; then free the KV here (HandedOver)."""
        assert session.span_end is not None
        start, end = session.kv_sent, session.span_end
        loop = session.loop
        parts: list[tuple[KVPeer, int, int]] = []
        for t in session.kv_to:
            try:
                group = self._transfer_choice(t, end - start, loop.engine.config).group_layers
            except ValueError:
                group = t.last_layer - t.first_layer  # a measured bandwidth the policy cannot use: one group
            parts += [(t, lo, min(lo + group, t.last_layer)) for lo in range(t.first_layer, t.last_layer, group)]

        def export(engine: Engine) -> list[tuple[KVPeer, int, int, int, int, memoryview]]:
            out = []
            for t, lo, hi in parts:
                for a in range(start, end, _EXPORT_CHUNK):
                    b = min(end, a + _EXPORT_CHUNK)
                    keys, values = engine.export_kv(session.id, a, b, (lo, hi))
                    out.append((t, lo, hi, a, b, CODECS[t.codec].pack(keys, values)))
            return out

        try:
            packed = await loop.run_engine(export)
        except (EngineError, ValueError) as exc:
            self._fail_local(session.id, f"could not export the queued KV to hand over: {exc}")
            return
        if self.sessions.get(session.id) is not session:
            return  # released meanwhile
        session.kv_sent = end
        for t, lo, hi, a, b, data in packed:
            if not self._post_kv(session, t.peer, t.codec, lo, hi, a, b, data):
                return  # the session failed at the first KV it could not queue
        self._handed_over(session, end)

    async def _on_kv(self, peer: NodeId, msg: object, payload: bytes | None) -> None:
        """One frame of handed-over KV: any layers the sender shares with this hop, the positions that continue
        each of them. A whole step's transfer is one frame per target; a layer-wise one is a frame per group of
        layers, each checked on its own. A frame is refused (error reply, reset stream) before it touches
        anything; one that fails after it was accepted (its import) fails its session, which can no longer be
        vouched for."""
        if not isinstance(msg, KV):
            raise ProtocolError(f"{type(msg).__name__} is not sent on the KV protocol")
        sid = SessionId(msg.session)
        session = self.sessions.get(sid)
        if session is None:
            if sid in self._released:  # a hand-off still in flight when the session ended: nothing to fix
                self.kv_outbox.post(peer, ErrorReply(code="released", message=f"session {sid} was released"))
                return
            raise ProtocolError(f"KV for session {sid}, which is not installed here")
        if not session.kv_reserved:
            raise ProtocolError(f"session {sid} has no KV reserved here yet (its hand-off has not started)")
        layers = range(msg.first_layer, msg.first_layer + msg.layers)
        for layer in layers:
            if session.kv_from.get(layer) != peer:
                raise ProtocolError(f"session {sid} takes no KV of layer {layer} from {peer} here")
            if session.kv_next[layer] != msg.start:
                raise ProtocolError(f"session {sid}: KV of layer {layer} continues at position "
                                    f"{session.kv_next[layer]}, not {msg.start}")
        end = msg.start + msg.count
        if end > session.kv_end:
            raise ProtocolError(f"session {sid} is handed KV of positions [0, {session.kv_end}), not up to {end}")
        codec = CODECS.get(msg.codec)
        engine = session.loop.engine
        cfg = engine.config
        size = codec.packed_size(msg.layers, msg.count, cfg.num_kv_heads, cfg.head_dim) if codec else -1
        if payload is None or len(payload) != size:
            raise ProtocolError(f"KV of {msg.layers} layers x {msg.count} tokens in {msg.codec} is {size} bytes, "
                                f"not {0 if payload is None else len(payload)}")
        assert codec is not None

        def unpack_and_import(e: Engine) -> None:
            keys, values = codec.unpack(payload, msg.layers, msg.count, cfg.num_kv_heads, cfg.head_dim,
                                        e.dtype if isinstance(e, TorchEngine) else torch.float32)
            e.import_kv(sid, msg.start, msg.first_layer, keys, values)

        # Claimed now: a frame for the same positions (a duplicate, on this stream or another) is refused from
        # here on, and items wait until the import is done.
        for layer in layers:
            session.kv_next[layer] = end
        session.kv_importing += 1
        try:
            await session.loop.run_engine(unpack_and_import)
        except (EngineError, ProtocolError) as exc:
            if self.sessions.get(sid) is session:
                self._fail_session(session, f"handed-over KV of layers [{msg.first_layer}, {layers.stop}) at "
                                            f"[{msg.start}, {end}) could not be written: {exc}")
            raise ProtocolError(f"KV for session {sid} does not fit it here: {exc}") from exc
        finally:
            session.kv_importing -= 1
        if self.sessions.get(sid) is not session:
            return  # released while it was written
        self.kv_bytes_received += len(payload)
        if peer != self.transport.peer_id:
            self.metrics.kv_received.labels(str(peer), msg.codec).inc(len(payload))
        session.stats.received(len(payload), not session.kv_waiting, trio.current_time())
        if not session.kv_waiting:
            session.computed = max(session.computed, session.kv_end)  # what it holds, should it move on
            session.kv_done.set()
        if session.held and not session.kv_waiting:
            held, session.held = session.held, []
            by_sender: dict[NodeId, list[Work]] = {}
            for sender, work in held:
                by_sender.setdefault(sender, []).append(work)
            for sender, works in by_sender.items():
                await self._submit(sender, works)

    # -- moves that keep the KV ----------------------------------------------------------------------------

    def _on_freeze(self, peer: NodeId, msg: Freeze) -> None:
        sid = SessionId(msg.session)
        session = self.sessions.get(sid)
        if session is None or session.coordinator != peer:
            self._refuse(peer, "not_yours", f"session {sid} is not the sender's to freeze here")
            return
        if session.place.phase != len(session.route.phases) - 1:
            self._refuse(peer, "refused", f"session {sid}: only the phase that decodes holds its whole KV")
            return
        session.frozen = True
        if session.kv_waiting and self._nursery is not None:
            # Its handed-over KV is still arriving: what it holds is known once it is all here.
            self._nursery.start_soon(self._frozen_when_whole, peer, session)
            return
        # After the tokens this hop already queued for the coordinator: the answer says what they covered.
        self.outbox.post(peer, Frozen(session=sid, end=session.computed))

    async def _frozen_when_whole(self, peer: NodeId, session: HopSession) -> None:
        with trio.move_on_after(_KV_WAIT_S):
            await session.kv_done.wait()
        if self.sessions.get(session.id) is session:
            self.outbox.post(peer, Frozen(session=session.id, end=session.computed))

    async def _on_export(self, peer: NodeId, msg: Export) -> None:
        """Send the frozen session's KV to the hops of its new session that hold the same layers, in chunks of
        positions, each packed with its link's codec; then free it here."""
        sid, to = SessionId(msg.session), SessionId(msg.to)
        session = self.sessions.get(sid)
        if session is None or session.coordinator != peer:
            self._refuse(peer, "not_yours", f"session {sid} is not the sender's to export here")
            return
        engine = session.loop.engine  # (after a re-plan, the old shard's: it holds this session's KV)
        places = places_of(msg.route, self.transport.peer_id)
        first = msg.route.phases[0]
        end = first.last_token
        problem = route_problem(msg.route, engine.config.num_layers)
        if not problem:
            if not session.frozen:
                problem = f"session {sid} is not frozen"
            elif len(msg.route.phases) != 2 or not places or places[0].phase != 0:
                problem = "the export's route must name this hop in the first of its two phases"
            elif end is None or not 0 < end <= session.computed:
                problem = f"the first phase ends at {end}, but this hop has computed [0, {session.computed})"
            elif (first.hops[places[0].hop].first_layer, first.hops[places[0].hop].last_layer) != (
                    engine.first_layer, engine.last_layer):
                problem = "the export's route gives this hop other layers than it holds"
        if problem:
            self._report(peer, to, f"cannot hand over session {sid}'s KV: {problem}")
            return
        assert end is not None
        targets = kv_targets(msg.route, 0, first.hops[places[0].hop])
        loop = session.loop
        me = self.transport.peer_id
        for start in range(0, end, _EXPORT_CHUNK):
            stop = min(end, start + _EXPORT_CHUNK)

            def export(engine: Engine, start: int = start, stop: int = stop) -> list[tuple[KVPeer, memoryview]]:
                keys, values = engine.export_kv(sid, start, stop)
                base = engine.first_layer
                return [(t, CODECS[t.codec].pack(keys[t.first_layer - base:t.last_layer - base],
                                                 values[t.first_layer - base:t.last_layer - base]))
                        for t in targets]

            try:
                packed = await loop.run_engine(export)
            except EngineError as exc:
                self._report(peer, to, f"could not export session {sid}'s KV: {exc}")
                return
            for target, data in packed:
                kv = kv_frame(to, target.codec, target.first_layer, target.last_layer, start, stop, data)
                self._count_sent(session, target.peer, target.codec, len(data))
                if NodeId(target.peer) == me:  # this hop holds the same layers in the new session: no network
                    try:
                        await self._on_kv(me, kv, bytes(data))
                    except ProtocolError as exc:
                        self._report(peer, to, f"could not hand session {sid}'s KV over here: {exc}")
                        return
                elif not self.kv_outbox.post(NodeId(target.peer), kv, data):
                    self._report(peer, to, f"could not queue session {sid}'s KV for {target.peer}",
                                 unreachable=NodeId(target.peer))
                    return
        self._handed[to] = peer  # a send that fails later is still reported, for the new session
        if len(self._handed) > _HANDED_MEMORY:
            self._handed.popitem(last=False)
        log.info("session %s: handed the KV of %d positions over to session %s", sid, end, to)
        self._drop(sid, "handed_over")


def _handoff_end(session: HopSession, end: int) -> int:
    """The end of the positions a hand-off sends after a step that ran up to `end`: this phase's part only."""
    return end if session.span_end is None else min(end, session.span_end)


def kv_frame(sid: SessionId, codec: str, first: int, last: int, start: int, end: int, data: memoryview) -> KV:
    """The message that carries `data`: layers [first, last) of positions [start, end) of session `sid`."""
    return KV(session=sid, first_layer=first, layers=last - first, start=start, count=end - start,
              codec=codec, tensor=TensorMeta("uint8", [len(data)]))  # type: ignore[arg-type]
