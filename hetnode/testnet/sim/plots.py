"""Pictures of a run, for a person to look at: latency CDFs, throughput over time, utilization per node and
over time, and the links that were busiest or made prompts wait. Matplotlib's object API with the Agg canvas
(no pyplot, no global backend), so it works on a machine without a display and leaves callers' state alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hetnode.testnet.sim.metrics import SimResult

_DEVICE_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c",
                  "#ccb974", "#64b5cd")


def write_plots(result: SimResult, directory: str | Path) -> list[Path]:
    """Every picture of `result` as PNG files in `directory` (created); the paths written."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    out = [
        _save(_latency_cdfs(result), folder / "latency_cdf.png"),
        _save(_throughput(result), folder / "throughput.png"),
        _save(_node_utilization(result), folder / "node_utilization.png"),
        _save(_utilization_over_time(result), folder / "node_utilization_time.png"),
        _save(_links(result), folder / "links.png"),
    ]
    return out


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path)
    return path


def _title(result: SimResult) -> str:
    c = result.config
    load = "offline" if c.get("offline") else f"{c.get('rate') or 0:.3g} req/s"
    return (f"{c.get('cluster')} / {c.get('model')} / {c.get('method')} placement / {c.get('scheduler')} "
            f"scheduler / {c.get('workload')} ({load})")


def _latency_cdfs(result: SimResult) -> Any:
    fig = _figure(13, 4.2)
    axes = fig.subplots(1, 3)
    done = [r for r in result.requests if r.measured and r.finished]
    for ax, (key, label) in zip(axes, (("ttft", "time to first token (s)"), ("tpot", "time per output token (s)"),
                                       ("e2e", "end-to-end latency (s)")), strict=True):
        xs = np.sort(np.asarray([getattr(r, key) for r in done if not math.isnan(getattr(r, key))], dtype=float))
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(True, alpha=0.3)
        if xs.size == 0:
            ax.text(0.5, 0.5, "no finished requests", ha="center", va="center", transform=ax.transAxes)
            continue
        ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", color="#4c72b0")
        for q, style in ((50, ":"), (90, "--"), (99, "-.")):
            v = float(np.percentile(xs, q))
            ax.axvline(v, color="#c44e52", linestyle=style, linewidth=1)
            ax.text(v, 0.02 + q / 400, f" P{q} {v:.3g}", color="#c44e52", fontsize=8)
        slo = result.config.get("slos", {}).get(key)
        if slo:
            ax.axvline(slo, color="#55a868", linewidth=1.5)
            ax.text(slo, 0.9, f" SLO {slo:g}", color="#55a868", fontsize=8)
        ax.set_ylim(0, 1.02)
        if xs[-1] > 20 * max(xs[xs.size // 2], 1e-9):
            ax.set_xscale("log")
    fig.suptitle(f"Latency of {len(done)} requests in the measured window\n{_title(result)}", fontsize=10)
    return fig


def _shade_window(ax: Any, result: SimResult) -> None:
    lo, hi = result.summary["window_s"]
    ax.axvspan(0, lo, color="#999999", alpha=0.15, linewidth=0)
    if result.sim_end_s > hi:
        ax.axvspan(hi, result.sim_end_s, color="#999999", alpha=0.15, linewidth=0)


def _throughput(result: SimResult) -> Any:
    fig = _figure(11, 5)
    top, bottom = fig.subplots(2, 1, sharex=True)
    ts = result.timeseries
    t = np.asarray(ts.times) + ts.bin_s / 2
    top.plot(t, ts.decode_tokens_per_s, color="#4c72b0", label="generated tokens/s")
    top.axhline(result.summary["decode_throughput"], color="#4c72b0", linestyle="--", linewidth=1,
                label=f"window mean {result.summary['decode_throughput']:.4g}")
    top.set_ylabel("decode tokens/s")
    top.legend(loc="upper right", fontsize=8)
    bottom.plot(t, ts.prompt_tokens_per_s, color="#dd8452", label="prompt tokens/s")
    bottom.axhline(result.summary["prompt_throughput"], color="#dd8452", linestyle="--", linewidth=1,
                   label=f"window mean {result.summary['prompt_throughput']:.4g}")
    bottom.set_ylabel("prompt tokens/s")
    bottom.set_xlabel(f"simulated time (s), bins of {ts.bin_s:g} s; grey: warm-up and drain, not measured")
    bottom.legend(loc="upper right", fontsize=8)
    for ax in (top, bottom):
        _shade_window(ax, result)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    fig.suptitle(f"Throughput over time\n{_title(result)}", fontsize=10)
    return fig


def _device_colors(devices: Sequence[str]) -> dict[str, str]:
    return {d: _DEVICE_COLORS[i % len(_DEVICE_COLORS)] for i, d in enumerate(sorted(set(devices)))}


def _node_utilization(result: SimResult) -> Any:
    nodes = sorted(result.nodes, key=lambda n: (n.last_layer == n.first_layer, n.first_layer, n.last_layer, n.name))
    fig = _figure(11, max(3.0, 0.28 * len(nodes) + 1.5))
    ax = fig.subplots()
    colors = _device_colors([n.device for n in nodes])
    y = np.arange(len(nodes))
    ax.barh(y, [n.utilization for n in nodes], color=[colors[n.device] for n in nodes], height=0.7)
    peaks = [n.kv_peak if not math.isnan(n.kv_peak) else 0.0 for n in nodes]
    ax.scatter(peaks, y, marker="|", color="black", s=60, zorder=3, label="KV peak (share of capacity)")
    ax.set_yticks(y, [f"{n.name} [{n.first_layer},{n.last_layer})" if n.last_layer > n.first_layer
                      else f"{n.name} (unused)" for n in nodes], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(1.05, max(peaks, default=0) * 1.05))
    ax.axvline(1.0, color="#888888", linewidth=0.8)
    ax.set_xlabel("compute utilization in the measured window (busy share); | KV peak")
    ax.grid(True, axis="x", alpha=0.3)
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=d) for d, c in colors.items()]
    ax.legend(handles=[*handles, *ax.get_legend_handles_labels()[0]], loc="lower right", fontsize=8)
    fig.suptitle(f"Utilization per node, by layer range (mean {result.summary['node_utilization_mean']:.0%})\n"
                 f"{_title(result)}", fontsize=10)
    return fig


def _utilization_over_time(result: SimResult) -> Any:
    ts = result.timeseries
    used = sorted((n for n in result.nodes if n.name in ts.node_utilization), key=lambda n: (n.first_layer, n.name))
    fig = _figure(11, max(3.0, 0.22 * len(used) + 1.6))
    ax = fig.subplots()
    if used:
        grid = np.asarray([ts.node_utilization[n.name] for n in used], dtype=float)
        end = len(ts.decode_tokens_per_s) * ts.bin_s
        image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0, vmax=1,
                          extent=(0, end, len(used) - 0.5, -0.5))
        ax.set_yticks(range(len(used)), [f"{n.name} [{n.first_layer},{n.last_layer})" for n in used], fontsize=7)
        fig.colorbar(image, ax=ax, label="busy share of the bin")
    ax.set_xlabel(f"simulated time (s), bins of {ts.bin_s:g} s")
    fig.suptitle(f"Node utilization over time\n{_title(result)}", fontsize=10)
    return fig


def _links(result: SimResult, top: int = 15) -> Any:
    links = sorted(result.links, key=lambda link: (-link.utilization, link.name))[:top]
    waits = sorted((link for link in result.links if link.queued_messages),
                   key=lambda link: (-link.mean_item_queue_s, link.name))[:top]
    fig = _figure(12, max(3.5, 0.3 * max(len(links), len(waits)) + 1.8))
    left, right = fig.subplots(1, 2)
    y = np.arange(len(links))
    left.barh(y, [link.utilization for link in links], color="#4c72b0")
    left.set_yticks(y, [f"{link.name} ({_bw(link.bandwidth_mbps)})" for link in links], fontsize=8)
    left.invert_yaxis()
    left.set_xlim(0, 1.05)
    left.set_xlabel("link utilization in the measured window")
    left.grid(True, axis="x", alpha=0.3)
    y = np.arange(len(waits))
    right.barh(y - 0.2, [link.mean_prompt_queue_s for link in waits], height=0.4, color="#dd8452",
               label="prompt items")
    right.barh(y + 0.2, [link.mean_item_queue_s for link in waits], height=0.4, color="#4c72b0", label="all items")
    right.set_yticks(y, [link.name for link in waits], fontsize=8)
    right.invert_yaxis()
    if not waits:
        right.text(0.5, 0.5, "no message waited for a link", ha="center", va="center", transform=right.transAxes)
    right.set_xlabel("mean queueing delay before transmission (s)")
    right.legend(loc="lower right", fontsize=8)
    right.grid(True, axis="x", alpha=0.3)
    fig.suptitle(f"Busiest links, and where messages waited (Helix §6.7's congestion)\n{_title(result)}",
                 fontsize=10)
    return fig


def _bw(mbps: float) -> str:
    if math.isinf(mbps):
        return "unlimited"
    return f"{mbps / 1000:g} Gb/s" if mbps >= 1000 else f"{mbps:g} Mb/s"
