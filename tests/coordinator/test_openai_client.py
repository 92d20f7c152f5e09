"""The official `openai` client, unchanged, against the API served by hypercorn on loopback over a real engine.

The client is synchronous and runs in worker threads; the server, the batch loop and the test run under trio.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import openai
import pytest
import trio
import trio.testing

from hetnode.coordinator.api import build_app, serve_api
from hetnode.coordinator.daemon import Coordinator, CoordinatorConfig
from hetnode.coordinator.generation import GenerationParams, TokenEvent
from hetnode.coordinator.local import LocalGenerator
from hetnode.coordinator.openai_api import openai_routes
from hetnode.models.tiny import write_tiny_model
from hetnode.models.tokenizer import load_tokenizer
from hetnode.node.engine import EngineConfig, TorchEngine
from hetnode.protocol.memory import MemoryNetwork

MODEL = "tiny-llama"
KEY = "sk-test-k3y"
T = TypeVar("T")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[TorchEngine]:
    # KV for 64 tokens: enough for the requests below, and a way to make one fail mid-stream for real.
    e = TorchEngine.load(model_dir, engine_config=EngineConfig(block_size=4, num_kv_blocks=16))
    yield e
    e.close()


class Server:
    def __init__(self, url: str, gen: LocalGenerator) -> None:
        self.url, self.gen = url, gen
        self.clients: list[openai.OpenAI] = []

    def client(self, api_key: str = KEY) -> openai.OpenAI:
        # No retries: a refused request must surface at once, as the error we sent.
        c = openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=30)
        self.clients.append(c)
        return c


@pytest.fixture
async def server(model_dir: Path, engine: TorchEngine, nursery: trio.Nursery) -> AsyncIterator[Server]:
    gen = LocalGenerator(MODEL, engine, load_tokenizer(model_dir))
    await nursery.start(gen.loop.run)
    async with MemoryNetwork().transport("coord") as transport:
        app = build_app(Coordinator(CoordinatorConfig(token="t"), transport), api_key=KEY,
                        extra_routes=openai_routes(gen))
        srv = Server(await nursery.start(serve_api, app, "127.0.0.1", 0), gen)
        yield srv
        for c in srv.clients:  # idle keep-alive connections would hold up the server's graceful shutdown
            c.close()


async def call(fn: Callable[[], T]) -> T:
    return await trio.to_thread.run_sync(fn)


async def kv_drained(engine: TorchEngine) -> None:
    with trio.fail_after(10):
        while engine.kv_usage().sessions:
            await trio.testing.wait_all_tasks_blocked(cushion=0.01)  # a bare spin starves the worker thread of the GIL


async def test_models_completions_and_chat(server: Server) -> None:
    client = server.client()
    models = await call(lambda: client.models.list())
    assert [m.id for m in models.data] == [MODEL]
    assert (await call(lambda: client.models.retrieve(MODEL))).id == MODEL

    done = await call(lambda: client.completions.create(model=MODEL, prompt="Hello, world!", max_tokens=8,
                                                        temperature=0))
    assert done.object == "text_completion" and done.choices[0].finish_reason in ("stop", "length")
    assert done.usage is not None and done.usage.completion_tokens <= 8

    def stream_completion() -> str:
        chunks = client.completions.create(model=MODEL, prompt="Hello, world!", max_tokens=8, temperature=0,
                                           stream=True)
        return "".join(c.choices[0].text for c in chunks)

    assert await call(stream_completion) == done.choices[0].text

    messages: list[Any] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    chat = await call(lambda: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                             temperature=0, seed=1, logprobs=True, top_logprobs=2))
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content
    assert chat.usage is not None
    assert chat.usage.completion_tokens == 8 or chat.choices[0].finish_reason == "stop"

    def stream_chat() -> tuple[str, list[Any], Any]:
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, chunks, chunks[-1].usage

    text, chunks, usage = await call(stream_chat)
    assert text == chat.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens


async def test_errors_surface_as_openai_exceptions(server: Server) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError) as bad:
        await call(lambda: client.completions.create(model=MODEL, prompt="x", temperature=5))
    assert bad.value.param == "temperature" and "temperature" in bad.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        await call(lambda: client.chat.completions.create(model="gpt-4o", messages=[{"role": "user",
                                                                                      "content": "x"}]))
    assert missing.value.code == "model_not_found"
    wrong = server.client(api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        await call(lambda: wrong.models.list())

    def run_out_of_kv() -> list[str]:
        texts = []
        for chunk in client.completions.create(model=MODEL, prompt=list(range(3, 43)), max_tokens=40,
                                               temperature=0, stream=True):
            texts.append(chunk.choices[0].text)
        return texts

    with pytest.raises(openai.APIError, match="KV"):  # mid-stream: the error event, raised while iterating
        await call(run_out_of_kv)
    with pytest.raises(openai.InternalServerError, match="KV"):  # before the first token: HTTP 503
        await call(lambda: client.completions.create(model=MODEL, prompt=list(range(3, 73)), max_tokens=2))
    await kv_drained(server.gen.engine)


class Stalling:
    """A real generator that stalls after its first tokens, so that only the client leaving can end a request."""

    def __init__(self, inner: LocalGenerator, tokens: int) -> None:
        self.inner, self.tokens = inner, tokens
        self.model_name, self.model_config, self.tokenizer = inner.model_name, inner.model_config, inner.tokenizer
        self.left = trio.Event()

    @asynccontextmanager
    async def generate(self, prompt_ids: list[int], params: GenerationParams,
                       ) -> AsyncIterator[AsyncIterator[TokenEvent]]:
        async def relay(events: AsyncIterator[TokenEvent]) -> AsyncIterator[TokenEvent]:
            n = 0
            async for event in events:
                yield event
                n += 1
                if n == self.tokens:
                    await trio.sleep_forever()

        try:
            async with self.inner.generate(prompt_ids, params) as events:
                yield relay(events)
        finally:
            self.left.set()


async def test_client_leaving_a_stream_cancels_it_and_frees_kv(model_dir: Path, engine: TorchEngine,
                                                               nursery: trio.Nursery) -> None:
    gen = LocalGenerator(MODEL, engine, load_tokenizer(model_dir))
    await nursery.start(gen.loop.run)
    stalling = Stalling(gen, tokens=3)
    async with MemoryNetwork().transport("coord") as transport:
        app = build_app(Coordinator(CoordinatorConfig(token="t"), transport), extra_routes=openai_routes(stalling))
        url = await nursery.start(serve_api, app, "127.0.0.1", 0)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)

        def read_two_chunks_and_leave() -> None:
            stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=20, temperature=0, stream=True)
            next(stream), next(stream)  # the role chunk and the first piece of text
            stream.close()

        try:
            await call(read_two_chunks_and_leave)
            with trio.fail_after(10):
                await stalling.left.wait()  # the server saw the client go, and cancelled the generation
            await kv_drained(engine)
        finally:
            client.close()
