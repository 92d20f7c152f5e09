"""The cluster as ThunderServe sees it: GPUs with a type and a host, and the links between every two.

A node of the cluster file is one GPU here (a "4xa6000" node is one GPU-like device of four, tensor parallel
inside it over its `gpu_link`, for files written before hosts). Links are taken each way as the file states
them; a missing link is bandwidth 0, so that no plan sends activations or KV over it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hetnode.planner.cluster import PCIE_LINK, ClusterSpec, LinkSpec
from hetnode.planner.devices import DeviceSpec

# An unlimited link priced as a fast one (bytes/s), so that alpha-beta sums stay finite.
FAST_BPS = 1e12


@dataclass(frozen=True)
class Gpu:
    name: str  # the node's name
    kind: str  # its device type ("a40"; "4xa6000" for a multi-GPU node)
    host: str
    device: DeviceSpec
    memory_bytes: int
    gpu_link: LinkSpec = PCIE_LINK  # among a multi-GPU node's own GPUs (`NodeSpec.gpu_link`)


@dataclass(frozen=True)
class GpuPool:
    gpus: tuple[Gpu, ...]
    bandwidth: tuple[tuple[float, ...], ...]  # [i][j]: bytes per second from GPU i to GPU j (0: no link)
    latency: tuple[tuple[float, ...], ...]  # [i][j]: seconds, one way

    def __len__(self) -> int:
        return len(self.gpus)

    def hop_seconds(self, a: int, b: int, nbytes: float) -> float:
        """Alpha-beta: the time to move `nbytes` from GPU a to GPU b (inf without a link)."""
        if a == b:
            return 0.0
        bw = self.bandwidth[a][b]
        return self.latency[a][b] + nbytes / bw if bw > 0 else math.inf


def gpu_pool(cluster: ClusterSpec) -> GpuPool:
    gpus = tuple(Gpu(name=n.name, kind=n.device, host=n.machine, device=n.device_spec,
                     memory_bytes=int(n.memory_gb * 2**30), gpu_link=n.gpu_link or PCIE_LINK)
                 for n in cluster.nodes)
    bandwidth: list[tuple[float, ...]] = []
    latency: list[tuple[float, ...]] = []
    for a in gpus:
        bw_row: list[float] = []
        lat_row: list[float] = []
        for b in gpus:
            link = cluster.link_or_none(a.name, b.name)
            if a.name == b.name or link is None:
                bw_row.append(math.inf if a.name == b.name else 0.0)
                lat_row.append(0.0)
                continue
            bw_row.append(min(link.bytes_per_s, FAST_BPS))
            lat_row.append(link.latency_s)
        bandwidth.append(tuple(bw_row))
        latency.append(tuple(lat_row))
    return GpuPool(gpus=gpus, bandwidth=tuple(bandwidth), latency=tuple(latency))
