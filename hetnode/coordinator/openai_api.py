"""OpenAI-compatible endpoints over a `Generator`: /v1/models, /v1/completions, /v1/chat/completions.

    app = build_app(coordinator, api_key=key, extra_routes=openai_routes(generator, metrics=[metrics]))

Answers follow OpenAI's shapes, so the official clients work unchanged. Streaming answers are server-sent
events, `data: {chunk}` each, ending with `data: [DONE]`.

A generation answers with an HTTP error (GenerationError's status and message) if it fails before its first
token, and with an SSE `{"error": ...}` event (then `[DONE]`) if it fails mid-stream, since by then the status
line is sent. Streaming answers wait for the first token before sending their headers for that reason.

Every answer watches for the client going away: then the generation is cancelled, which leaves the generator's
context and so frees the session's KV at once, streaming or not.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from hetnode.coordinator import openai_spec
from hetnode.coordinator.generation import GenerationError, Generator
from hetnode.coordinator.openai_output import (
    Generation,
    Sink,
    TokenLogprob,
    TokenPieces,
    chat_logprobs,
    completion_logprobs,
    run_generation,
)
from hetnode.coordinator.openai_schema import (
    ApiError,
    GenerationRequest,
    PendingRequest,
    check_model,
    error_body,
    load_body,
    parse_chat,
    parse_completion,
)
from hetnode.coordinator.openapi import DocumentedRoute
from hetnode.coordinator.tokenizing import SHORT_PROMPT_CHARS, PromptTokenizer

log = logging.getLogger(__name__)


Outcome = Literal["completed", "cancelled", "client_error", "server_error"]
OUTCOMES: tuple[Outcome, ...] = ("completed", "cancelled", "client_error", "server_error")


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One finished (or refused, or abandoned) completion request, for metrics."""

    endpoint: str  # "completions" or "chat.completions"
    status: int  # the HTTP status, or the error's status for an error reported mid-stream
    stream: bool
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None  # "stop" or "length"; None for errors and clients that left
    client_gone: bool
    time_to_first_token_s: float | None
    duration_s: float

    @property
    def outcome(self) -> Outcome:
        """completed: answered to its end; cancelled: the client left first; client_error: refused with a 4xx;
        server_error: the rest (a 5xx, or a stream that ended with an error event). The one classification
        that /metrics and the dashboard both count by."""
        if self.client_gone:
            return "cancelled"
        if self.status == 200 and self.finish_reason is not None:
            return "completed"
        return "client_error" if 400 <= self.status < 500 else "server_error"

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: only for requests that produced two tokens or more."""
        ttft = self.time_to_first_token_s
        if ttft is None or self.completion_tokens < 2:
            return None
        return max(0.0, self.duration_s - ttft) / (self.completion_tokens - 1)


class ApiMetrics(Protocol):
    def observe_request(self, record: RequestRecord) -> None: ...


def openai_routes(generator: Generator, *, metrics: Sequence[ApiMetrics] = (),
                  short_prompt_chars: int = SHORT_PROMPT_CHARS) -> list[Route]:
    """The OpenAI routes, to pass to `build_app(extra_routes=...)`.

    metrics: what each ended request is reported to (the coordinator's Prometheus counters, the dashboard's
    LiveStats). short_prompt_chars: prompts up to this long are tokenized in a lane of their own (see
    tokenizing.py)."""
    api = _OpenAIApi(generator, metrics, short_prompt_chars)
    ops = openai_spec.operations(generator.model_name, vocab_size=generator.model_config.vocab_size,
                                 max_chars=api.tokenizing.max_chars)
    return [
        DocumentedRoute("/v1/models", api.list_models, method="GET", operation=ops["list_models"]),
        DocumentedRoute("/v1/models/{model:path}", api.get_model, method="GET", operation=ops["get_model"]),
        DocumentedRoute("/v1/completions", api.completions, method="POST", operation=ops["completions"]),
        DocumentedRoute("/v1/chat/completions", api.chat_completions, method="POST",
                        operation=ops["chat_completions"]),
    ]


class _OpenAIApi:
    def __init__(self, generator: Generator, metrics: Sequence[ApiMetrics], short_prompt_chars: int) -> None:
        self.generator = generator
        self.metrics = tuple(metrics)
        self.created = int(time.time())
        self.pieces = TokenPieces(generator.tokenizer)
        self.tokenizing = PromptTokenizer(generator.tokenizer, short_chars=short_prompt_chars,
                                          context_len=generator.model_config.max_position_embeddings)

    def _model(self) -> dict[str, Any]:
        return {"id": self.generator.model_name, "object": "model", "created": self.created, "owned_by": "hetnode"}

    async def list_models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model()]})

    async def get_model(self, request: Request) -> Response:
        try:
            check_model({"model": request.path_params["model"]}, self.generator)
        except ApiError as exc:
            return exc.response()
        return JSONResponse(self._model())

    async def completions(self, request: Request) -> Response:
        return await self._generation(request, parse_completion, "completions")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generation(request, parse_chat, "chat.completions")

    async def _generation(self, request: Request, parse: Callable[..., PendingRequest], endpoint: str) -> Response:
        start = trio.current_time()
        try:
            # Every check but the length in tokens runs first, on the event loop (they are quick), so that a
            # request refused for its size never waits for, or takes, a tokenizing thread.
            pending = parse(load_body(await request.body()), self.generator, max_chars=self.tokenizing.max_chars)
            req = pending.finish(await self._tokenize(pending), self.generator)
            # The request id (request_ids.py) goes with the generation to every hop, and keys its trace.
            trace_id = getattr(request.state, "request_id", "")
            req = dataclasses.replace(req, params=dataclasses.replace(req.params, trace_id=trace_id))
        except ApiError as exc:
            self._record_refusal(endpoint, start, exc.status)
            return exc.response()
        return _GenerationResponse(self, req, endpoint, start)

    async def _tokenize(self, pending: PendingRequest) -> list[int]:
        if pending.ids is not None:
            return pending.ids
        if pending.text is not None:
            return await self.tokenizing.encode(pending.text)
        assert pending.messages is not None
        try:
            return await self.tokenizing.chat(pending.messages)
        except Exception as exc:  # the template's own error (jinja2 raises what the template author chose)
            raise ApiError(f"the model's chat template cannot render these messages: {exc}",
                           param="messages") from exc

    def _record_refusal(self, endpoint: str, start: float, status: int) -> None:
        self.record(RequestRecord(endpoint, status, False, 0, 0, None, False, None, trio.current_time() - start))

    def record(self, record: RequestRecord) -> None:
        """The one place an ended request is reported: every observer sees the same record."""
        for observer in self.metrics:
            observer.observe_request(record)


class _GenerationResponse(Response):
    """Runs the generation when Starlette sends the response, under a watch for the client disconnecting.

    A Response only to fit Starlette's endpoint signature: it sends everything itself, so Response's own fields
    (body, headers) are never set or used.
    """

    def __init__(self, api: _OpenAIApi, req: GenerationRequest, endpoint: str, start: float) -> None:
        self.api, self.req, self.endpoint, self.start = api, req, endpoint, start
        prefix = "chatcmpl" if req.chat else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.status = 200
        self.gen = Generation()  # filled in as the generation runs, so a cut-short one is still counted
        self.headers_sent = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = answered = handed = False
        failure: Exception | None = None

        async def send_final(message: Message) -> None:
            nonlocal handed
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                handed = True  # the whole answer is the server's now: a disconnect from here on is not a leave
            await send(message)

        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                nonlocal gone
                # The body was read whole before this response ran, so the next message is the disconnect.
                while (await receive())["type"] != "http.disconnect":
                    pass
                # Some servers (and httpx's ASGI transport) report a disconnect once the answer is complete.
                if not answered and not handed:
                    gone = True
                    nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            try:
                await (self._stream(send_final) if self.req.stream else self._whole(send_final))
                answered = True
            except Exception as exc:  # re-raised below: raised inside the nursery it would come out in a group
                failure = exc
            nursery.cancel_scope.cancel()
        gen = self.gen
        self.api.record(RequestRecord(
            self.endpoint, self.status, self.req.stream, len(self.req.prompt_ids), gen.completion_tokens,
            gen.finish_reason if answered and self.status == 200 else None, gone,
            gen.first_token_at - self.start if gen.first_token_at is not None else None,
            trio.current_time() - self.start))
        if failure is not None:
            raise failure

    # -- whole answers ----------------------------------------------------------------------------------------

    async def _whole(self, send: Send) -> None:
        sink = _Collector()
        try:
            gen = await run_generation(self.api.generator, self.req, sink, self.gen)
        except GenerationError as exc:
            self.status = exc.status
            await _send_json(send, exc.status, {"error": error_body(str(exc), status=exc.status, code=exc.code)})
            return
        text = "".join(sink.texts)
        pieces = self.api.pieces.ids() if self.req.tokens_as_ids else self.api.pieces
        if self.req.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": chat_logprobs(sink.logprobs, pieces) if self.req.logprobs is not None else None,
                "finish_reason": gen.finish_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": completion_logprobs(sink.logprobs, pieces, self.req.logprobs)
                if self.req.logprobs is not None else None,
                "finish_reason": gen.finish_reason,
            }
        body = self._envelope("chat.completion" if self.req.chat else "text_completion", [choice])
        body["usage"] = self._usage(gen)
        await _send_json(send, 200, body, _route_header(gen))

    # -- streams ----------------------------------------------------------------------------------------------

    async def _stream(self, send: Send) -> None:
        sink = _SseSink(self, send)
        try:
            gen = await run_generation(self.api.generator, self.req, sink, self.gen)
        except GenerationError as exc:
            self.status = exc.status
            error = {"error": error_body(str(exc), status=exc.status, code=exc.code)}
            if not self.headers_sent:
                await _send_json(send, exc.status, error)
                return
            await sink.event(error)
            await sink.done()
            return
        await sink.begin()  # a generation that ended without a single token still gets a well-formed stream
        if self.req.chat:
            final: dict[str, Any] = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": gen.finish_reason}
        else:
            final = {"index": 0, "text": "", "logprobs": None, "finish_reason": gen.finish_reason}
        await sink.event(self._chunk(final))
        if self.req.include_usage:
            await sink.event({**self._chunk(None), "usage": self._usage(gen)})
        await sink.done()

    def _chunk(self, choice: dict[str, Any] | None) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.req.chat else "text_completion",
                              [] if choice is None else [choice])
        if self.req.include_usage:
            body["usage"] = None  # as OpenAI: every chunk has the field; only the last one fills it
        return body

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.req.model,
                "system_fingerprint": None, "choices": choices}

    def _usage(self, gen: Generation) -> dict[str, int]:
        prompt = len(self.req.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": gen.completion_tokens,
                "total_tokens": prompt + gen.completion_tokens}


class _Collector(Sink):
    def __init__(self) -> None:
        self.texts: list[str] = []
        self.logprobs: list[TokenLogprob] = []

    async def begin(self) -> None:
        pass

    async def piece(self, text: str, logprobs: list[TokenLogprob]) -> None:
        self.texts.append(text)
        self.logprobs.extend(logprobs)


class _SseSink(Sink):
    def __init__(self, response: _GenerationResponse, send: Send) -> None:
        self.response = response
        self.send = send

    async def begin(self) -> None:
        r = self.response
        if r.headers_sent:
            return
        r.headers_sent = True
        await self.send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),  # nginx in front: pass the events through as they come
            *_route_header(r.gen),
        ]})
        if r.req.chat:
            delta = {"role": "assistant", "content": "", "refusal": None}
            await self.event(r._chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}))

    async def piece(self, text: str, logprobs: list[TokenLogprob]) -> None:
        r = self.response
        pieces = r.api.pieces.ids() if r.req.tokens_as_ids else r.api.pieces
        if r.req.chat:
            lp = chat_logprobs(logprobs, pieces) if r.req.logprobs is not None else None
            choice = {"index": 0, "delta": {"content": text}, "logprobs": lp, "finish_reason": None}
        else:
            lp = completion_logprobs(logprobs, pieces, r.req.logprobs) if r.req.logprobs is not None else None
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": None}
        await self.event(r._chunk(choice))

    async def event(self, data: dict[str, Any]) -> None:
        await self.send({"type": "http.response.body", "body": b"data: " + _dumps(data) + b"\n\n",
                         "more_body": True})

    async def done(self) -> None:
        await self.send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def _dumps(data: Any) -> bytes:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


def _route_header(gen: Generation) -> list[tuple[bytes, bytes]]:
    """Which nodes served the request (the route it started on), for operators and benchmarks."""
    return [(b"x-hetnode-route", gen.route.encode("ascii", "replace"))] if gen.route else []


async def _send_json(send: Send, status: int, data: Any, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = _dumps(data)
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
