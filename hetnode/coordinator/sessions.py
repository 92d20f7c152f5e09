"""Requests through the network: the coordinator's `Generator` over a pipeline of nodes (Helix §2.1).

For each request the coordinator asks `route_for` for a pipeline (today: the ready plan's stages), sends the
prompt's token ids to the first stage (in prefill chunks), and waits for the last stage's token; each decode
step sends that token back to the first stage over the same route. Each stage keeps the session's KV for its
layers; leaving the generation (finished, client gone, failure) sends a Release to every stage.

A request outlives the route it started on. When a node of its route goes down, a stage fails the step
(StageFailed: a dead neighbour, or "unknown session"/"shard replaced" after a re-plan), the first stage is
unreachable, or a step times out, the request moves: its session on the old route is released on the stages
still up, `route_for` gives a route that avoids the nodes that failed it, and a fresh session there re-prefills
the prompt plus every token generated so far, sampling the next token from the last chunk. The client's
stream just goes on (greedy output equals an undisturbed run). After `max_reroutes` moves, or when no route of
live nodes appears in time, the request ends with a clear error.
"""

from __future__ import annotations

import itertools
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass

import trio
from transformers import PreTrainedTokenizerBase

from hetnode.coordinator.cursor import SessionCursor
from hetnode.coordinator.deployment import Deployment
from hetnode.coordinator.generation import GenerationError, GenerationParams, TokenEvent
from hetnode.coordinator.registry import Registry
from hetnode.errors import HetnodeError
from hetnode.ids import NodeId, SessionId
from hetnode.models.config import ModelConfig
from hetnode.node.engine.base import StepItem
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

RouteFor = Callable[[set[NodeId]], Awaitable[list[Stage]]]
"""A pipeline of up nodes that covers every layer once and uses no node of `exclude`. It waits until there
is one; the caller bounds the wait."""


def wire_sampling(p: SamplingParams) -> Sampling:
    return Sampling(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                    seed=None if p.seed is None else p.seed % (1 << 63),
                    stop_token_ids=list(p.stop_token_ids), logprobs=p.logprobs)


class _Session:
    """One request's presence on one route: the session id its stages know it by, and its inbox."""

    def __init__(self, session_id: SessionId, route: list[Stage]) -> None:
        self.id = session_id
        self.route = route
        self.peers = {NodeId(s.peer) for s in route}
        # At most one item is in flight, so a few slots hold its answer and any failure notices beside it.
        self.send, self.recv = trio.open_memory_channel[_Inbound](16)


@dataclass(frozen=True)
class _Lost:
    """Why a route cannot go on with a request; `suspects` are nodes to avoid until liveness judges them."""

    reason: str
    code: str  # node_down, stage_failed, stage_unreachable, timeout
    suspects: frozenset[NodeId] = frozenset()


class _Request:
    def __init__(self, session: _Session) -> None:
        self.session = session


class PipelineGenerator:
    def __init__(self, transport: Transport, registry: Registry, deployment: Deployment, *, model_name: str,
                 model_config: ModelConfig, tokenizer: PreTrainedTokenizerBase, prefill_chunk: int = 512,
                 step_timeout_s: float = 120.0, ready_timeout_s: float = 30.0, max_reroutes: int = 3,
                 route_for: RouteFor | None = None) -> None:
        self.transport = transport
        self.registry = registry
        self.deployment = deployment
        self.model_name = model_name
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.prefill_chunk = prefill_chunk
        self.step_timeout_s = step_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.max_reroutes = max_reroutes
        # Where requests go: by default each request's own pipeline from the plan's scheduler; tests inject
        # a fixed policy.
        self.route_for: RouteFor | None = route_for
        self.mailbox = Mailbox(transport, INFER_PROTOCOL, infer_decoder, self._on_message, registry.is_member)
        self._sessions: dict[SessionId, _Session] = {}
        self._ids = itertools.count()
        self._nursery: trio.Nursery | None = None
        self._releasing = 0
        self._released = trio.Event()
        self._active = 0
        self.reroutes = 0  # moves of requests to another route, since start

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.mailbox.install()
            task_status.started()
            await trio.sleep_forever()

    @property
    def active_sessions(self) -> int:
        """Requests in flight (a request that is moving between routes counts once)."""
        return self._active

    async def _route(self, session: SessionId, input_len: int, exclude: set[NodeId]) -> list[Stage]:
        """A pipeline of up nodes avoiding `exclude`, waiting for one (the caller bounds the wait)."""
        if self.route_for is not None:
            return await self.route_for(exclude)
        return await self.deployment.route(session, input_len, exclude)

    def _new_id(self) -> SessionId:
        return SessionId(f"s{next(self._ids)}-{secrets.token_hex(6)}")

    # -- inbound -----------------------------------------------------------------------------------------

    async def _on_message(self, peer: NodeId, msg: object, payload: bytes | None) -> None:
        if not isinstance(msg, TokenOut | ChunkDone | StageFailed):
            log.warning("unexpected %s from %s on the data path", type(msg).__name__, peer)
            return
        session = self._sessions.get(SessionId(msg.session))
        # Only a stage of the session's own route may speak for it (a moved request's old session is gone).
        if session is None or peer not in session.peers:
            return
        try:
            session.send.send_nowait(msg)
        except trio.WouldBlock:
            log.warning("session %s: result from %s dropped (inbox full)", msg.session, peer)

    def node_down(self, peer: NodeId, reason: str) -> None:
        """Tell every session whose route runs through `peer`: its request moves to another route."""
        for session in self._sessions.values():
            if peer in session.peers:
                with suppress(trio.WouldBlock):
                    session.send.send_nowait(f"node {self._name(peer)} went down ({reason})")
        self._nursery_soon(self.mailbox.forget, peer)

    def _name(self, peer: NodeId) -> str:
        record = self.registry.nodes.get(peer)
        return record.name if record else str(peer)

    def _nursery_soon(self, fn: object, *args: object) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(fn, *args)  # type: ignore[arg-type]

    # -- sessions ----------------------------------------------------------------------------------------

    def _open(self, session_id: SessionId, route: list[Stage]) -> _Session:
        session = _Session(session_id, route)
        self._sessions[session.id] = session
        return session

    def _close(self, session: _Session, output_len: int | None) -> None:
        """Forget the session, tell the scheduler (after `output_len` tokens, or None: moved away), and free
        its KV on every stage of its route."""
        self.deployment.route_done(session.id, output_len)
        if self._sessions.pop(session.id, None) is None or self._nursery is None:
            return
        # Counted now, not when the task starts, so that wait_released right after a generation sees it.
        self._releasing += 1
        self._nursery.start_soon(self._release, session.id, session.route)

    async def _release(self, session: SessionId, route: list[Stage]) -> None:
        async def one(peer: NodeId) -> None:
            with trio.move_on_after(5):
                try:
                    await self.mailbox.send(peer, Release(session=session))
                except HetnodeError as exc:
                    log.info("release of %s at %s failed: %s", session, self._name(peer), exc)

        try:
            # Every stage, even one marked down: it may be back, still holding the KV. Concurrently, so a dead
            # one does not hold up the others.
            async with trio.open_nursery() as nursery:
                for stage in route:
                    nursery.start_soon(one, NodeId(stage.peer))
        finally:
            self._releasing -= 1
            if not self._releasing:
                self._released.set()
                self._released = trio.Event()

    async def wait_released(self) -> None:
        """Until every finished session's Release has been handed to its stages' streams."""
        if self._releasing:
            await self._released.wait()

    # -- generation --------------------------------------------------------------------------------------

    @asynccontextmanager
    async def generate(self, prompt_ids: list[int], params: GenerationParams,
                       ) -> AsyncIterator[AsyncIterator[TokenEvent]]:
        cursor = SessionCursor(SessionId(""), prompt_ids, params, self.prefill_chunk)
        route = None
        session_id = self._new_id()
        try:
            with trio.move_on_after(self.ready_timeout_s):
                route = await self._route(session_id, len(prompt_ids), set())
        except BaseException:
            self.deployment.route_done(session_id, None)
            raise
        if route is None:
            raise GenerationError(f"no pipeline is ready to serve: {self.deployment.why_not_ready()}",
                                  status=503, code="no_capacity")
        request = _Request(self._open(session_id, route))
        cursor.restart(request.session.id)
        self._active += 1
        try:
            yield self._events(request, cursor)
        finally:
            self._active -= 1
            self._close(request.session, len(cursor.generated))

    async def _events(self, request: _Request, cursor: SessionCursor) -> AsyncIterator[TokenEvent]:
        sampling = wire_sampling(cursor.params.sampling)
        moves = 0
        while not cursor.finished:
            item = cursor.next_item()
            msg = await self._step(request.session, item, sampling)
            if isinstance(msg, _Lost):
                moves += 1
                if moves > self.max_reroutes:
                    raise GenerationError(f"{msg.reason}; giving up after {self.max_reroutes} re-routes",
                                          status=502, code=msg.code)
                await self._move(request, cursor, msg, moves)
                continue
            if msg.start != item.start:
                raise GenerationError(f"out-of-order result (position {msg.start}, expected {item.start})",
                                      status=502, code="protocol_error")
            token = msg.token if isinstance(msg, TokenOut) else None
            stopped = msg.stopped if isinstance(msg, TokenOut) else False
            if cursor.advance(item, token, stopped):
                assert isinstance(msg, TokenOut)
                top = tuple((int(t), float(lp)) for t, lp in msg.top_logprobs) if msg.top_logprobs else None
                yield TokenEvent(msg.token, msg.logprob, top, msg.stopped)

    async def _step(self, session: _Session, item: StepItem, sampling: Sampling) -> TokenOut | ChunkDone | _Lost:
        """Run one item through the session's route: its result, or why the route lost the request."""
        assert item.token_ids is not None
        meta, raw = to_wire(token_tensor(list(item.token_ids)))
        fwd = Forward(session=session.id, start=item.start, route=session.route, stage=0,
                      reply_to=self.transport.peer_id, sampling=sampling if item.sampling else None, tensor=meta)
        first = NodeId(session.route[0].peer)
        # The send is under the deadline too: a stream to a dying peer can block before it fails.
        with trio.move_on_after(self.step_timeout_s):
            try:
                await self.mailbox.send(first, fwd, raw)
            except HetnodeError as exc:
                return _Lost(f"the first stage {self._name(first)} is unreachable: {exc}", "stage_unreachable",
                             frozenset({first}))
            msg = await session.recv.receive()
            if isinstance(msg, str):
                return _Lost(msg, "node_down")
            if isinstance(msg, StageFailed):
                suspects = frozenset({NodeId(msg.unreachable)}) if msg.unreachable else frozenset()
                return _Lost(f"stage {self._name(NodeId(msg.stage_peer))} failed: {msg.reason}", "stage_failed",
                             suspects)
            return msg
        return _Lost(f"no answer from the pipeline within {self.step_timeout_s:g} s", "timeout")

    async def _move(self, request: _Request, cursor: SessionCursor, lost: _Lost, move: int) -> None:
        """Put the request on a route of live nodes, ready to re-prefill what it has so far."""
        old = request.session
        self._close(old, None)
        session_id = self._new_id()
        route = await self._reroute(lost, session_id, len(cursor.prompt) + len(cursor.generated))
        request.session = self._open(session_id, route)
        cursor.restart(request.session.id)
        self.reroutes += 1
        log.warning("session %s moved to %s as %s (re-route %d of %d, re-prefilling %d tokens): %s", old.id,
                    " -> ".join(self._name(NodeId(s.peer)) for s in route), request.session.id, move,
                    self.max_reroutes, len(cursor.prompt) + len(cursor.generated), lost.reason)

    async def _reroute(self, lost: _Lost, session_id: SessionId, input_len: int) -> list[Stage]:
        """A route without the nodes that failed: suspects (alive as far as liveness knows) are avoided for
        long enough for a dead one to be marked down; after that only liveness decides."""
        deadline = trio.current_time() + self.ready_timeout_s
        route = None
        if lost.suspects:
            with trio.move_on_after(min(self.ready_timeout_s, 2 * self.registry.heartbeat_deadline_s)):
                route = await self._route(session_id, input_len, set(lost.suspects))
        if route is None:
            with trio.move_on_at(deadline):
                route = await self._route(session_id, input_len, set())
        if route is None:
            raise GenerationError(f"{lost.reason}; no pipeline of live nodes to move the request to within "
                                  f"{self.ready_timeout_s:g} s: {self.deployment.why_not_ready()}",
                                  status=503, code=lost.code)
        return route
