"""Branch placements: regions side by side feeding one region's tail (branches.py), and the stage search's
`last_min` that builds a branch's last group."""

from __future__ import annotations

from importlib.resources import files

import pytest

from hetnode.planner import flowgraph
from hetnode.planner.branches import branch_placements
from hetnode.planner.cluster import load_cluster
from hetnode.planner.heuristics import NodeInfo, node_infos
from hetnode.planner.model import model_spec
from hetnode.planner.placement import complete
from hetnode.planner.profile_sources import helix_profile_table
from hetnode.planner.stages import stage_placement

MODEL = model_spec("llama-70b")
PROFILES = helix_profile_table(MODEL)
GEO = load_cluster(str(files("hetnode.testnet") / "clusters" / "helix-geo-pruned.toml"))
SINGLE = load_cluster(str(files("hetnode.testnet") / "clusters" / "helix-single.toml"))


def region_links(cluster_nodes: list[NodeInfo]) -> dict[tuple[str, str], float]:
    members: dict[str, list[str]] = {}
    for info in cluster_nodes:
        members.setdefault(info.region, []).append(info.name)
    out = {}
    for a in members:
        for b in members:
            caps = [flowgraph.link_capacity(GEO, MODEL, x, y) for x in members[a] for y in members[b] if x != y]
            out[(a, b)] = sum(caps) / len(caps)
    return out


def test_last_min_makes_the_last_group_that_large() -> None:
    nodes = [NodeInfo(f"n{i}", "x", "r", 4, (400.0, 200.0, 130.0, 100.0)) for i in range(6)]
    status, ranges = stage_placement(nodes, 4, 100.0, deadline=float("inf"))
    assert status == "feasible" and ranges is not None
    assert sum(1 for first, last in ranges.values() if last == 4) == 1  # one node holds all four layers
    status, ranges = stage_placement(nodes, 4, 100.0, deadline=float("inf"), last_min=3)
    assert status == "feasible" and ranges is not None
    assert sum(1 for first, last in ranges.values() if last == 4) >= 3
    assert stage_placement(nodes, 4, 100.0, deadline=float("inf"), last_min=7)[0] == "infeasible"


@pytest.mark.parametrize("partial", [True, False])
def test_branches_beat_the_regions_in_series_on_helix_geo_pruned(partial: bool) -> None:
    infos = node_infos(GEO, MODEL, PROFILES)
    links = region_links(infos)
    heard = []
    found = branch_placements(infos, MODEL.num_layers, link=lambda a, b: links[(a, b)], partial=partial,
                              time_limit=600, step_limit=1_000_000, on_found=heard.append)
    assert found and sorted(heard, key=lambda b: -b.estimate) == found
    best = found[0]
    ranges = complete(best.ranges, infos, MODEL.num_layers)
    flow = flowgraph.evaluate(GEO, MODEL, PROFILES, ranges, partial=partial)
    # The regions in series (the regional stage search) stop at 6104; the best known placement is 6838.
    assert flow.value >= best.estimate * (1 - 1e-6) and flow.value > 6700
    by_name = {i.name: i for i in infos}
    assert best.tail == "region1"
    for name, (first, last) in best.ranges.items():
        assert by_name[name].may_hold(first, last, MODEL.num_layers)
        if by_name[name].region == best.tail:
            assert first >= best.start
    # Deterministic: the same inputs, the same placements.
    again = branch_placements(infos, MODEL.num_layers, link=lambda a, b: links[(a, b)], partial=partial,
                              time_limit=600, step_limit=1_000_000)
    assert [(b.ranges, b.estimate) for b in again] == [(b.ranges, b.estimate) for b in found]


def test_one_region_has_no_branches() -> None:
    infos = node_infos(SINGLE, MODEL, PROFILES)
    assert branch_placements(infos, MODEL.num_layers, link=lambda a, b: 1.0, partial=True, time_limit=600,
                             step_limit=1000) == []
