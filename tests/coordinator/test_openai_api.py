"""The OpenAI-compatible endpoints in process, over a real engine (a tiny random Llama) and LocalGenerator."""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import trio
import trio.testing
from starlette.applications import Starlette

from hetnode.coordinator.api import MAX_BODY_BYTES, build_app
from hetnode.coordinator.daemon import Coordinator, CoordinatorConfig
from hetnode.coordinator.generation import GenerationParams, Generator, TokenEvent
from hetnode.coordinator.local import LocalGenerator
from hetnode.coordinator.openai_api import ApiMetrics, RequestRecord, openai_routes
from hetnode.coordinator.sessions import RoutedEvents
from hetnode.coordinator.tokenizing import max_token_chars
from hetnode.ids import SessionId
from hetnode.models.tiny import write_tiny_model
from hetnode.models.tokenizer import chat_prompt_ids, load_tokenizer
from hetnode.node.engine import Completion, EngineConfig, LocalPipeline, Request, SamplingParams, TorchEngine
from hetnode.policy import PREEMPTED
from hetnode.protocol.memory import MemoryNetwork

MODEL = "tiny-llama"
CTX = 256  # the tiny model's max_position_embeddings


# -- fixtures -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[TorchEngine]:
    e = TorchEngine.load(model_dir)
    yield e
    e.close()


@pytest.fixture(scope="module")
def small_kv_engine(model_dir: Path) -> Iterator[TorchEngine]:
    """KV for 16 tokens: a 20-token prompt is refused before its first token (it can never fit); a 6-token one
    is preempted when its decode needs a 17th token of KV and nothing else could run."""
    e = TorchEngine.load(model_dir, engine_config=EngineConfig(block_size=4, num_kv_blocks=4))
    yield e
    e.close()


@pytest.fixture(scope="module")
def reference(model_dir: Path, tokenizer: Any) -> Iterator[Reference]:
    e = TorchEngine.load(model_dir)
    yield Reference(LocalPipeline([e]), tokenizer)
    e.close()


class Reference:
    """The engine's own greedy generation, without the API, the batch loop or LocalGenerator."""

    def __init__(self, pipeline: LocalPipeline, tokenizer: Any) -> None:
        self.pipeline, self.tokenizer = pipeline, tokenizer
        self.eos = (tokenizer.eos_token_id,)
        self._n = 0

    def run(self, prompt_ids: list[int], max_tokens: int, **sampling: Any) -> Completion:
        self._n += 1
        params = SamplingParams(stop_token_ids=self.eos, **sampling)
        (done,) = self.pipeline.generate([Request(SessionId(f"ref{self._n}"), prompt_ids, max_tokens, params)])
        return done

    def tokens(self, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], str]:
        done = self.run(prompt_ids, max_tokens)
        return done.tokens, done.finish_reason

    def text(self, tokens: list[int]) -> str:
        if tokens and tokens[-1] in self.eos:
            tokens = tokens[:-1]
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))


async def start_generator(engine: TorchEngine, tokenizer: Any, nursery: trio.Nursery) -> LocalGenerator:
    # LocalGenerator.open loads a model per test; the engines here are loaded once per module instead.
    gen = LocalGenerator(MODEL, engine, tokenizer)
    await nursery.start(gen.loop.run)
    return gen


@pytest.fixture
async def gen(engine: TorchEngine, tokenizer: Any, nursery: trio.Nursery) -> LocalGenerator:
    return await start_generator(engine, tokenizer, nursery)


@asynccontextmanager
async def api_app(generator: Generator, *metrics: ApiMetrics, **options: Any,
                  ) -> AsyncIterator[Starlette]:
    """The coordinator's real app (middleware, error handlers) with the OpenAI routes."""
    async with MemoryNetwork().transport("coord") as transport:
        yield build_app(Coordinator(CoordinatorConfig(token="t"), transport),
                        extra_routes=openai_routes(generator, metrics=metrics, **options))


@asynccontextmanager
async def api_client(generator: Generator, **options: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with api_app(generator, **options) as app, httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://api", timeout=30
    ) as client:
        yield client


@pytest.fixture
async def client(gen: LocalGenerator) -> AsyncIterator[httpx.AsyncClient]:
    async with api_client(gen) as c:
        yield c
    await kv_drained(gen.engine)  # every test leaves no session behind


async def kv_drained(engine: TorchEngine) -> None:
    """Wait (without sleeping) until the batch loop has freed every session's KV."""
    with trio.fail_after(5):
        while engine.kv_usage().sessions:
            await trio.testing.wait_all_tasks_blocked(cushion=0.01)  # a bare spin starves the worker thread of the GIL
    assert engine.kv_usage().used_blocks == 0


# -- helpers --------------------------------------------------------------------------------------------------


async def post(client: httpx.AsyncClient, path: str, **body: Any) -> dict[str, Any]:
    r = await client.post(path, json={"model": MODEL, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return dict(r.json())


async def stream(client: httpx.AsyncClient, path: str, **body: Any) -> list[dict[str, Any]]:
    r = await client.post(path, json={"model": MODEL, "temperature": 0, "stream": True, **body})
    assert r.status_code == 200, r.text
    return sse_events(r.text, r.headers["content-type"])


def sse_events(text: str, content_type: str = "text/event-stream") -> list[dict[str, Any]]:
    """The JSON events of an SSE body, checked to be `data: ...` blocks ending with `data: [DONE]`."""
    assert content_type.startswith("text/event-stream")
    blocks = text.split("\n\n")
    assert blocks[-1] == "", "the stream must end with a blank line"
    assert all(b.startswith("data: ") for b in blocks[:-1])
    data = [b.removeprefix("data: ") for b in blocks[:-1]]
    assert data[-1] == "[DONE]" and "[DONE]" not in data[:-1]
    return [json.loads(d) for d in data[:-1]]


def chat_text(events: list[dict[str, Any]]) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])


def completion_text(events: list[dict[str, Any]]) -> str:
    return "".join(e["choices"][0]["text"] for e in events if e["choices"])


class Recorder:
    def __init__(self) -> None:
        self.records: list[RequestRecord] = []

    def observe_request(self, record: RequestRecord) -> None:
        self.records.append(record)


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


PROMPT = "The capital of France is"
USER = [{"role": "user", "content": "hi"}]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                 {"type": "text", "text": "of Spain?"}]},
]


# -- tests ----------------------------------------------------------------------------------------------------


async def test_models(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    (model,) = body["data"]
    assert model["id"] == MODEL and model["object"] == "model" and isinstance(model["created"], int)
    assert model["owned_by"]
    assert (await client.get(f"/v1/models/{MODEL}")).json() == model
    r = await client.get("/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_completion_greedy_equals_engine(client: httpx.AsyncClient, reference: Reference,
                                               tokenizer: Any) -> None:
    ids = tokenizer.encode(PROMPT)
    tokens, finish = reference.tokens(ids, 12)
    assert finish == "length"
    body = await post(client, "/v1/completions", prompt=PROMPT, max_tokens=12)
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert abs(body["created"] - time.time()) < 60 and body["model"] == MODEL
    assert body["system_fingerprint"] is None
    (choice,) = body["choices"]
    assert choice == {"index": 0, "text": reference.text(tokens), "logprobs": None, "finish_reason": "length"}
    assert body["usage"] == usage(len(ids), 12)
    # The same prompt as token ids, and as a batch of one (string or ids), gives the same text.
    for prompt in (ids, [ids], [PROMPT]):
        again = await post(client, "/v1/completions", prompt=prompt, max_tokens=12)
        assert again["choices"][0]["text"] == choice["text"] and again["usage"] == body["usage"]

    events = await stream(client, "/v1/completions", prompt=PROMPT, max_tokens=12)
    assert completion_text(events) == choice["text"]
    assert all(e["id"] == events[0]["id"] and e["object"] == "text_completion" for e in events)
    assert all("usage" not in e for e in events)  # only with stream_options.include_usage
    assert [e["choices"][0]["finish_reason"] for e in events].count(None) == len(events) - 1
    assert events[-1]["choices"][0] == {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}


async def test_chat_greedy_equals_engine_and_stream_reassembles(client: httpx.AsyncClient, reference: Reference,
                                                                tokenizer: Any) -> None:
    ids = chat_prompt_ids(tokenizer, [MESSAGES[0], {"role": "user", "content": "What is the capital\nof Spain?"}])
    tokens, _ = reference.tokens(ids, 16)
    expected = reference.text(tokens)
    body = await post(client, "/v1/chat/completions", messages=MESSAGES, max_completion_tokens=16)
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": expected, "refusal": None}
    assert choice["finish_reason"] == ("stop" if tokens[-1] in reference.eos else "length")
    assert body["usage"] == usage(len(ids), len(tokens))

    events = await stream(client, "/v1/chat/completions", messages=MESSAGES, max_tokens=16,
                          stream_options={"include_usage": True})
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    assert chat_text(events) == expected
    *content, final, last = events
    assert all(e["choices"][0]["finish_reason"] is None and e["usage"] is None for e in content)
    assert final["choices"][0]["delta"] == {} and final["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert final["usage"] is None
    assert last["choices"] == [] and last["usage"] == body["usage"]

    # "developer" is OpenAI's newer name for the system role.
    developer = [{"role": "developer", "content": "Be brief."}, *MESSAGES[1:]]
    again = await post(client, "/v1/chat/completions", messages=developer, max_completion_tokens=16)
    assert again["choices"][0]["message"]["content"] == expected


async def test_stop_token_finishes_with_stop(client: httpx.AsyncClient, reference: Reference) -> None:
    # A one-token prompt after which greedy decoding reaches EOS within a few tokens (weights are seeded).
    candidates = [Request(SessionId(f"eos{t}"), [t], 6, SamplingParams(stop_token_ids=reference.eos))
                  for t in range(3, 200)]
    found = reference.pipeline.generate(candidates)  # one batch: much faster than one by one
    prompt, tokens = next((r.prompt[0], c.tokens) for r, c in zip(candidates, found, strict=True)
                          if c.finish_reason == "stop" and len(c.tokens) >= 3)
    body = await post(client, "/v1/completions", prompt=[prompt], max_tokens=6)
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["text"] == reference.text(tokens)  # without the EOS token
    assert body["usage"] == usage(1, len(tokens))  # the EOS token counts: it took a step
    events = await stream(client, "/v1/completions", prompt=[prompt], max_tokens=6)
    assert completion_text(events) == reference.text(tokens)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


async def test_stop_strings_across_token_boundaries(client: httpx.AsyncClient, reference: Reference,
                                                    tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello, world! What is two plus two?")
    tokens, _ = reference.tokens(ids, 24)
    full = reference.text(tokens)

    def clean(t: int) -> bool:
        return "\ufffd" not in tokenizer.decode([t]) and t not in reference.eos

    # A stop string of the last character of token i-1 and the first of token i, both whole characters.
    cut = next(i for i in range(2, len(tokens) - 2) if clean(tokens[i - 1]) and clean(tokens[i])
               and tokenizer.decode([tokens[i]]).strip())
    boundary = len(reference.text(tokens[:cut]))
    stop = full[boundary - 1 : boundary + 1]
    expected = full[: full.find(stop)]
    # The stop matches once the token holding its last character is generated.
    needed = next(n for n in range(1, len(tokens) + 1) if stop in reference.text(tokens[:n]))

    body = await post(client, "/v1/completions", prompt=ids, max_tokens=24, stop=["never-seen", stop])
    assert body["choices"][0]["text"] == expected and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == needed  # generation ended there, not at max_tokens
    events = await stream(client, "/v1/completions", prompt=ids, max_tokens=24, stop=stop)
    # Pieces never carry the start of the stop string: what was sent is exactly the text before it.
    assert completion_text(events) == expected
    assert events[-1]["choices"][0]["finish_reason"] == "stop"

    # Chat applies stop strings to the assistant's text in the same way.
    chat_tokens, _ = reference.tokens(chat_prompt_ids(tokenizer, USER), 24)
    chat_full = reference.text(chat_tokens)
    chat_stop = chat_full[4:7]
    chat_expected = chat_full[: chat_full.find(chat_stop)]
    body = await post(client, "/v1/chat/completions", messages=USER, max_tokens=24, stop=chat_stop)
    assert body["choices"][0]["message"]["content"] == chat_expected
    assert body["choices"][0]["finish_reason"] == "stop"
    events = await stream(client, "/v1/chat/completions", messages=USER, max_tokens=24, stop=[chat_stop])
    assert chat_text(events) == chat_expected and events[-1]["choices"][0]["finish_reason"] == "stop"

    # A stop string whose beginning is the end of the text is held back, then released when generation ends.
    tail_stop = full[-2:] + "\x00never"
    body = await post(client, "/v1/completions", prompt=ids, max_tokens=24, stop=tail_stop)
    assert body["choices"][0]["text"] == full
    events = await stream(client, "/v1/completions", prompt=ids, max_tokens=24, stop=[tail_stop])
    assert completion_text(events) == full


async def test_logprobs(client: httpx.AsyncClient, reference: Reference, tokenizer: Any) -> None:
    ids = tokenizer.encode(PROMPT)
    # The reference's logits give the expected log-probabilities of the greedy tokens.
    done = reference.run(ids, 8, return_logits=True)
    expected = [float(torch.log_softmax(lg, -1)[t]) for lg, t in zip(done.logits, done.tokens, strict=True)]

    body = await post(client, "/v1/completions", prompt=PROMPT, max_tokens=8, logprobs=2)
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 8
    assert lp["token_logprobs"] == pytest.approx(expected, abs=1e-4)
    for token, top, value in zip(lp["tokens"], lp["top_logprobs"], lp["token_logprobs"], strict=True):
        assert len(top) == 2 and top[token] == pytest.approx(value) and max(top.values()) == pytest.approx(value)
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])

    body = await post(client, "/v1/chat/completions", messages=MESSAGES, max_tokens=8, logprobs=True,
                      top_logprobs=2)
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] - (body["choices"][0]["finish_reason"] == "stop")
    # Token bytes put together are the answer's text, even where tokens split characters.
    raw = b"".join(bytes(c["bytes"]) for c in content)
    assert raw.decode(errors="replace") == body["choices"][0]["message"]["content"]
    assert all(len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["token"] == c["token"] for c in content)

    events = await stream(client, "/v1/chat/completions", messages=MESSAGES, max_tokens=8, logprobs=True)
    streamed = [c for e in events if e["choices"] and e["choices"][0]["logprobs"]
                for c in e["choices"][0]["logprobs"]["content"]]
    assert [c["token"] for c in streamed] == [c["token"] for c in content]
    assert all(c["top_logprobs"] == [] for c in streamed)


async def test_sampling_parameters(client: httpx.AsyncClient) -> None:
    greedy = (await post(client, "/v1/completions", prompt=PROMPT, max_tokens=8))["choices"][0]["text"]

    async def sampled(**params: Any) -> str:
        return str((await post(client, "/v1/completions", prompt=PROMPT, max_tokens=8, **params))
                   ["choices"][0]["text"])

    assert await sampled(temperature=1.0, seed=7) == await sampled(temperature=1.0, seed=7)
    assert await sampled(temperature=1.5, top_k=1, seed=3) == greedy
    assert await sampled(temperature=1.5, top_p=0.01, seed=3) == greedy
    # Parameters we do not know, or know and ignore, do not get in the way.
    assert await sampled(user="u", frequency_penalty=0, presence_penalty=0, logit_bias={}, metadata={"a": "b"},
                         some_future_option=True, n=1, best_of=1, echo=False) == greedy


async def test_default_max_tokens_stops_at_the_context(client: httpx.AsyncClient) -> None:
    ids = [5 + i % 200 for i in range(CTX - 3)]
    body = await post(client, "/v1/completions", prompt=ids)
    assert body["usage"]["prompt_tokens"] == CTX - 3
    assert body["usage"]["completion_tokens"] <= 3
    assert body["usage"]["completion_tokens"] == 3 or body["choices"][0]["finish_reason"] == "stop"


LONG = "the quick brown fox jumps over the lazy dog " * 40  # well over 256 tokens

BAD_REQUESTS: list[tuple[str, dict[str, Any], str | None, int, str | None]] = [
    # (endpoint, body, param, status, code)
    ("completions", {"model": MODEL}, "prompt", 400, None),
    ("completions", {"model": MODEL, "prompt": 123}, "prompt", 400, None),
    ("completions", {"model": MODEL, "prompt": ["a", "b"]}, "prompt", 400, None),
    ("completions", {"model": MODEL, "prompt": [1, 10**6]}, "prompt", 400, None),
    ("completions", {"model": MODEL, "prompt": [1, True]}, "prompt", 400, None),
    ("completions", {"prompt": "x"}, "model", 400, None),
    ("completions", {"model": "gpt-4", "prompt": "x"}, "model", 404, "model_not_found"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens", 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": "10"}, "max_tokens", 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**6}, "max_tokens", 400,
     "context_length_exceeded"),
    ("completions", {"model": MODEL, "prompt": LONG}, "prompt", 400, "context_length_exceeded"),
    ("completions", {"model": MODEL, "prompt": "x", "temperature": 2.5}, "temperature", 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "temperature": -0.1}, "temperature", 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, "temperature", 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "top_p": 0}, "top_p", 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "top_p": 1.5}, "top_p", 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "top_k": -1}, "top_k", 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "n": 2}, "n", 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "stop": 12}, "stop", 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, "logprobs", 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "echo": True}, "echo", 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "best_of": 3}, "best_of", 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, "stream", 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "seed": 1.5}, "seed", 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage", 400, None),
    ("chat/completions", {"model": MODEL}, "messages", 400, None),
    ("chat/completions", {"model": MODEL, "messages": []}, "messages", 400, None),
    ("chat/completions", {"model": MODEL, "messages": "hi"}, "messages", 400, None),
    ("chat/completions", {"model": MODEL, "messages": ["hi"]}, "messages[0]", 400, None),
    ("chat/completions", {"model": MODEL, "messages": [*USER, {"role": "wizard", "content": "x"}]},
     "messages[1].role", 400, None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]},
     "messages[0].role", 400, None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
     "messages[0].content", 400, None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, "messages[0].content", 400, None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages[0].content[0]", 400, None),
    ("chat/completions", {"model": MODEL, "messages": USER, "top_logprobs": 2}, "top_logprobs", 400, None),
    ("chat/completions", {"model": MODEL, "messages": USER, "logprobs": 1}, "logprobs", 400, None),
    ("chat/completions", {"model": MODEL, "messages": USER, "max_completion_tokens": 0},
     "max_completion_tokens", 400, None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": LONG}]}, "messages", 400,
     "context_length_exceeded"),
    ("chat/completions", {"model": "nope", "messages": USER}, "model", 404, "model_not_found"),
]


@pytest.mark.parametrize(("endpoint", "body", "param", "status", "code"), BAD_REQUESTS,
                         ids=[f"{e}-{p}-{i}" for i, (e, _, p, _, _) in enumerate(BAD_REQUESTS)])
async def test_invalid_requests(client: httpx.AsyncClient, endpoint: str, body: dict[str, Any], param: str,
                                status: int, code: str | None) -> None:
    r = await client.post(f"/v1/{endpoint}", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == code
    assert error["type"] == "invalid_request_error"
    assert error["message"]


async def test_prompt_plus_max_tokens_over_the_context(client: httpx.AsyncClient) -> None:
    ids = list(range(3, 203))
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": CTX - 200 + 1})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
    assert f"maximum context length is {CTX} tokens" in error["message"] and "257" in error["message"]
    body = await post(client, "/v1/completions", prompt=ids, max_tokens=CTX - 200)  # exactly fits
    assert body["usage"]["total_tokens"] <= CTX


async def test_malformed_bodies(client: httpx.AsyncClient) -> None:
    for content in (b"{not json", b"\xff\xfe", b"[1, 2]", b"", b"null"):
        r = await client.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400, content
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = await client.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


async def test_generation_errors_before_and_mid_stream(small_kv_engine: TorchEngine, tokenizer: Any,
                                                       nursery: trio.Nursery) -> None:
    gen = await start_generator(small_kv_engine, tokenizer, nursery)
    async with api_client(gen) as client:
        too_long = {"model": MODEL, "prompt": list(range(3, 23)), "max_tokens": 5}  # 20 tokens > KV for 16
        for stream_it in (False, True):
            r = await client.post("/v1/completions", json={**too_long, "stream": stream_it})
            assert r.status_code == 503 and r.headers["content-type"] == "application/json"
            error = r.json()["error"]
            assert error["type"] == "server_error" and error["code"] == "engine_error"
            # Queueing cannot help a prompt larger than the whole pool: a clear refusal, at once.
            assert "needs 5 KV blocks (20 tokens)" in error["message"] and "pool is 4 blocks" in error["message"]

        runs_out = {"model": MODEL, "prompt": list(range(3, 9)), "max_tokens": 30, "temperature": 0}
        r = await client.post("/v1/completions", json=runs_out)
        # Decode outgrew the pool with nothing else to run: the batch policy preempts the session (a pipeline
        # generator would move it; the single-process one has nowhere to go).
        assert r.status_code == 503 and r.json()["error"]["message"] == PREEMPTED
        r = await client.post("/v1/completions", json={**runs_out, "stream": True})
        assert r.status_code == 200  # the headers went out with the first token
        *chunks, last = sse_events(r.text, r.headers["content-type"])
        assert chunks and all(e["choices"][0]["finish_reason"] is None for e in chunks)
        assert last["error"]["code"] == "engine_error" and last["error"]["message"] == PREEMPTED
    await kv_drained(small_kv_engine)


class Tapped:
    """A real generator, with events for its first token and for leaving its context (to time disconnects)."""

    def __init__(self, inner: LocalGenerator) -> None:
        self.inner = inner
        self.model_name, self.model_config, self.tokenizer = MODEL, inner.model_config, inner.tokenizer
        self.first_token = trio.Event()
        self.left = trio.Event()
        self.tokens = 0

    @asynccontextmanager
    async def generate(self, prompt_ids: list[int], params: GenerationParams,
                       ) -> AsyncIterator[AsyncIterator[TokenEvent]]:
        async def relay(events: AsyncIterator[TokenEvent]) -> AsyncIterator[TokenEvent]:
            async for event in events:
                self.tokens += 1
                self.first_token.set()
                yield event

        try:
            async with self.inner.generate(prompt_ids, params) as events:
                yield relay(events)
        finally:
            self.left.set()


async def drive(app: Starlette, body: dict[str, Any], disconnect: trio.Event) -> list[bytes]:
    """Call the app as a server would, the client going away when `disconnect` is set."""
    payload = json.dumps(body).encode()
    sent: list[bytes] = []
    body_given = False

    async def receive() -> dict[str, Any]:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            sent.append(message.get("body", b""))
            if len(sent) == 2:  # the role chunk and one piece of content
                disconnect.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "server": ("api", 80), "client": ("127.0.0.1", 5555)}
    with trio.fail_after(10):
        await app(scope, receive, send)
    return sent


@pytest.mark.parametrize("streaming", [True, False])
async def test_client_disconnect_cancels_generation_and_frees_kv(gen: LocalGenerator, streaming: bool,
                                                                 nursery: trio.Nursery) -> None:
    tapped = Tapped(gen)
    disconnect = trio.Event()
    recorder = Recorder()
    body = {"model": MODEL, "messages": USER, "max_tokens": 200, "stream": streaming, "temperature": 0}
    async with api_app(tapped, recorder) as app:
        if not streaming:  # a whole answer sends nothing until the end: leave once generation is under way
            async def leave_after_first_token() -> None:
                await tapped.first_token.wait()
                disconnect.set()

            nursery.start_soon(leave_after_first_token)
        sent = await drive(app, body, disconnect)
    assert tapped.left.is_set() and tapped.tokens < 200
    if streaming:
        assert sent[0].startswith(b"data: ") and not any(b"[DONE]" in s for s in sent)
    else:
        assert sent == []  # nobody to answer
    (record,) = recorder.records
    assert record.client_gone and record.finish_reason is None and 0 < record.completion_tokens < 200
    await kv_drained(gen.engine)


async def test_concurrent_requests_match_solo(client: httpx.AsyncClient, reference: Reference,
                                              tokenizer: Any) -> None:
    prompts = ["Hello, world!", "The quick brown fox", "Tokens are a few bytes"]
    results: dict[str, str] = {}

    async def one(p: str) -> None:
        results[p] = (await post(client, "/v1/completions", prompt=p, max_tokens=10))["choices"][0]["text"]

    async with trio.open_nursery() as n:
        for p in prompts:
            n.start_soon(one, p)
    for p in prompts:
        assert results[p] == reference.text(reference.tokens(tokenizer.encode(p), 10)[0])


async def test_metrics_see_every_request(gen: LocalGenerator) -> None:
    recorder = Recorder()
    async with api_app(gen, recorder) as app, httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://api"
    ) as client:
        await post(client, "/v1/completions", prompt=PROMPT, max_tokens=4)
        await stream(client, "/v1/chat/completions", messages=USER, max_tokens=3)
        assert (await client.post("/v1/completions", json={"model": MODEL})).status_code == 400
    done, streamed, refused = recorder.records
    assert (done.endpoint, done.status, done.stream, done.completion_tokens) == ("completions", 200, False, 4)
    assert done.prompt_tokens == len(gen.tokenizer.encode(PROMPT)) and done.finish_reason == "length"
    assert done.time_to_first_token_s is not None and 0 < done.time_to_first_token_s <= done.duration_s
    assert (streamed.endpoint, streamed.stream, streamed.completion_tokens) == ("chat.completions", True, 3)
    assert (refused.status, refused.completion_tokens, refused.finish_reason) == (400, 0, None)
    assert not any(r.client_gone for r in recorder.records)


# -- bad input ------------------------------------------------------------------------------------------------


async def post_raw(client: httpx.AsyncClient, path: str, body: str) -> httpx.Response:
    """POST a body written by hand: JSON that json.dumps would not write (NaN, lone surrogate escapes)."""
    return await client.post(path, content=body.encode(), headers={"content-type": "application/json"})


NON_FINITE = [
    ("completions", '"prompt": "x", "temperature": NaN', "temperature", "NaN"),
    ("completions", '"prompt": "x", "temperature": Infinity', "temperature", "Infinity"),
    ("completions", '"prompt": "x", "top_p": -Infinity', "top_p", "-Infinity"),
    ("completions", '"prompt": "x", "top_p": 1e999', "top_p", "Infinity"),
    ("completions", '"prompt": "x", "presence_penalty": NaN', "presence_penalty", "NaN"),
    ("completions", '"prompt": "x", "frequency_penalty": -1e400', "frequency_penalty", "-Infinity"),
    ("completions", '"prompt": "x", "logit_bias": {"50": NaN}', "logit_bias.50", "NaN"),
    ("chat/completions", '"messages": [{"role": "user", "content": "hi"}], "temperature": NaN', "temperature", "NaN"),
    ("chat/completions", '"messages": [{"role": "user", "content": "hi"}], "metadata": {"a": [1, Infinity]}',
     "metadata.a[1]", "Infinity"),
]


@pytest.mark.parametrize(("endpoint", "fields", "param", "shown"), NON_FINITE,
                         ids=[f"{e}-{p}-{v}" for e, _, p, v in NON_FINITE])
async def test_non_finite_numbers_are_refused_wherever_they_are(client: httpx.AsyncClient, endpoint: str,
                                                                fields: str, param: str, shown: str) -> None:
    r = await post_raw(client, f"/v1/{endpoint}", f'{{"model": "{MODEL}", {fields}}}')
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"] == f"Invalid '{param}': expected a finite number, but got {shown} instead."


async def test_ignored_numeric_parameters_are_still_range_checked(client: httpx.AsyncClient) -> None:
    for fields, param in (({"presence_penalty": 2.5}, "presence_penalty"),
                          ({"frequency_penalty": -3}, "frequency_penalty"),
                          ({"logit_bias": {"7": 101}}, "logit_bias.7"),
                          ({"logit_bias": {"7": "up"}}, "logit_bias.7"),
                          ({"temperature": 10**400}, "temperature")):
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", **fields})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (fields, r.text)


LONE_SURROGATE = [
    ("completions", '"prompt": "\\ud800abc"', "prompt", 0),
    ("completions", '"prompt": ["ab\\udfff"]', "prompt", 2),
    ("chat/completions", '"messages": [{"role": "user", "content": "hi \\ud83d"}]', "messages[0].content", 3),
    ("chat/completions", '"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]',
     "messages[0].content[0].text", 0),
]


@pytest.mark.parametrize(("endpoint", "fields", "param", "at"), LONE_SURROGATE,
                         ids=[f"{e}-{p}" for e, _, p, _ in LONE_SURROGATE])
async def test_lone_surrogate_is_a_clear_400(client: httpx.AsyncClient, endpoint: str, fields: str, param: str,
                                             at: int) -> None:
    r = await post_raw(client, f"/v1/{endpoint}", f'{{"model": "{MODEL}", {fields}}}')
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert f"is not valid Unicode: lone surrogate at character {at}" in error["message"]


async def test_error_quoting_a_lone_surrogate_is_still_an_answer(client: httpx.AsyncClient) -> None:
    r = await post_raw(client, "/v1/completions", '{"model": "gpt\\ud800", "prompt": "x"}')
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "gpt\\ud800" in r.json()["error"]["message"]


class GatedTokenizer:
    """The real tokenizer, counting the prompts it is asked to tokenize and holding those longer than `gate`
    until `release` is set (so that a test sees what happens while a long tokenization is in flight)."""

    def __init__(self, inner: Any, gate: int, calls: list[int] | None = None,
                 entered: threading.Event | None = None, release: threading.Event | None = None) -> None:
        self.inner, self.gate = inner, gate
        self.calls = [] if calls is None else calls  # shared with copies: PromptTokenizer copies its tokenizer
        self.entered = entered or threading.Event()
        self.release = release or threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __deepcopy__(self, memo: dict[int, Any]) -> GatedTokenizer:
        return GatedTokenizer(copy.deepcopy(self.inner, memo), self.gate, self.calls, self.entered, self.release)

    def _call(self, chars: int) -> None:
        self.calls.append(chars)
        if chars > self.gate:
            self.entered.set()
            self.release.wait(30)

    def encode(self, text: str, *args: Any, **kwargs: Any) -> Any:
        self._call(len(text))
        return self.inner.encode(text, *args, **kwargs)

    def apply_chat_template(self, messages: list[dict[str, Any]], *args: Any, **kwargs: Any) -> Any:
        self._call(sum(len(m["content"]) for m in messages))
        return self.inner.apply_chat_template(messages, *args, **kwargs)


async def test_prompt_too_long_in_characters_is_refused_without_tokenizing(engine: TorchEngine, tokenizer: Any,
                                                                           nursery: trio.Nursery) -> None:
    gated = GatedTokenizer(tokenizer, gate=10**9)
    gen = await start_generator(engine, gated, nursery)
    limit = CTX * max_token_chars(tokenizer)
    async with api_client(gen) as client:
        for endpoint, body in (("completions", {"prompt": "a" * (limit + 1)}),
                               ("chat/completions", {"messages": [{"role": "system", "content": "a" * limit},
                                                                  {"role": "user", "content": "b"}]})):
            r = await client.post(f"/v1/{endpoint}", json={"model": MODEL, **body})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "context_length_exceeded"
            assert f"has {limit + 1} characters" in error["message"] and f"at most {limit}" in error["message"]
        assert gated.calls == []
        # One character fewer is tokenized, and then refused for its length in tokens.
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "a" * limit})
        assert r.status_code == 400 and "resulted in" in r.json()["error"]["message"]
        assert gated.calls == [limit]
        # A body over the byte limit never gets that far.
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "a" * (MAX_BODY_BYTES + 1)})
        assert r.status_code == 413 and gated.calls == [limit]


async def test_short_prompt_is_served_while_a_long_one_is_tokenized(engine: TorchEngine, tokenizer: Any,
                                                                    nursery: trio.Nursery) -> None:
    gated = GatedTokenizer(tokenizer, gate=100)
    gen = await start_generator(engine, gated, nursery)
    long_status: list[int] = []
    async with api_client(gen, short_prompt_chars=100) as client:

        async def long_request() -> None:
            r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "word " * 40, "max_tokens": 2})
            long_status.append(r.status_code)

        try:
            async with trio.open_nursery() as n:
                n.start_soon(long_request)
                assert await trio.to_thread.run_sync(gated.entered.wait, 10)  # its tokenizing is under way
                with trio.fail_after(10):  # the gate holds for 30 s: a short request stuck behind it fails here
                    body = await post(client, "/v1/completions", prompt=PROMPT, max_tokens=2)
                    assert body["usage"]["completion_tokens"] == 2
                    await post(client, "/v1/chat/completions", messages=USER, max_tokens=2)
                assert long_status == []  # still held at the gate
                gated.release.set()
        finally:
            gated.release.set()
    assert long_status == [200]


class Routed:
    """A real generator whose generations say which route they run on, as the network's does."""

    def __init__(self, inner: LocalGenerator) -> None:
        self.inner = inner
        self.model_name, self.model_config, self.tokenizer = MODEL, inner.model_config, inner.tokenizer

    @asynccontextmanager
    async def generate(self, prompt_ids: list[int], params: GenerationParams,
                       ) -> AsyncIterator[AsyncIterator[TokenEvent]]:
        async with self.inner.generate(prompt_ids, params) as events:
            yield RoutedEvents(events.__aiter__(), "mixed: gpu-7 [0,30)")


async def test_the_route_header_names_the_nodes(gen: LocalGenerator) -> None:
    async with api_client(Routed(gen)) as client:
        for stream in (False, True):
            r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                                           "temperature": 0, "stream": stream})
            assert r.status_code == 200 and r.headers["x-hetnode-route"] == "mixed: gpu-7 [0,30)"
    async with api_client(gen) as client:  # a generator that does not say: no header
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200 and "x-hetnode-route" not in r.headers
    await kv_drained(gen.engine)
