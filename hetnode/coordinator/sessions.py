"""Requests through the network: the coordinator's `Generator` over a pipeline of nodes (Helix §2.1).

For each request the coordinator takes the ready plan's pipeline, sends the prompt's token ids to the first
stage (in prefill chunks), and waits for the last stage's token; each decode step sends that token back to
the first stage over the same route. Each stage keeps the session's KV for its layers; leaving the generation
(finished, client gone, failure) sends a Release to every stage. A stage that fails, or a node that goes down,
ends the request with a clear error (re-routing arrives with the Helix scheduler).
"""

from __future__ import annotations

import itertools
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

import trio
from transformers import PreTrainedTokenizerBase

from hetnode.coordinator.cursor import SessionCursor
from hetnode.coordinator.deployment import Deployment
from hetnode.coordinator.generation import GenerationError, GenerationParams, TokenEvent
from hetnode.coordinator.registry import Registry
from hetnode.errors import HetnodeError
from hetnode.ids import NodeId, SessionId
from hetnode.models.config import ModelConfig
from hetnode.node.engine.sampling import SamplingParams
from hetnode.protocol.mailbox import Mailbox
from hetnode.protocol.messages import (
    INFER_PROTOCOL,
    ChunkDone,
    Forward,
    Release,
    Sampling,
    Stage,
    StageFailed,
    TokenOut,
    infer_decoder,
)
from hetnode.protocol.tensors import to_wire, token_tensor
from hetnode.protocol.transport import Transport

log = logging.getLogger(__name__)

_Inbound = TokenOut | ChunkDone | StageFailed | str  # str: the coordinator's own verdict (a node went down)


def wire_sampling(p: SamplingParams) -> Sampling:
    return Sampling(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                    seed=None if p.seed is None else p.seed % (1 << 63),
                    stop_token_ids=list(p.stop_token_ids), logprobs=p.logprobs)


class _Session:
    def __init__(self, route: list[Stage], send: trio.MemorySendChannel[_Inbound]) -> None:
        self.route = route
        self.peers = {NodeId(s.peer) for s in route}
        self.send = send


class PipelineGenerator:
    def __init__(self, transport: Transport, registry: Registry, deployment: Deployment, *, model_name: str,
                 model_config: ModelConfig, tokenizer: PreTrainedTokenizerBase, prefill_chunk: int = 512,
                 step_timeout_s: float = 120.0, ready_timeout_s: float = 30.0) -> None:
        self.transport = transport
        self.registry = registry
        self.deployment = deployment
        self.model_name = model_name
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.prefill_chunk = prefill_chunk
        self.step_timeout_s = step_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.mailbox = Mailbox(transport, INFER_PROTOCOL, infer_decoder, self._on_message, registry.is_member)
        self._sessions: dict[SessionId, _Session] = {}
        self._ids = itertools.count()
        self._nursery: trio.Nursery | None = None
        self._releasing = 0
        self._released = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.mailbox.install()
            task_status.started()
            await trio.sleep_forever()

    @property
    def active_sessions(self) -> int:
        return len(self._sessions)

    # -- inbound -----------------------------------------------------------------------------------------

    async def _on_message(self, peer: NodeId, msg: object, payload: bytes | None) -> None:
        if not isinstance(msg, TokenOut | ChunkDone | StageFailed):
            log.warning("unexpected %s from %s on the data path", type(msg).__name__, peer)
            return
        session = self._sessions.get(SessionId(msg.session))
        # Only a stage of the session's own route may speak for it.
        if session is None or peer not in session.peers:
            return
        try:
            session.send.send_nowait(msg)
        except trio.WouldBlock:
            log.warning("session %s: result from %s dropped (inbox full)", msg.session, peer)

    def node_down(self, peer: NodeId, reason: str) -> None:
        """Fail every session whose route runs through `peer`."""
        name = self.registry.nodes[peer].name if peer in self.registry.nodes else str(peer)
        for session in self._sessions.values():
            if peer in session.peers:
                with suppress(trio.WouldBlock):
                    session.send.send_nowait(f"node {name} went down ({reason})")
        self._nursery_soon(self.mailbox.forget, peer)

    def _nursery_soon(self, fn: object, *args: object) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(fn, *args)  # type: ignore[arg-type]

    # -- generation --------------------------------------------------------------------------------------

    @asynccontextmanager
    async def generate(self, prompt_ids: list[int], params: GenerationParams,
                       ) -> AsyncIterator[AsyncIterator[TokenEvent]]:
        plan = await self.deployment.wait_ready(self.ready_timeout_s)
        if plan is None:
            raise GenerationError(f"no pipeline is ready to serve: {self.deployment.why_not_ready()}",
                                  status=503, code="no_capacity")
        session_id = SessionId(f"s{next(self._ids)}-{secrets.token_hex(6)}")
        send, recv = trio.open_memory_channel[_Inbound](16)
        session = _Session(list(plan.stages), send)
        self._sessions[session_id] = session
        try:
            yield self._events(session_id, session, prompt_ids, params, recv)
        finally:
            del self._sessions[session_id]
            self._nursery_soon(self._release, session_id, session.route)

    async def _release(self, session: SessionId, route: list[Stage]) -> None:
        self._releasing += 1
        try:
            for stage in route:
                with trio.move_on_after(5):
                    try:
                        await self.mailbox.send(NodeId(stage.peer), Release(session=session))
                    except HetnodeError as exc:
                        log.info("release of %s at %s failed: %s", session, stage.peer, exc)
        finally:
            self._releasing -= 1
            if not self._releasing:
                self._released.set()
                self._released = trio.Event()

    async def wait_released(self) -> None:
        """Until every finished session's Release has been handed to its stages' streams."""
        if self._releasing:
            await self._released.wait()

    async def _events(self, session_id: SessionId, session: _Session, prompt_ids: list[int],
                      params: GenerationParams, recv: trio.MemoryReceiveChannel[_Inbound],
                      ) -> AsyncIterator[TokenEvent]:
        cursor = SessionCursor(session_id, prompt_ids, params, self.prefill_chunk)
        sampling = wire_sampling(params.sampling)
        first = NodeId(session.route[0].peer)
        while not cursor.finished:
            item = cursor.next_item()
            assert item.token_ids is not None
            meta, raw = to_wire(token_tensor(list(item.token_ids)))
            fwd = Forward(session=session_id, start=item.start, route=session.route, stage=0,
                          reply_to=self.transport.peer_id, sampling=sampling if item.sampling else None,
                          tensor=meta)
            try:
                await self.mailbox.send(first, fwd, raw)
            except HetnodeError as exc:
                raise GenerationError(f"the first stage is unreachable: {exc}", status=502,
                                      code="stage_unreachable") from exc
            msg = None
            with trio.move_on_after(self.step_timeout_s):
                msg = await recv.receive()
            if msg is None:
                raise GenerationError(f"no answer from the pipeline within {self.step_timeout_s:g} s",
                                      status=504, code="timeout")
            if isinstance(msg, str):
                raise GenerationError(msg, status=502, code="node_down")
            if isinstance(msg, StageFailed):
                who = self.registry.nodes.get(NodeId(msg.stage_peer))
                raise GenerationError(f"stage {who.name if who else msg.stage_peer} failed: {msg.reason}",
                                      status=502, code="stage_failed")
            if msg.start != item.start:
                raise GenerationError(f"out-of-order result (position {msg.start}, expected {item.start})",
                                      status=502, code="protocol_error")
            token = msg.token if isinstance(msg, TokenOut) else None
            stopped = msg.stopped if isinstance(msg, TokenOut) else False
            if cursor.advance(item, token, stopped):
                assert isinstance(msg, TokenOut)
                top = tuple((int(t), float(lp)) for t, lp in msg.top_logprobs) if msg.top_logprobs else None
                yield TokenEvent(msg.token, msg.logprob, top, msg.stopped)
