"""The link-emulation file the testnet hands each process: who is who, and which cluster file shapes links.

JSON: {"cluster_file": "PATH.toml", "names": {"<peer id>": "<node name or 'coordinator'>", ...},
"kernel_bandwidth": false}. With kernel_bandwidth (`testnet up --netns`) the kernel limits bandwidth on real
interfaces, and the processes emulate only latency and loss.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from hetnode.errors import ConfigError
from hetnode.ids import NodeId
from hetnode.planner.cluster import LinkSpec, load_cluster


def write_link_emulation(path: Path, cluster_file: Path, names: dict[str, str], *,
                         kernel_bandwidth: bool = False) -> None:
    path.write_text(json.dumps({"cluster_file": str(cluster_file), "names": names,
                                "kernel_bandwidth": kernel_bandwidth}, indent=2))


def load_link_emulation(path: str) -> Callable[[NodeId, NodeId], LinkSpec | None]:
    try:
        data = json.loads(Path(path).read_text())
        cluster_file = data["cluster_file"]
        names = {str(k): str(v) for k, v in data["names"].items()}
        kernel_bandwidth = bool(data.get("kernel_bandwidth", False))
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
        raise ConfigError(f"not a link emulation file: {exc}", file=path) from exc
    cluster = load_cluster(cluster_file)

    def link_for(local: NodeId, remote: NodeId) -> LinkSpec | None:
        a, b = names.get(local), names.get(remote)
        if a is None or b is None:
            return None
        # No link in the cluster file (a pruned coordinator link): the connection still carries control
        # messages, unshaped; the plan never sends the data path over it.
        link = cluster.link_or_none(a, b)
        if link is not None and kernel_bandwidth:
            return replace(link, bandwidth_mbps=math.inf)
        return link

    return link_for
