"""Every cluster file shipped in hetnode/testnet/clusters parses, and the papers' files say what the papers say."""

from __future__ import annotations

from collections import Counter
from importlib.resources import files
from pathlib import Path

import pytest

from hetnode.planner.cluster import ClusterSpec, LinkSpec, load_cluster

CLUSTERS = Path(str(files("hetnode.testnet") / "clusters"))
SHIPPED = sorted(p.name for p in CLUSTERS.glob("*.toml"))


def load(name: str) -> ClusterSpec:
    return load_cluster(CLUSTERS / f"{name}.toml")


def devices(spec: ClusterSpec, region: str | None = None) -> Counter[str]:
    return Counter(n.device for n in spec.nodes if region is None or n.region == region)


def all_links(spec: ClusterSpec) -> set[LinkSpec]:
    names = [n.name for n in spec.nodes] + ["coordinator"]
    return {spec.link(a, b) for a in names for b in names if a != b}


def test_the_papers_files_are_shipped() -> None:
    assert {"helix-single.toml", "helix-geo.toml", "helix-hetero.toml", "thunderserve-cloud.toml"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_file_parses_and_says_where_it_comes_from(name: str) -> None:
    spec = load_cluster(CLUSTERS / name)
    assert spec.name == name.removesuffix(".toml")
    assert spec.nodes
    assert spec.description.strip()
    assert spec.coordinator_region in spec.regions


def test_helix_single() -> None:
    spec = load("helix-single")
    assert devices(spec) == {"a100": 4, "l4": 8, "t4": 12}
    assert len(spec.regions) == 1
    assert all_links(spec) == {LinkSpec(10_000, 1)}


def test_helix_geo() -> None:
    spec = load("helix-geo")
    assert spec.regions == ("region1", "region2", "region3")
    assert devices(spec, "region1") == {"a100": 4}
    assert devices(spec, "region2") == {"l4": 2, "t4": 8}
    assert devices(spec, "region3") == {"l4": 6, "t4": 4}
    assert spec.coordinator_region == "region1"
    by_region = {n.region: n.name for n in spec.nodes}
    for r in spec.regions:
        same = [n.name for n in spec.nodes if n.region == r]
        assert spec.link(same[0], same[1]) == LinkSpec(10_000, 1)
        for other in spec.regions:
            if other != r:
                assert spec.link(by_region[r], by_region[other]) == LinkSpec(100, 50)
    assert spec.link("coordinator", by_region["region1"]) == LinkSpec(10_000, 1)
    assert spec.link("coordinator", by_region["region3"]) == LinkSpec(100, 50)


def test_helix_hetero() -> None:
    spec = load("helix-hetero")
    assert len(spec.nodes) == 42
    assert devices(spec) == {"a100": 4, "v100": 6, "l4": 8, "t4": 10, "2xl4": 4, "2xt4": 6, "4xt4": 4}
    assert all_links(spec) == {LinkSpec(8_000, 1)}  # the Helix artifact's 1e9 B/s, 1 ms


def test_thunderserve_cloud() -> None:
    spec = load("thunderserve-cloud")
    assert devices(spec) == {"4xa6000": 2, "4xa5000": 2, "8xa40": 1, "4x3090ti": 2}
    assert sum(n.device_spec.count for n in spec.nodes) == 32
    assert all_links(spec) == {LinkSpec(5_000, 1)}
