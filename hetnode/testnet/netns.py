"""Testnet processes on real network interfaces: one Linux network namespace per process, a bridge between them,
and each link's bandwidth limited by the kernel (`hetnode testnet up --netns`).

Every process (the coordinator and each node) gets its own namespace with a veth pair: one end inside, with its
own address on a /24 of 10.231.0.0/16, the other on a bridge in the host's namespace, which also holds an address
there (so the API and the peers are reachable from the host, as from another machine). Peers then bootstrap,
listen and dial on those addresses exactly as on separate hosts: nothing is loopback.

Bandwidth: each namespace's veth has an HTB tree on egress with one class per destination whose link in the
cluster file is finite (`tc ... htb rate R ceil R`, selected by destination address): the kernel limits A -> B to
the cluster's A -> B rate, and the probes measure what the kernel lets through. Latency and loss are not the
kernel's here (these machines have no `netem`), so they stay with the userspace link emulation, which then leaves
bandwidth alone (`write_link_emulation(..., kernel_bandwidth=True)`).

Needs root (CAP_NET_ADMIN) and `ip`/`tc` from iproute2. `netns_problem()` says why it cannot run, for a clear
error or a test's skip reason. Everything created is named after one tag, so `destroy` removes exactly it.
"""

from __future__ import annotations

import math
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass

from hetnode.errors import HetnodeError
from hetnode.planner.cluster import ClusterSpec

SUBNET_BASE = "10.231"  # 10.231.K.0/24, K picked per testnet among the unused ones
HOST_OCTET = 254  # the host's address on the bridge
RATE_CEIL_MBPS = 10_000  # the default class: links the cluster leaves unlimited


class NetnsError(HetnodeError):
    """Creating or shaping the namespaces failed."""


@dataclass
class NetnsLayout:
    tag: str  # 4 hex digits: every name below contains it
    subnet: int  # K of 10.231.K.0/24
    members: dict[str, int]  # process name ("coordinator", node names) -> its last octet

    @property
    def bridge(self) -> str:
        return f"hnb{self.tag}"

    def namespace(self, name: str) -> str:
        return f"hn{self.tag}-{self.members[name]}"

    def address(self, name: str) -> str:
        return f"{SUBNET_BASE}.{self.subnet}.{self.members[name]}"

    @property
    def host_address(self) -> str:
        return f"{SUBNET_BASE}.{self.subnet}.{HOST_OCTET}"

    def _veth(self, name: str) -> tuple[str, str]:
        """(the end inside the namespace, the end on the bridge): at most 15 characters each."""
        return f"hv{self.tag}i{self.members[name]}", f"hv{self.tag}o{self.members[name]}"

    def exec_prefix(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(name)]

    def to_json(self) -> dict[str, object]:
        return {"tag": self.tag, "subnet": self.subnet, "members": dict(self.members)}

    @staticmethod
    def from_json(data: dict[str, object]) -> NetnsLayout:
        members = data["members"]
        assert isinstance(members, dict)
        return NetnsLayout(str(data["tag"]), int(str(data["subnet"])), {str(k): int(v) for k, v in members.items()})


def netns_problem() -> str:
    """Why namespaces cannot be used here ('' when they can)."""
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' (iproute2) is not installed"
    probe = f"hnprobe{secrets.token_hex(2)}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"'ip netns add' failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def plan_layout(names: list[str]) -> NetnsLayout:
    if len(names) > 250:
        raise NetnsError(f"{len(names)} processes do not fit one /24")
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    free = [k for k in range(1, 255) if f" {SUBNET_BASE}.{k}." not in used]
    if not free:
        raise NetnsError(f"every {SUBNET_BASE}.K.0/24 is in use on this host")
    tag = secrets.token_hex(2)
    return NetnsLayout(tag, free[secrets.randbelow(len(free))], {n: i + 1 for i, n in enumerate(names)})


def _run(*cmd: str) -> None:
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    if r.returncode != 0:
        raise NetnsError(f"'{' '.join(cmd)}' failed: {r.stderr.strip() or r.stdout.strip()}")


def create(layout: NetnsLayout) -> None:
    """The bridge, the namespaces and their veths, addressed and up. Undone by `destroy` on failure."""
    try:
        _run("ip", "link", "add", layout.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{layout.host_address}/24", "dev", layout.bridge)
        _run("ip", "link", "set", layout.bridge, "up")
        for name in layout.members:
            ns, (inside, outside) = layout.namespace(name), layout._veth(name)
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", inside, "type", "veth", "peer", "name", outside)
            _run("ip", "link", "set", inside, "netns", ns)
            _run("ip", "link", "set", outside, "master", layout.bridge)
            _run("ip", "link", "set", outside, "up")
            _run("ip", "-n", ns, "addr", "add", f"{layout.address(name)}/24", "dev", inside)
            _run("ip", "-n", ns, "link", "set", inside, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
    except BaseException:
        destroy(layout)
        raise


def shape(layout: NetnsLayout, cluster: ClusterSpec) -> dict[tuple[str, str], float]:
    """HTB on every namespace's egress: one class per destination with a finite link in `cluster`. Returns the
    rates set, Mbit/s by (from, to)."""
    rates: dict[tuple[str, str], float] = {}
    for src in layout.members:
        ns, (dev, _) = layout.namespace(src), layout._veth(src)
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb",
             "default", "1")
        _run("ip", "netns", "exec", ns, "tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
             "rate", f"{RATE_CEIL_MBPS}mbit")
        for minor, dst in enumerate((d for d in layout.members if d != src), start=10):
            link = cluster.link_or_none(src, dst)
            if link is None or not math.isfinite(link.bandwidth_mbps):
                continue
            rate = f"{link.bandwidth_mbps:g}mbit"
            # A burst of a few milliseconds at the rate (at least 32 KiB): HTB's default burst is sized for
            # the timer of slow machines and lets fast bulk probes run over the rate.
            burst = max(32 * 1024, int(link.bytes_per_s * 0.004))
            _run("ip", "netns", "exec", ns, "tc", "class", "add", "dev", dev, "parent", "1:", "classid",
                 f"1:{minor}", "htb", "rate", rate, "ceil", rate, "burst", str(burst), "cburst", str(burst))
            _run("ip", "netns", "exec", ns, "tc", "filter", "add", "dev", dev, "protocol", "ip", "parent", "1:",
                 "prio", "1", "u32", "match", "ip", "dst", f"{layout.address(dst)}/32", "flowid", f"1:{minor}")
            rates[(src, dst)] = link.bandwidth_mbps
    return rates


def destroy(layout: NetnsLayout) -> None:
    """Remove everything `create` made (deleting a namespace deletes its veth pair); missing parts are fine."""
    for name in layout.members:
        subprocess.run(["ip", "netns", "del", layout.namespace(name)], capture_output=True)
        subprocess.run(["ip", "link", "del", layout._veth(name)[1]], capture_output=True)
    subprocess.run(["ip", "link", "del", layout.bridge], capture_output=True)
