"""GET /openapi.json: it describes every route the coordinator serves, and is a valid OpenAPI 3.1 document."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio
from schemathesis.openapi import from_dict
from starlette.routing import Route

from hetnode.coordinator.api import build_app
from hetnode.coordinator.daemon import Coordinator, CoordinatorConfig
from hetnode.coordinator.dashboard import dashboard_routes
from hetnode.coordinator.live_stats import LiveStats
from hetnode.coordinator.openai_api import openai_routes
from hetnode.coordinator.openapi import undocumented_routes
from hetnode.models.resolve import load_config
from hetnode.models.tiny import write_tiny_model
from hetnode.models.tokenizer import load_tokenizer
from hetnode.protocol.memory import MemoryNetwork


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama") / "m", "llama")


async def test_the_document_names_every_route_and_method(tiny_model: Path) -> None:
    async with MemoryNetwork().transport("coord") as ct:
        coord = Coordinator(CoordinatorConfig(token="t"), ct)
        gen = coord.enable_serving(model="tiny", model_config=load_config(tiny_model),
                                   tokenizer=load_tokenizer(tiny_model))
        live = LiveStats(trio.current_time)
        app = build_app(coord, api_key="k3y",
                        extra_routes=[*openai_routes(gen, metrics=[live]), *dashboard_routes(coord, live)])
        # Every route the app serves carries its description; a plain Route would be missing from the document.
        assert undocumented_routes(app.routes) == []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
            assert (await client.get("/openapi.json")).status_code == 401  # behind the key like the rest
            r = await client.get("/openapi.json", headers={"Authorization": "Bearer k3y"})
        assert r.status_code == 200
        doc = r.json()
        served = {(route.path_format, method.lower()) for route in app.routes if isinstance(route, Route)
                  for method in route.methods or () if method != "HEAD"}
        documented = {(path, method) for path, ops in doc["paths"].items() for method in ops}
        assert served == documented
        assert ("/v1/chat/completions", "post") in documented and ("/openapi.json", "get") in documented
        assert ("/v1/stats", "get") in documented and ("/dashboard", "get") in documented
        # The open routes are exactly those the middleware lets through without a key.
        assert doc["paths"]["/healthz"]["get"]["security"] == []
        assert doc["paths"]["/v1/cluster"]["get"]["security"] == [{"bearer": []}]
        assert doc["paths"]["/dashboard"]["get"]["security"] == []  # the page holds no data (dashboard.py)
        assert doc["paths"]["/v1/stats"]["get"]["security"] == [{"bearer": []}]
        # The bounds come from the validator's own constants and the model served.
        body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["properties"]["model"] == {"enum": ["tiny"]}
        ids = body["properties"]["prompt"]["anyOf"][1]
        assert ids["items"]["maximum"] == gen.model_config.vocab_size - 1
        # schemathesis (and so any OpenAPI tool) loads it and finds every operation.
        schema = from_dict(doc)
        assert len(list(schema.get_all_operations())) == len(served)


async def test_a_route_without_a_description_is_reported() -> None:
    async def hello(request: object) -> None:
        raise AssertionError("not called")

    async with MemoryNetwork().transport("coord") as ct:
        app = build_app(Coordinator(CoordinatorConfig(token="t"), ct),
                        extra_routes=[Route("/v1/hello", hello, methods=["GET"])])
        assert undocumented_routes(app.routes) == ["GET, HEAD /v1/hello"]
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
            doc = (await client.get("/openapi.json")).json()
        assert "/v1/hello" not in doc["paths"] and "/v1/cluster" in doc["paths"]
        assert "security" not in doc["paths"]["/v1/cluster"]["get"]  # no key configured: nothing to send

