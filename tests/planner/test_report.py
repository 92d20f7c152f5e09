from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import pytest

from hetnode.errors import ConfigError
from hetnode.planner.cluster import ClusterSpec, LinkSpec, NodeSpec
from hetnode.planner.flowgraph import evaluate
from hetnode.planner.model import model_spec
from hetnode.planner.picture import Rect, Text, draw_plan, layout
from hetnode.planner.plan import SINK, SOURCE, NodePlacement, PlacementPlan
from hetnode.planner.profile_sources import helix_profile_table
from hetnode.planner.report import carrying_edges, format_plan

MODEL = model_spec("llama-30b")
PROFILES = helix_profile_table(MODEL)
CLUSTER = ClusterSpec(
    name="two-regions",
    nodes=(NodeSpec("a100-0", "a100", "us", 40), NodeSpec("a100-1", "a100", "us", 40),
           NodeSpec("a100-2", "a100", "us", 40), NodeSpec("a100-3", "a100", "us", 40),
           NodeSpec("l4-0", "l4", "eu", 24), NodeSpec("t4-0", "t4", "eu", 16), NodeSpec("t4-9", "t4", "eu", 16)),
    coordinator_region="us", intra_region_link=LinkSpec(10_000, 1), default_link=LinkSpec(100, 50))
RANGES = {"a100-0": (0, 18), "a100-1": (15, 33), "a100-2": (30, 48), "a100-3": (42, 60), "l4-0": (0, 11),
          "t4-0": (11, 18)}


def make_plan() -> PlacementPlan:
    result = evaluate(CLUSTER, MODEL, PROFILES, RANGES)
    flows = {**result.flows, ("a100-0", "a100-1"): result.flows[("a100-0", "a100-1")] + 1e-12}
    return PlacementPlan(cluster=CLUSTER.name, model=MODEL.name, num_layers=60, method="helix",
                         placements=tuple(NodePlacement(n, *r) for n, r in RANGES.items()), flows=flows,
                         max_flow=result.value, upper_bound=5000.0, status="optimal", solve_time_s=3.5,
                         notes=("started from the petals placement",))


PLAN = make_plan()


def test_format_plan_tables() -> None:
    # A little flow through the eu nodes too, so the report has region-crossing edges to show (which of the
    # equally maximal flows the max-flow algorithm returns is not this test's business).
    plan = replace(PLAN, flows={**PLAN.flows, (SOURCE, "l4-0"): 10.0, ("l4-0", "t4-0"): 10.0,
                                ("t4-0", "a100-1"): 10.0})
    text = format_plan(plan, CLUSTER, profiles=PROFILES, model=MODEL)
    lines = text.splitlines()
    assert lines[0] == "Plan for llama-30b on two-regions: method helix, partial inference on, 60 layers"
    header = next(line for line in lines if line.startswith("node "))
    assert header.split() == ["node", "device", "region", "layers", "j", "T_j", "tok/s", "flow", "tok/s", "util"]
    row = next(line for line in lines if line.startswith("a100-1 "))
    t_18 = PROFILES.profiles["a100"].tokens_per_s(18)
    assert row.split()[:6] == ["a100-1", "a100", "us", "[15,", "33)", "18"]
    assert f"{t_18:,.1f}" in row
    assert row.endswith("%")
    # Rows go by first layer, then last.
    order = [line.split()[0] for line in lines[3:9]]
    assert order == ["l4-0", "a100-0", "t4-0", "a100-1", "a100-2", "a100-3"]
    assert "holding no layers (1): t4-9" in text
    assert f"edges carrying flow ({len(carrying_edges(plan))}):" in text
    assert re.search(r"^source\s+a100-0\s", text, re.M)
    assert re.search(r"^a100-3\s+sink\s", text, re.M)
    assert re.search(r"^t4-0\s+a100-1\s.*eu -> us$", text, re.M)  # crosses regions
    assert re.search(r"^source\s+l4-0\s.*us -> eu$", text, re.M)
    assert f"max flow     {PLAN.max_flow:,.1f} tokens/s" in text
    assert "upper bound  5,000.0 tokens/s" in text
    assert f"gap          {PLAN.gap:.2%}" in text
    assert "status       optimal" in text
    assert "solve time   3.50 s" in text
    assert "note: started from the petals placement" in text


def test_format_plan_without_profiles_or_model() -> None:
    text = format_plan(replace(PLAN, upper_bound=float("inf"), notes=()), CLUSTER)
    row = next(line for line in text.splitlines() if line.startswith("a100-1 "))
    assert row.split()[-3] == "-" and row.split()[-1] == "-"
    assert "upper bound  none" in text
    assert "note:" not in text


def test_noise_flows_are_left_out() -> None:
    tiny = replace(PLAN, flows={**PLAN.flows, ("l4-0", "a100-1"): 1e-9})
    assert (("l4-0", "a100-1"), 1e-9) not in carrying_edges(tiny)
    assert not re.search(r"^l4-0\s+a100-1\s", format_plan(tiny, CLUSTER), re.M)


def test_layout_follows_first_layer_and_region() -> None:
    scene = layout(PLAN, CLUSTER, profiles=PROFILES)
    boxes: dict[str, Rect] = {}
    shapes = scene.shapes
    for i, shape in enumerate(shapes):
        if isinstance(shape, Text) and shape.text in RANGES and shape.bold:
            boxes[shape.text] = next(s for s in reversed(shapes[:i]) if isinstance(s, Rect) and s.w > 100 and s.h > 10)
    assert set(boxes) == set(RANGES)
    for a, ra in RANGES.items():
        for b, rb in RANGES.items():
            if ra[0] < rb[0]:
                assert boxes[a].x < boxes[b].x
            if ra[0] == rb[0]:
                assert boxes[a].x == boxes[b].x
    us = [boxes[n].y for n in RANGES if CLUSTER.node(n).region == "us"]
    eu = [boxes[n].y for n in RANGES if CLUSTER.node(n).region == "eu"]
    assert max(us) < min(eu)  # the coordinator's region is the top band
    labels = [s.text for s in shapes if isinstance(s, Text)]
    assert SOURCE.upper() in labels and SINK.upper() in labels
    assert "region us (coordinator)" in labels


def test_svg(tmp_path: Path) -> None:
    out = draw_plan(PLAN, CLUSTER, tmp_path / "plan.svg", profiles=PROFILES)
    root = ET.parse(out).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    assert root.tag == f"{ns}svg"
    texts = [t.text for t in root.iter(f"{ns}text")]
    for node in RANGES:
        assert node in texts
    assert "t4-9" not in texts  # holds nothing: only named in the footer
    assert any(t and t.startswith("holding no layers: t4-9") for t in texts)
    assert "SOURCE" in texts and "SINK" in texts
    edges = carrying_edges(PLAN)
    paths = list(root.iter(f"{ns}path"))
    assert len(paths) == len(edges) + 3  # plus the legend's three samples
    widths = [float(p.get("stroke-width", "0")) for p in paths[: len(edges)]]
    flows = [f for _, f in edges]
    assert widths.index(max(widths)) == flows.index(max(flows))
    assert min(widths) >= 1.0
    heaviest = max(flows)
    assert f"{heaviest / 1000:.1f}k" in texts  # labels carry the flow values


def test_png(tmp_path: Path) -> None:
    from PIL import Image

    out = draw_plan(PLAN, CLUSTER, tmp_path / "plan.PNG", profiles=PROFILES)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    scene = layout(PLAN, CLUSTER, profiles=PROFILES)
    with Image.open(out) as im:
        assert im.size == (round(scene.width), round(scene.height))
        assert len(im.convert("RGB").getcolors(maxcolors=1 << 20) or []) > 20  # something was drawn


def test_bad_suffix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"svg or \.png") as info:
        draw_plan(PLAN, CLUSTER, tmp_path / "plan.pdf")
    assert info.value.file == str(tmp_path / "plan.pdf")


def test_an_empty_plan_still_draws(tmp_path: Path) -> None:
    empty = replace(PLAN, placements=(), flows={}, max_flow=0.0)
    draw_plan(empty, CLUSTER, tmp_path / "empty.svg")
    assert "holding no layers (7)" in format_plan(empty, CLUSTER)
