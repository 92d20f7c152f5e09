from __future__ import annotations

import math
from importlib.resources import files
from pathlib import Path
from typing import Any

import pytest
import tomli_w

from hetnode.errors import ConfigError
from hetnode.planner.cluster import (
    UNLIMITED,
    ClusterSpec,
    LinkSpec,
    load_cluster,
    parse_cluster,
    uniform_cluster,
)
from hetnode.planner.devices import parse_device

CLUSTERS = files("hetnode.testnet") / "clusters"

BASE = """
name = "t"
[coordinator]
region = "us"
[[nodes]]
name = "n0"
device = "a100"
region = "us"
[[nodes]]
name = "n1"
device = "2xl4"
region = "us"
[[nodes]]
name = "n2"
device = "t4"
region = "eu"
[[nodes]]
name = "n3"
device = "t4"
region = "asia"
"""


def load_text(tmp_path: Path, text: str) -> ClusterSpec:
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return load_cluster(path)


def config_error(tmp_path: Path, text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_text(tmp_path, text)
    assert info.value.file == str(tmp_path / "cluster.toml")
    return info.value


# -- shipped files --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["demo.toml", "local3.toml"])
def test_shipped_cluster_files_parse(name: str) -> None:
    spec = load_cluster(Path(str(CLUSTERS / name)))
    assert spec.name == name.removesuffix(".toml")
    assert spec.nodes


def test_demo_cluster_is_what_its_description_says() -> None:
    spec = load_cluster(Path(str(CLUSTERS / "demo.toml")))
    assert {(n.name, n.device, n.region) for n in spec.nodes} == {
        ("a100-0", "a100", "us"), ("l4-0", "l4", "us"), ("l4-1", "l4", "eu"), ("t4-0", "t4", "eu")}
    assert spec.coordinator_region == "us"
    assert spec.link("a100-0", "l4-0") == LinkSpec(200, 10)
    assert spec.link("l4-1", "t4-0") == LinkSpec(200, 10)
    assert spec.link("a100-0", "t4-0") == LinkSpec(50, 25)
    assert spec.link("coordinator", "l4-1") == LinkSpec(50, 25)
    assert spec.link("coordinator", "a100-0") == LinkSpec(200, 10)
    # Loopback py-libp2p manages about 1.6 Gbit/s; emulation can only slow a link down.
    names = [n.name for n in spec.nodes] + ["coordinator"]
    assert max(spec.link(a, b).bandwidth_mbps for a in names for b in names if a != b) <= 200


def test_local3_is_three_unshaped_cpu_nodes() -> None:
    spec = load_cluster(Path(str(CLUSTERS / "local3.toml")))
    assert len(spec.nodes) == 3
    assert all(n.device_spec.needs_measurement for n in spec.nodes)
    assert spec.link("node-0", "node-2").unlimited


# -- link precedence ------------------------------------------------------------------------------------------

LINKS = BASE + """
[links.default]
bandwidth_mbps = 10
latency_ms = 100
[links.intra_region]
bandwidth_mbps = 1000
latency_ms = 1
[[links.regions]]
a = "eu"
b = "us"
bandwidth_mbps = 100
latency_ms = 40
loss = 0.01
[[links.regions]]
a = "asia"
b = "asia"
bandwidth_mbps = 500
latency_ms = 2
[[links.pairs]]
a = "n0"
b = "n2"
bandwidth_mbps = 200
latency_ms = 30
[[links.pairs]]
a = "coordinator"
b = "n3"
bandwidth_mbps = 50
latency_ms = 60
"""


def test_link_precedence(tmp_path: Path) -> None:
    spec = load_text(tmp_path, LINKS)
    assert spec.link("n0", "n2") == LinkSpec(200, 30)  # pair beats region pair
    assert spec.link("n1", "n2") == LinkSpec(100, 40, 0.01)  # region pair
    assert spec.link("n0", "n1") == LinkSpec(1000, 1)  # intra_region
    assert spec.link("n2", "n3") == LinkSpec(10, 100)  # default
    assert spec.link("coordinator", "n3") == LinkSpec(50, 60)  # pair naming the coordinator
    assert spec.link("coordinator", "n2") == LinkSpec(100, 40, 0.01)  # the coordinator's region is us
    assert spec.link("coordinator", "n1") == LinkSpec(1000, 1)
    assert spec.link("n1", "n1") is UNLIMITED


def test_a_region_pair_with_itself_beats_intra_region(tmp_path: Path) -> None:
    text = LINKS + """
[[nodes]]
name = "n4"
device = "t4"
region = "asia"
"""
    spec = load_text(tmp_path, text)
    assert spec.link("n3", "n4") == LinkSpec(500, 2)


def test_links_are_symmetric(tmp_path: Path) -> None:
    spec = load_text(tmp_path, LINKS)
    names = [n.name for n in spec.nodes] + ["coordinator"]
    for a in names:
        for b in names:
            assert spec.link(a, b) == spec.link(b, a)


def test_without_link_rules_every_link_is_unlimited(tmp_path: Path) -> None:
    spec = load_text(tmp_path, BASE)
    assert spec.link("n0", "n3") is UNLIMITED
    assert UNLIMITED.unlimited


def test_link_of_an_unknown_endpoint_is_a_key_error(tmp_path: Path) -> None:
    spec = load_text(tmp_path, BASE)
    with pytest.raises(KeyError):
        spec.link("n0", "nobody")


def test_coordinator_region_defaults_to_the_first_node() -> None:
    spec = parse_cluster({"name": "x", "nodes": [{"name": "a", "device": "t4", "region": "eu"}]}, "x")
    assert spec.coordinator_region == "eu"
    assert spec.regions == ("eu",)


# -- nodes ----------------------------------------------------------------------------------------------------


def test_nodes_parse_devices_and_memory_overrides(tmp_path: Path) -> None:
    text = BASE.replace('device = "a100"', 'device = "A100"\nmemory_gb = 30')
    spec = load_text(tmp_path, text)
    assert spec.node("n0").memory_gb == 30
    assert spec.node("n0").device == "a100"
    assert spec.node("n0").device_spec == parse_device("a100")
    assert spec.node("n1").memory_gb == 48
    assert spec.node("n1").device_spec.count == 2
    assert spec.regions == ("asia", "eu", "us")


def test_uniform_cluster() -> None:
    spec = uniform_cluster(3)
    assert [n.name for n in spec.nodes] == ["node-0", "node-1", "node-2"]
    assert {n.device for n in spec.nodes} == {"cpu"}
    assert spec.link("node-0", "node-1") is UNLIMITED
    shaped = uniform_cluster(2, "2xl4", region="eu", link=LinkSpec(100, 5))
    assert shaped.node("node-1").device == "2xl4"
    assert shaped.link("node-0", "coordinator") == LinkSpec(100, 5)
    with pytest.raises(ConfigError, match="at least one node"):
        uniform_cluster(0)
    with pytest.raises(ConfigError, match="unknown device"):
        uniform_cluster(2, "b200")


def test_to_dict_round_trips_through_toml(tmp_path: Path) -> None:
    spec = load_text(tmp_path, LINKS.replace('name = "t"', 'name = "t"\ndescription = "d"'))
    path = tmp_path / "again.toml"
    path.write_text(tomli_w.dumps(spec.to_dict()))
    assert load_cluster(path) == spec
    assert parse_cluster(uniform_cluster(2).to_dict(), "u") == uniform_cluster(2)


def test_a_multi_gpu_node_may_name_the_link_among_its_gpus() -> None:
    data = {"name": "t", "nodes": [{"name": "a", "device": "2xa100-80g", "region": "us",
                                    "gpu_link": {"bandwidth_mbps": 2_400_000, "latency_ms": 0.005}},
                                   {"name": "b", "device": "4xa6000", "region": "us"}]}
    spec = parse_cluster(data, "t")
    assert spec.node("a").gpu_link == LinkSpec(2_400_000, 0.005) and spec.node("b").gpu_link is None
    assert parse_cluster(spec.to_dict(), "t") == spec
    data["nodes"][1]["gpu_link"] = {"none": True}
    with pytest.raises(ConfigError, match="always have a link"):
        parse_cluster(data, "t")


def test_link_spec_validates_its_own_values() -> None:
    for bad in [dict(bandwidth_mbps=0, latency_ms=1), dict(bandwidth_mbps=1, latency_ms=-1),
                dict(bandwidth_mbps=1, latency_ms=math.inf), dict(bandwidth_mbps=1, latency_ms=1, loss=1)]:
        with pytest.raises(ValueError):
            LinkSpec(**bad)  # type: ignore[arg-type]


# -- errors: every one names the file, the key and the problem ------------------------------------------------


def test_invalid_toml_reports_the_line(tmp_path: Path) -> None:
    text = BASE + "\n[[nodes]\n"
    err = config_error(tmp_path, text)
    assert "invalid TOML" in err.problem
    assert f"line {text.count(chr(10))}" in err.problem
    assert str(tmp_path / "cluster.toml") in str(err)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read") as info:
        load_cluster(tmp_path / "nope.toml")
    assert info.value.file == str(tmp_path / "nope.toml")


def _node(**fields: Any) -> dict[str, Any]:
    return {"name": "a", "device": "t4", "region": "us", **fields}


def _link(**fields: Any) -> dict[str, Any]:
    return {"bandwidth_mbps": 100, "latency_ms": 5, **fields}


def _cluster(**fields: Any) -> dict[str, Any]:
    nodes = [_node(), _node(name="b", region="eu")]
    return {"name": "c", "nodes": nodes, **fields}


ERROR_CASES: list[tuple[str, dict[str, Any], str, str]] = [
    # (case, data, key, fragment of the problem)
    ("unknown top-level key", _cluster(nodez=[]), "nodez", "unknown key"),
    ("missing name", {"nodes": [_node()]}, "name", "missing required key"),
    ("missing nodes", {"name": "c"}, "nodes", "missing required key"),
    ("name not a string", _cluster(name=3), "name", "must be a string, not an integer"),
    ("nodes not an array", {"name": "c", "nodes": "a"}, "nodes", "array of tables"),
    ("nodes empty", {"name": "c", "nodes": []}, "nodes", "at least one node"),
    ("unknown node key", {"name": "c", "nodes": [_node(gpu="t4")]}, "nodes[0].gpu", "unknown key"),
    ("missing node device", {"name": "c", "nodes": [{"name": "a", "region": "us"}]}, "nodes[0].device",
     "missing required key"),
    ("missing node region", {"name": "c", "nodes": [{"name": "a", "device": "t4"}]}, "nodes[0].region",
     "missing required key"),
    ("device not a string", {"name": "c", "nodes": [_node(device=4)]}, "nodes[0].device", "must be a string"),
    ("unknown device", {"name": "c", "nodes": [_node(), _node(name="b"), _node(name="x", device="b200")]},
     "nodes[2].device", "unknown device 'b200'; known: 3090ti, a10, a100"),
    ("bad node name", {"name": "c", "nodes": [_node(name="Node 1")]}, "nodes[0].name", "lowercase"),
    ("reserved node name", {"name": "c", "nodes": [_node(name="coordinator")]}, "nodes[0].name", "reserved"),
    ("duplicate node name", {"name": "c", "nodes": [_node(), _node(name="b"), _node()]}, "nodes[2].name",
     "duplicate node name 'a' (also nodes[0])"),
    ("bad region", {"name": "c", "nodes": [_node(region="US East")]}, "nodes[0].region", "lowercase"),
    ("memory not a number", {"name": "c", "nodes": [_node(memory_gb="40")]}, "nodes[0].memory_gb",
     "must be a number, not a string"),
    ("memory zero", {"name": "c", "nodes": [_node(memory_gb=0)]}, "nodes[0].memory_gb", "must be > 0"),
    ("coordinator not a table", _cluster(coordinator="us"), "coordinator", "must be a table"),
    ("coordinator missing region", _cluster(coordinator={}), "coordinator.region", "missing required key"),
    ("coordinator unknown key", _cluster(coordinator={"region": "us", "port": 1}), "coordinator.port",
     "unknown key"),
    ("unknown links key", _cluster(links={"defaults": _link()}), "links.defaults", "unknown key"),
    ("links not a table", _cluster(links=[]), "links", "must be a table, not an array"),
    ("unknown link key", _cluster(links={"default": _link(jitter_ms=1)}), "links.default.jitter_ms",
     "unknown key"),
    ("missing latency", _cluster(links={"default": {"bandwidth_mbps": 1}}), "links.default.latency_ms",
     "missing required key"),
    ("missing bandwidth", _cluster(links={"intra_region": {"latency_ms": 1}}),
     "links.intra_region.bandwidth_mbps", "missing required key"),
    ("zero bandwidth", _cluster(links={"default": _link(bandwidth_mbps=0)}), "links.default.bandwidth_mbps",
     "must be > 0"),
    ("negative bandwidth", _cluster(links={"regions": [_link(a="us", b="eu", bandwidth_mbps=-5)]}),
     "links.regions[0].bandwidth_mbps", "must be > 0"),
    ("infinite bandwidth", _cluster(links={"default": _link(bandwidth_mbps=math.inf)}),
     "links.default.bandwidth_mbps", "must be finite"),
    ("nan latency", _cluster(links={"default": _link(latency_ms=math.nan)}), "links.default.latency_ms",
     "must be finite"),
    ("bandwidth as a string", _cluster(links={"default": _link(bandwidth_mbps="100")}),
     "links.default.bandwidth_mbps", "must be a number, not a string"),
    ("bandwidth as a boolean", _cluster(links={"default": _link(bandwidth_mbps=True)}),
     "links.default.bandwidth_mbps", "must be a number, not a boolean"),
    ("negative latency", _cluster(links={"default": _link(latency_ms=-1)}), "links.default.latency_ms",
     "must be >= 0"),
    ("loss of one", _cluster(links={"default": _link(loss=1.0)}), "links.default.loss", "must be in [0, 1)"),
    ("negative loss", _cluster(links={"pairs": [_link(a="a", b="b", loss=-0.1)]}), "links.pairs[0].loss",
     "must be in [0, 1)"),
    ("regions not an array", _cluster(links={"regions": _link(a="us", b="eu")}), "links.regions",
     "array of tables"),
    ("region pair missing an end", _cluster(links={"regions": [_link(a="us")]}), "links.regions[0].b",
     "missing required key"),
    ("unknown region", _cluster(links={"regions": [_link(a="us", b="eu"), _link(a="us", b="mars")]}),
     "links.regions[1].b", "unknown region 'mars'; known: eu, us"),
    ("duplicate region pair", _cluster(links={"regions": [_link(a="us", b="eu"), _link(a="eu", b="us")]}),
     "links.regions[1]", "duplicate link eu-us (also links.regions[0])"),
    ("unknown node in a pair", _cluster(links={"pairs": [_link(a="a", b="zz")]}), "links.pairs[0].b",
     "unknown node 'zz'"),
    ("pair with itself", _cluster(links={"pairs": [_link(a="a", b="a")]}), "links.pairs[0]",
     "two different endpoints"),
    ("pair end not a string", _cluster(links={"pairs": [_link(a="a", b=1)]}), "links.pairs[0].b",
     "must be a string"),
]


@pytest.mark.parametrize("data, key, fragment", [case[1:] for case in ERROR_CASES],
                         ids=[case[0] for case in ERROR_CASES])
def test_errors_name_the_file_key_and_problem(data: dict[str, Any], key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_cluster(data, "bad.toml")
    err = info.value
    assert (err.file, err.key) == ("bad.toml", key)
    assert fragment in err.problem
    assert str(err) == f"bad.toml: {key}: {err.problem}"


def test_errors_from_a_file_carry_its_path(tmp_path: Path) -> None:
    err = config_error(tmp_path, BASE + '[[links.pairs]]\na = "n0"\nb = "n9"\nbandwidth_mbps = 1\n'
                                        "latency_ms = 1\n")
    assert err.key == "links.pairs[0].b"
    assert "unknown node 'n9'" in err.problem
