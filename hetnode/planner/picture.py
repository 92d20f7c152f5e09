"""A picture of a placement plan in the manner of Helix's Fig. 4 and Fig. 10b: SVG, or PNG through matplotlib.

Nodes are boxes whose left edge sits at their first layer on a layer axis, in one band per region (the
coordinator's region first); within a band, boxes fill rows first-fit, so a chain of nodes reads as a line.
SOURCE sits at the left and SINK at the right, level with the coordinator's region. Every edge that carries
flow is a curve whose width is proportional to its flow and whose label is the flow in tokens per second;
edges between regions are red.
A node's box shows its name, device, layer range, and (with the profile table) how full it is.

The layout is computed once as a list of shapes; `_svg` writes them as hand-made SVG and `_png` draws them
with matplotlib's object API (no pyplot state).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from xml.sax.saxutils import escape

from hetnode.errors import ConfigError
from hetnode.planner.cluster import ClusterSpec
from hetnode.planner.plan import SINK, SOURCE, PlacementPlan
from hetnode.planner.profile import ProfileTable
from hetnode.planner.report import carrying_edges, node_flows

BOX_W, BOX_H = 132.0, 52.0
ROW_H = 74.0
ROW_GAP = 28.0  # the least space between two boxes in one row
MIN_AXIS, MAX_AXIS = 900.0, 2600.0  # pixels from the first layer to the last
BAND_PAD = 26.0
MARGIN = 24.0
TOP = 96.0  # room for the title and the column labels
PILL_W = 68.0  # SOURCE and SINK
MAX_EDGE_W = 12.0
LABEL_AT = 0.42  # where along an edge its flow label sits (0: start, 1: end); off-centre so crossings differ

PALETTE = ("#8ecae6", "#ffb703", "#90be6d", "#f4a261", "#cdb4db", "#e9c46a", "#a8dadc", "#f28482",
           "#b5e48c", "#bdb2ff")
INTRA, CROSS, ENDS = "#3d5a80", "#c0392b", "#555555"


@dataclass(frozen=True)
class Rect:
    x: float
    y: float
    w: float
    h: float
    fill: str
    stroke: str = "#333333"
    radius: float = 6.0
    opacity: float = 1.0
    stroke_w: float = 1.0


@dataclass(frozen=True)
class Curve:
    points: tuple[tuple[float, float], ...]  # a cubic Bézier: start, two control points, end
    width: float
    color: str
    opacity: float = 0.55


@dataclass(frozen=True)
class Poly:
    points: tuple[tuple[float, float], ...]
    fill: str
    opacity: float = 0.85


@dataclass(frozen=True)
class Text:
    x: float
    y: float
    text: str
    size: float = 11.0
    anchor: str = "middle"  # start, middle, end
    bold: bool = False
    color: str = "#111111"
    halo: bool = False  # a white outline so that it reads over edges


@dataclass
class Scene:
    width: float
    height: float
    shapes: list[Rect | Curve | Poly | Text] = field(default_factory=list)


def draw_plan(plan: PlacementPlan, cluster: ClusterSpec, path: str | Path, *,
              profiles: ProfileTable | None = None, title: str | None = None) -> Path:
    """Write the picture to `path`: SVG for .svg, PNG for .png (ConfigError for anything else)."""
    out = Path(path)
    suffix = out.suffix.lower()
    if suffix not in (".svg", ".png"):
        raise ConfigError(f"a picture is .svg or .png, not {out.suffix or 'no suffix'!r}", file=str(out))
    scene = layout(plan, cluster, profiles=profiles, title=title)
    if suffix == ".svg":
        out.write_text(_svg(scene))
    else:
        _png(scene, out)
    return out


def layout(plan: PlacementPlan, cluster: ClusterSpec, *, profiles: ProfileTable | None = None,
           title: str | None = None) -> Scene:
    """The shapes of the picture, in pixels, y downwards."""
    known = {n.name: n for n in cluster.nodes}
    placed = sorted((p for p in plan.placements if p.node in known),
                    key=lambda p: (p.first_layer, p.last_layer, p.node))
    regions = sorted({known[p.node].region for p in placed} | {cluster.coordinator_region},
                     key=lambda r: (r != cluster.coordinator_region, r))
    L = max(plan.num_layers, 1)
    # x is proportional to the first layer, at a scale where a typical node's successor clears its box.
    depths = sorted(p.layers for p in placed) or [L]
    per_layer = (BOX_W + 64) / max(depths[len(depths) // 2], 1)
    per_layer = min(max(per_layer, MIN_AXIS / L), MAX_AXIS / L)
    x_axis = MARGIN + PILL_W + 70  # where layer 0 is

    def x_of(layer: int) -> float:
        return x_axis + layer * per_layer

    # Rows: within a region, first fit of boxes left to right, so that chains of nodes read as lines.
    slot: dict[str, tuple[float, int]] = {}  # node -> (left x, row within its band)
    band_rows: dict[str, int] = {}
    for r in regions:
        ends: list[float] = []
        for p in (p for p in placed if known[p.node].region == r):
            left = x_of(p.first_layer)
            row = next((i for i, e in enumerate(ends) if e + ROW_GAP <= left), len(ends))
            if row == len(ends):
                ends.append(0.0)
            ends[row] = left + BOX_W
            slot[p.node] = (left, row)
        band_rows[r] = max(1, len(ends))
    band_top: dict[str, float] = {}
    y = TOP
    for r in regions:
        band_top[r] = y
        y += _band_height(band_rows[r])
    bands_bottom = y
    right = max([x_of(L)] + [left + BOX_W for left, _ in slot.values()])
    x_source = MARGIN + PILL_W / 2
    x_sink = right + 70 + PILL_W / 2
    width = x_sink + PILL_W / 2 + MARGIN

    def centre(node: str) -> tuple[float, float]:
        if node in (SOURCE, SINK):
            r = cluster.coordinator_region
            return (x_source if node == SOURCE else x_sink), band_top[r] + _band_height(band_rows[r]) / 2 - 3
        left, row = slot[node]
        return left + BOX_W / 2, band_top[known[node].region] + BAND_PAD + row * ROW_H + BOX_H / 2

    legend_y = bands_bottom + 20
    scene = Scene(width=width, height=legend_y + 64)
    s = scene.shapes

    # Title and column labels.
    heading = title or (f"{plan.model} on {plan.cluster} ({plan.method}): max flow {plan.max_flow:,.0f} tokens/s"
                        + (f", upper bound {plan.upper_bound:,.0f}, gap {plan.gap:.1%}"
                           if math.isfinite(plan.upper_bound) else ""))
    s.append(Text(MARGIN, 30, heading, size=16, anchor="start", bold=True))
    s.append(Text(MARGIN, 52, f"{len(placed)} of {len(cluster.nodes)} nodes hold layers of {plan.num_layers}; "
                              f"partial inference {'on' if plan.partial_inference else 'off'}; "
                              "edge width is proportional to flow (tokens/s)", size=12, anchor="start",
                  color="#444444"))
    # Region bands.
    for i, r in enumerate(regions):
        s.append(Rect(MARGIN, band_top[r], width - 2 * MARGIN, _band_height(band_rows[r]) - 6,
                      fill="#f3f5f8" if i % 2 == 0 else "#e9edf3", stroke="none", radius=10))
        label = f"region {r}" + (" (coordinator)" if r == cluster.coordinator_region else "")
        s.append(Text(MARGIN + 8, band_top[r] + 16, label, size=12, anchor="start", bold=True, color="#555555"))

    step = next(k for k in (1, 2, 5, 10, 20, 25, 50, 100, 10**9) if L / k <= 16)
    for layer in range(0, L + 1, step):
        s.append(Text(x_of(layer), TOP - 10, f"{layer}", size=11, color="#666666"))
        s.append(Rect(x_of(layer) - 0.5, TOP - 4, 1, bands_bottom - TOP, fill="#c8ced8", stroke="none", radius=0))
    s.append(Text(x_axis - 12, TOP - 10, "first layer", size=11, anchor="end", color="#666666"))


    # Edges under the nodes.
    flows = [(e, f) for e, f in carrying_edges(plan) if all(v in slot or v in (SOURCE, SINK) for v in e)]
    top_flow = max((f for _, f in flows), default=1.0)
    labels: list[Text] = []
    for (a, b), f in flows:
        (x1, y1), (x2, y2) = centre(a), centre(b)
        sx = x1 + (PILL_W / 2 if a == SOURCE else BOX_W / 2)
        ex = x2 - (PILL_W / 2 if b == SINK else BOX_W / 2)
        if ex - sx < 40 and abs(y2 - y1) > BOX_H:
            # The next node starts under this one: leave from the bottom (or top), arrive at the top (bottom).
            down = 1.0 if y2 > y1 else -1.0
            sy, ey = y1 + down * BOX_H / 2, y2 - down * BOX_H / 2
            bend = max(24.0, abs(ey - sy) / 2) * down
            pts = ((x1 + 20, sy), (x1 + 20, sy + bend), (x2 - 20, ey - bend), (x2 - 20, ey))
        else:
            reach = max(50.0, abs(ex - sx) / 2)
            pts = ((sx, y1), (sx + reach, y1), (ex - reach, y2), (ex, y2))
        region_a = cluster.coordinator_region if a in (SOURCE, SINK) else known[a].region
        region_b = cluster.coordinator_region if b in (SOURCE, SINK) else known[b].region
        color = CROSS if region_a != region_b else ENDS if SOURCE in (a, b) or SINK in (a, b) else INTRA
        w = 1.0 + (MAX_EDGE_W - 1.0) * f / top_flow
        s.append(Curve(pts, width=w, color=color))
        s.append(_arrowhead(pts, 6.0 + w / 2, color))
        lx, ly = _bezier(pts, LABEL_AT)
        labels.append(Text(lx, ly + 4, _short(f), size=10.5, color=color, halo=True, bold=True))

    # Nodes.
    devices = sorted({known[p.node].device for p in placed})
    colour = {d: PALETTE[i % len(PALETTE)] for i, d in enumerate(devices)}
    through = node_flows(plan)
    for p in placed:
        cx, cy = centre(p.node)
        x0, y0 = cx - BOX_W / 2, cy - BOX_H / 2
        node = known[p.node]
        s.append(Rect(x0, y0, BOX_W, BOX_H, fill=colour[node.device]))
        if profiles is not None:
            t_j = profiles.for_node(p.node, node.device).tokens_per_s(p.layers)
            share = min(1.0, through[p.node] / t_j) if t_j > 0 else 0.0
            s.append(Rect(x0 + 4, y0 + BOX_H - 8, (BOX_W - 8) * share, 4, fill="#1d3557", stroke="none", radius=2))
        s.append(Text(cx, y0 + 16, p.node, size=12, bold=True))
        s.append(Text(cx, y0 + 31, f"{node.device}  [{p.first_layer}, {p.last_layer})", size=11))
        util = ""
        if profiles is not None:
            t_j = profiles.for_node(p.node, node.device).tokens_per_s(p.layers)
            util = f" / {_short(t_j)}" if t_j > 0 else ""
        s.append(Text(cx, y0 + 43, f"{_short(through[p.node])}{util} tok/s", size=9.5, color="#333333"))
    for name, x in ((SOURCE, x_source), (SINK, x_sink)):
        _, cy = centre(name)
        s.append(Rect(x - PILL_W / 2, cy - 22, PILL_W, 44, fill="#222222", stroke="#222222", radius=14))
        s.append(Text(x, cy + 4, name.upper(), size=10, bold=True, color="#ffffff"))
    s.extend(labels)  # on top of everything

    # Legend.
    x = MARGIN
    for d in devices:
        s.append(Rect(x, legend_y, 16, 16, fill=colour[d], radius=3))
        s.append(Text(x + 22, legend_y + 12, d, size=11, anchor="start"))
        x += 36 + 7 * len(d)
    for label, color in (("same region", INTRA), ("between regions", CROSS), ("to/from coordinator", ENDS)):
        s.append(Curve(((x, legend_y + 8), (x + 12, legend_y + 8), (x + 24, legend_y + 8), (x + 36, legend_y + 8)),
                       width=4, color=color, opacity=0.8))
        s.append(Text(x + 42, legend_y + 12, label, size=11, anchor="start"))
        x += 60 + 7 * len(label)
    unused = [n.name for n in cluster.nodes if n.name not in slot]
    if unused:
        shown = ", ".join(unused[:12]) + (f" and {len(unused) - 12} more" if len(unused) > 12 else "")
        s.append(Text(MARGIN, legend_y + 40, f"holding no layers: {shown}", size=11, anchor="start",
                      color="#666666"))
    if profiles is not None:
        s.append(Text(width - MARGIN, legend_y + 40, "bar in a box: flow / T_j", size=11, anchor="end",
                      color="#666666"))
    scene.width = max(scene.width, x + MARGIN)
    return scene


def _arrowhead(p: tuple[tuple[float, float], ...], size: float, color: str) -> Poly:
    """A triangle at the end of a Bézier, pointing along its last tangent."""
    (ax, ay), (bx, by) = p[2], p[3]
    dx, dy = bx - ax, by - ay
    norm = math.hypot(dx, dy) or 1.0
    ux, uy = dx / norm, dy / norm
    base = (bx - ux * size, by - uy * size)
    return Poly(((bx, by), (base[0] - uy * size * 0.55, base[1] + ux * size * 0.55),
                 (base[0] + uy * size * 0.55, base[1] - ux * size * 0.55)), fill=color)


def _band_height(rows: int) -> float:
    return rows * ROW_H - (ROW_H - BOX_H) + 2 * BAND_PAD + 6


def _bezier(p: tuple[tuple[float, float], ...], t: float) -> tuple[float, float]:
    u = 1 - t
    w = (u**3, 3 * u * u * t, 3 * u * t * t, t**3)
    return sum(c * q[0] for c, q in zip(w, p, strict=True)), sum(c * q[1] for c, q in zip(w, p, strict=True))


def _short(x: float) -> str:
    if x >= 10_000:
        return f"{x / 1000:.0f}k"
    if x >= 1000:
        return f"{x / 1000:.1f}k"
    return f"{x:.0f}" if x >= 10 else f"{x:.1f}"


# -- SVG ------------------------------------------------------------------------------------------------------

def _svg(scene: Scene) -> str:
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{scene.width:.0f}" height="{scene.height:.0f}" '
           f'viewBox="0 0 {scene.width:.0f} {scene.height:.0f}" font-family="DejaVu Sans, Helvetica, Arial, '
           'sans-serif">',
           f'<rect width="{scene.width:.0f}" height="{scene.height:.0f}" fill="#ffffff"/>']
    for shape in scene.shapes:
        if isinstance(shape, Rect):
            out.append(f'<rect x="{shape.x:.1f}" y="{shape.y:.1f}" width="{shape.w:.1f}" height="{shape.h:.1f}" '
                       f'rx="{shape.radius:.1f}" fill="{shape.fill}" stroke="{shape.stroke}" '
                       f'stroke-width="{shape.stroke_w:.1f}" fill-opacity="{shape.opacity}"/>')
        elif isinstance(shape, Curve):
            (x0, y0), (x1, y1), (x2, y2), (x3, y3) = shape.points
            out.append(f'<path d="M {x0:.1f} {y0:.1f} C {x1:.1f} {y1:.1f}, {x2:.1f} {y2:.1f}, {x3:.1f} {y3:.1f}" '
                       f'fill="none" stroke="{shape.color}" stroke-width="{shape.width:.2f}" '
                       f'stroke-opacity="{shape.opacity}" stroke-linecap="round"/>')
        elif isinstance(shape, Poly):
            pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in shape.points)
            out.append(f'<polygon points="{pts}" fill="{shape.fill}" fill-opacity="{shape.opacity}"/>')
        else:
            attrs = (f'x="{shape.x:.1f}" y="{shape.y:.1f}" font-size="{shape.size}" text-anchor="{shape.anchor}" '
                     f'fill="{shape.color}"')
            if shape.bold:
                attrs += ' font-weight="bold"'
            if shape.halo:
                attrs += ' stroke="#ffffff" stroke-width="3" paint-order="stroke" stroke-linejoin="round"'
            out.append(f"<text {attrs}>{escape(shape.text)}</text>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


# -- PNG ------------------------------------------------------------------------------------------------------

def _png(scene: Scene, path: Path) -> None:
    try:
        from matplotlib import patheffects
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import FancyBboxPatch, PathPatch, Polygon
        from matplotlib.path import Path as MplPath
    except ImportError as exc:  # pragma: no cover - matplotlib is a dependency, but keep the message useful
        raise ConfigError("a PNG picture needs matplotlib; write an .svg instead", file=str(path)) from exc
    dpi = 100.0
    pt = 72.0 / dpi  # points per pixel
    fig = Figure(figsize=(scene.width / dpi, scene.height / dpi), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.0, 0.0, 1.0, 1.0))
    ax.set_xlim(0, scene.width)
    ax.set_ylim(scene.height, 0)
    ax.axis("off")
    anchors = {"start": "left", "middle": "center", "end": "right"}
    for z, shape in enumerate(scene.shapes):
        if isinstance(shape, Rect):
            ax.add_patch(FancyBboxPatch((shape.x, shape.y), shape.w, shape.h,
                                        boxstyle=f"round,pad=0,rounding_size={min(shape.radius, shape.h / 2)}",
                                        facecolor=shape.fill, alpha=shape.opacity,
                                        edgecolor="none" if shape.stroke == "none" else shape.stroke,
                                        linewidth=shape.stroke_w * pt, zorder=z))
        elif isinstance(shape, Curve):
            codes = [MplPath.MOVETO, MplPath.CURVE4, MplPath.CURVE4, MplPath.CURVE4]
            ax.add_patch(PathPatch(MplPath(list(shape.points), codes), facecolor="none", edgecolor=shape.color,
                                   alpha=shape.opacity, linewidth=shape.width * pt, capstyle="round", zorder=z))
        elif isinstance(shape, Poly):
            ax.add_patch(Polygon(list(shape.points), closed=True, facecolor=shape.fill, edgecolor="none",
                                 alpha=shape.opacity, zorder=z))
        else:
            text = ax.text(shape.x, shape.y, shape.text, fontsize=shape.size * pt, ha=anchors[shape.anchor],
                           va="baseline", color=shape.color, fontweight="bold" if shape.bold else "normal",
                           zorder=z)
            if shape.halo:
                text.set_path_effects([patheffects.withStroke(linewidth=3 * pt, foreground="white")])
    fig.savefig(str(path), dpi=dpi, facecolor="white")
