"""schemathesis against a live coordinator: its own /openapi.json drives the requests.

A real coordinator serving a tiny random Llama through one node (memory transport), behind hypercorn on a
loopback port, with an API key: every operation of the document gets requests that fit the schema and requests
that do not (schemathesis' positive and negative modes), sent over HTTP. Nothing may answer 5xx, every answer
must be of a status and shape the document names (every 4xx OpenAI's error object), data the document forbids
must be refused, and no request may hang (each has a timeout). The run is bounded by `EXAMPLES` per operation
and mode.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import trio
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.openapi import from_dict
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from hetnode.coordinator.api import build_app, serve_api
from hetnode.coordinator.daemon import Coordinator, CoordinatorConfig
from hetnode.coordinator.dashboard import dashboard_routes
from hetnode.coordinator.deployment import PlanningConfig
from hetnode.coordinator.live_stats import LiveStats
from hetnode.coordinator.openai_api import openai_routes
from hetnode.models.resolve import load_config
from hetnode.models.tiny import write_tiny_model
from hetnode.models.tokenizer import load_tokenizer
from hetnode.node.daemon import NodeConfig, NodeDaemon
from hetnode.node.hops import HopServer
from hetnode.protocol.memory import MemoryNetwork
from hetnode.protocol.messages import HardwareProfile
from hetnode.protocol.probe import ProbeSettings

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = 15  # per operation and mode
CTX = 24  # the model's context: at most 23 generated tokens per request
REQUEST_TIMEOUT_S = 60  # far above any answer's time here; reaching it is a hang


def openai_error_shape(ctx: object, response: Any, case: object) -> None:
    """Every refusal is OpenAI's error object (also checked through the document's 4XX schema; said twice so
    that a document that lost its error schema cannot let this through)."""
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), error


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection, openai_error_shape]
PROFILE = HardwareProfile(device="cpu", device_type="cpu", memory_bytes=8 << 30, matmul_tflops=0.1,
                          mem_bandwidth_gbps=20, dtype="float32")


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A coordinator and one node in a trio loop on a thread (the test itself is synchronous, as requests is)."""
    # A short context bounds every generation (the default max_tokens is what the context leaves), so that a
    # loaded test machine answers every request well within the timeout.
    model = write_tiny_model(tmp_path_factory.mktemp("llama") / "m", "llama", max_position_embeddings=CTX,
                             num_layers=2)
    ready: list[str] = []
    started = threading.Event()
    failure: list[BaseException] = []
    stop: list[tuple[trio.lowlevel.TrioToken, trio.CancelScope]] = []

    async def main() -> None:
        net = MemoryNetwork()
        async with net.transport("coord") as ct, net.transport("n1") as nt, trio.open_nursery() as nursery:
            coord = Coordinator(CoordinatorConfig(token="t", probe_interval_s=3600,
                                                  probe=ProbeSettings(first_bytes=1024, max_bytes=1024)), ct)
            gen = coord.enable_serving(model=str(model), model_config=load_config(model),
                                       tokenizer=load_tokenizer(model),
                                       planning=PlanningConfig(method="pipeline", time_limit_s=2))
            await nursery.start(coord.run)
            hops = HopServer(nt, lambda peer: node.is_member(peer))
            node = NodeDaemon(NodeConfig(bootstrap=("/memory/coord/p2p/coord",), token="t", name="n1",
                                         profile=PROFILE, probe=ProbeSettings(first_bytes=1024, max_bytes=1024)),
                              nt, hops)
            await nursery.start(hops.run)
            await nursery.start(node.run)
            assert coord.deployment is not None and await coord.deployment.wait_ready(60) is not None
            live = LiveStats(trio.current_time)
            app = build_app(coord, api_key=KEY, max_wait_s=1.0,
                            extra_routes=[*openai_routes(gen, metrics=[live]), *dashboard_routes(coord, live)])
            ready.append(await nursery.start(serve_api, app, "127.0.0.1", 0))
            stop.append((trio.lowlevel.current_trio_token(), nursery.cancel_scope))
            started.set()

    def thread() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # reported to the test below
            failure.append(exc)
        finally:
            started.set()

    t = threading.Thread(target=thread, daemon=True)
    t.start()
    started.wait(120)
    if failure or not ready:
        raise RuntimeError(f"the live coordinator did not start: {failure}")
    try:
        yield ready[0]
    finally:
        trio_token, scope = stop[0]
        trio_token.run_sync_soon(scope.cancel)
        t.join(30)
        assert not t.is_alive() and not failure, failure


# schemathesis 4.32 draws from `random` inside its strategies, which hypothesis deprecates (a warning only).
@pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies")
@pytest.mark.slow
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_schemathesis_finds_no_5xx_no_hang_and_only_openai_errors(live: str, mode: GenerationMode) -> None:
    doc = requests.get(f"{live}/openapi.json", headers=AUTH, timeout=REQUEST_TIMEOUT_S).json()
    schema = from_dict(doc)
    schema.config.update(base_url=live)
    operations = [op.ok() for op in schema.get_all_operations()]
    assert len(operations) >= 9
    if mode == GenerationMode.NEGATIVE:  # only an operation that takes input can be sent wrong input
        operations = [op for op in operations
                      if {"parameters", "requestBody"} & set(doc["paths"][op.path][op.method.lower()])]
        assert len(operations) >= 5
    session = requests.Session()
    for operation in operations:

        # No shrinking: a failure is reported as found (shrinking over HTTP takes minutes).
        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def fuzz(case: object) -> None:
            response = case.call(session=session, headers=AUTH, timeout=REQUEST_TIMEOUT_S)  # type: ignore[attr-defined]
            case.validate_response(response, checks=CHECKS, headers=AUTH)  # type: ignore[attr-defined]

        fuzz()
