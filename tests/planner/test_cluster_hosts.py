"""Cluster files at GPU granularity: `host`, `[links.intra_host]`, and the shipped ThunderServe files."""

from __future__ import annotations

import tomllib
from importlib.resources import files

import pytest

from hetnode.errors import ConfigError
from hetnode.planner.cluster import PCIE_LINK, LinkSpec, load_cluster, parse_cluster

CLUSTERS = files("hetnode.testnet") / "clusters"

TWO_HOSTS = """
name = "t"
[[nodes]]
name = "a0"
device = "a40"
region = "us"
host = "box-a"
[[nodes]]
name = "a1"
device = "a40"
region = "us"
host = "box-a"
[[nodes]]
name = "b0"
device = "3090ti"
region = "us"
host = "box-b"
[[nodes]]
name = "solo"
device = "3090ti"
region = "us"
[links.intra_region]
bandwidth_mbps = 5000
latency_ms = 1
"""


def test_gpus_of_one_host_get_pcie_when_no_rule_says_otherwise() -> None:
    spec = parse_cluster(tomllib.loads(TWO_HOSTS), "t.toml")
    assert spec.link("a0", "a1") == PCIE_LINK
    assert spec.link("a0", "b0") == LinkSpec(5000, 1)
    assert spec.link("b0", "solo") == LinkSpec(5000, 1)  # no host: a machine of its own
    assert spec.node("solo").machine != spec.node("b0").machine


def test_intra_host_rule_beats_region_rules_and_loses_to_pairs() -> None:
    text = TWO_HOSTS + """
[links.intra_host]
bandwidth_mbps = 100000
latency_ms = 0.02
[[links.regions]]
a = "us"
b = "us"
bandwidth_mbps = 2000
latency_ms = 3
[[links.pairs]]
a = "a0"
b = "a1"
bandwidth_mbps = 7
latency_ms = 7
"""
    spec = parse_cluster(tomllib.loads(text), "t.toml")
    assert spec.link("a0", "a1") == LinkSpec(7, 7)
    assert spec.link("a1", "a0") == LinkSpec(7, 7)
    spec2 = parse_cluster(tomllib.loads(text.split("[[links.pairs]]")[0]), "t.toml")
    assert spec2.link("a0", "a1") == LinkSpec(100000, 0.02)
    assert spec2.link("a0", "b0") == LinkSpec(2000, 3)
    assert parse_cluster(spec.to_dict(), "again") == spec


def test_a_host_name_never_matches_a_node_without_one() -> None:
    text = TWO_HOSTS.replace('host = "box-b"', 'host = "solo"')
    spec = parse_cluster(tomllib.loads(text), "t.toml")
    assert spec.link("b0", "solo") == LinkSpec(5000, 1)


@pytest.mark.parametrize(("change", "key", "problem"), [
    (('host = "box-b"', 'host = "Box B"'), "nodes[2].host", "lowercase"),
    (('host = "box-b"', "host = 3"), "nodes[2].host", "must be a string"),
    (('name = "a1"\ndevice = "a40"\nregion = "us"', 'name = "a1"\ndevice = "a40"\nregion = "eu"'),
     "nodes[1].host", "host 'box-a' is in region 'us' (nodes[0])"),
])
def test_bad_hosts_name_the_file_key_and_problem(change: tuple[str, str], key: str, problem: str) -> None:
    text = TWO_HOSTS.replace(*change)
    assert text != TWO_HOSTS
    with pytest.raises(ConfigError) as err:
        parse_cluster(tomllib.loads(text), "t.toml")
    assert err.value.file == "t.toml"
    assert err.value.key == key
    assert problem in err.value.problem


def test_bad_intra_host_rule() -> None:
    with pytest.raises(ConfigError) as err:
        parse_cluster(tomllib.loads(TWO_HOSTS + "[links.intra_host]\nbandwidth_mbps = 0\nlatency_ms = 1\n"), "t.toml")
    assert err.value.key == "links.intra_host.bandwidth_mbps"


def test_thunderserve_cloud_gpus() -> None:
    spec = load_cluster(str(CLUSTERS / "thunderserve-cloud-gpus.toml"))
    assert len(spec.nodes) == 32
    hosts: dict[str, set[str]] = {}
    for n in spec.nodes:
        hosts.setdefault(n.host, set()).add(n.device)
    assert {h: len([n for n in spec.nodes if n.host == h]) for h in hosts} == {
        "4xa6000-0": 4, "4xa6000-1": 4, "4xa5000-0": 4, "4xa5000-1": 4, "8xa40-0": 8, "4x3090ti-0": 4,
        "4x3090ti-1": 4}
    assert all(len(kinds) == 1 for kinds in hosts.values())
    assert spec.link("8xa40-0-gpu0", "8xa40-0-gpu7") == LinkSpec(128_000, 0.01)
    assert spec.link("8xa40-0-gpu0", "4xa6000-0-gpu0") == LinkSpec(5_000, 1)


def test_thunderserve_a100() -> None:
    spec = load_cluster(str(CLUSTERS / "thunderserve-a100.toml"))
    assert [n.device for n in spec.nodes] == ["a100-80g"] * 8
    assert {n.host for n in spec.nodes} == {"8xa100"}
    assert spec.link("8xa100-gpu0", "8xa100-gpu5").bandwidth_mbps == 2_400_000
