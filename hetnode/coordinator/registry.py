"""Membership, liveness and the link matrix, as the coordinator knows them.

Pure bookkeeping: no I/O. Time comes in as arguments (`now` on the trio clock for deadlines, `wall` in unix
seconds for display), so the same object runs under trio's MockClock in tests and in the simulator later.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from hetnode.ids import NodeId
from hetnode.protocol.messages import (
    Assignment,
    HardwareProfile,
    Join,
    LinkMeasurement,
    Load,
    MemberInfo,
)

NodeState = Literal["up", "down", "left"]


@dataclass
class NodeRecord:
    peer_id: NodeId
    name: str
    region: str
    addrs: list[str]
    profile: HardwareProfile
    state: NodeState
    joined_at: float  # wall
    last_seen: float  # wall
    deadline: float  # trio clock: marked down if no heartbeat by then
    load: Load = field(default_factory=Load)
    state_reason: str = ""
    assignment: Assignment | None = None
    assignment_state: str = ""
    joins: int = 1
    # Leaving gracefully: still a member (its sessions' KV moves from it to other nodes), but planned and routed
    # nothing new.
    draining: bool = False

    def member_info(self) -> MemberInfo:
        return MemberInfo(peer_id=self.peer_id, name=self.name, region=self.region, addrs=self.addrs)


@dataclass(frozen=True)
class LinkEntry:
    bandwidth_mbps: float
    rtt_ms: float
    measured_at: float  # wall


@dataclass(frozen=True)
class Admission:
    admitted: bool
    reason: str = ""
    rejoined: bool = False


class Registry:
    """Who is a member, who is alive, and what each directed link measured."""

    def __init__(self, *, token: str, heartbeat_deadline_s: float) -> None:
        self._token = token.encode()
        self.heartbeat_deadline_s = heartbeat_deadline_s
        self.nodes: dict[NodeId, NodeRecord] = {}
        self.links: dict[tuple[NodeId, NodeId], LinkEntry] = {}
        # Bumped on every change of the set of up members, so pushes can be ordered by receivers.
        self.version = 0

    # -- admission ---------------------------------------------------------------------------------------

    def admit(self, peer: NodeId, join: Join, *, now: float, wall: float) -> Admission:
        if not hmac.compare_digest(join.token.encode(), self._token):
            return Admission(False, "invalid admission token")
        clash = next((r for r in self.nodes.values()
                      if r.name == join.name and r.peer_id != peer and r.state == "up"), None)
        if clash is not None:
            return Admission(False, f"name {join.name!r} is already used by up member {clash.peer_id}")
        old = self.nodes.get(peer)
        record = NodeRecord(
            peer_id=peer, name=join.name, region=join.region, addrs=list(join.listen_addrs),
            profile=join.profile, state="up", joined_at=wall, last_seen=wall,
            deadline=now + self.heartbeat_deadline_s,
            joins=(old.joins + 1) if old else 1,
        )
        self.nodes[peer] = record
        self.version += 1
        return Admission(True, rejoined=old is not None)

    def is_member(self, peer: NodeId) -> bool:
        record = self.nodes.get(peer)
        return record is not None and record.state == "up"

    def up_members(self) -> list[NodeRecord]:
        """The members that may serve: up, and not draining before they leave."""
        return sorted((r for r in self.nodes.values() if r.state == "up" and not r.draining), key=lambda r: r.name)

    def members(self) -> list[NodeRecord]:
        """Every member the data path accepts, draining ones included (what the nodes are told)."""
        return sorted((r for r in self.nodes.values() if r.state == "up"), key=lambda r: r.name)

    def drain(self, peer: NodeId) -> bool:
        """Mark an up member as draining; True if that changed anything."""
        record = self.nodes.get(peer)
        if record is None or record.state != "up" or record.draining:
            return False
        record.draining = True
        self.version += 1
        return True

    # -- liveness ----------------------------------------------------------------------------------------

    def heartbeat(self, peer: NodeId, load: Load, *, now: float, wall: float) -> bool:
        """Record a heartbeat; False if the peer is not an up member (the caller rejects it)."""
        record = self.nodes.get(peer)
        if record is None or record.state != "up":
            return False
        record.load = load
        record.last_seen = wall
        record.deadline = now + self.heartbeat_deadline_s
        return True

    def mark(self, peer: NodeId, state: NodeState, reason: str) -> bool:
        """Move an up member to down or left; True if that changed anything."""
        record = self.nodes.get(peer)
        if record is None or record.state != "up":
            return False
        record.state = state
        record.state_reason = reason
        self.version += 1
        return True

    def next_deadline(self) -> float | None:
        deadlines = [r.deadline for r in self.nodes.values() if r.state == "up"]
        return min(deadlines) if deadlines else None

    def expire(self, *, now: float) -> list[NodeId]:
        """Mark down every up member whose heartbeat deadline has passed; returns them."""
        expired = [r.peer_id for r in self.nodes.values() if r.state == "up" and r.deadline <= now]
        for peer in expired:
            self.mark(peer, "down", f"no heartbeat for {self.heartbeat_deadline_s:g} s")
        return expired

    # -- links -------------------------------------------------------------------------------------------

    def report_links(self, src: NodeId, measurements: Iterable[LinkMeasurement]) -> int:
        """Store measurements from src to peers we know of (or to the coordinator); returns how many."""
        stored = 0
        for m in measurements:
            dst = NodeId(m.dst)
            self.links[(src, dst)] = LinkEntry(m.bandwidth_mbps, m.rtt_ms, m.measured_at)
            stored += 1
        return stored

    # -- views -------------------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, object]:
        """The JSON view behind GET /v1/cluster."""
        names = {r.peer_id: r.name for r in self.nodes.values()}
        nodes = []
        for r in sorted(self.nodes.values(), key=lambda r: r.name):
            nodes.append({
                "peer_id": r.peer_id,
                "name": r.name,
                "region": r.region,
                "addrs": r.addrs,
                "state": r.state,
                "state_reason": r.state_reason,
                "draining": r.draining,
                "profile": _profile_json(r.profile),
                "load": {
                    "queued_tokens": r.load.queued_tokens,
                    "active_sessions": r.load.active_sessions,
                    "kv_blocks_used": r.load.kv_blocks_used,
                    "kv_blocks_free": r.load.kv_blocks_free,
                    "kv_block_size": r.load.kv_block_size,
                },
                "last_seen": r.last_seen,
                "joined_at": r.joined_at,
                "joins": r.joins,
                "assignment": None if r.assignment is None else {
                    "plan_version": r.assignment.plan_version,
                    "model": r.assignment.model,
                    "first_layer": r.assignment.first_layer,
                    "last_layer": r.assignment.last_layer,
                    "role": r.assignment.role,
                    "state": r.assignment_state,
                },
            })
        links = [
            {
                "src": src, "dst": dst,
                "src_name": names.get(src, "coordinator"), "dst_name": names.get(dst, "coordinator"),
                "bandwidth_mbps": round(e.bandwidth_mbps, 3),
                "bandwidth_MBps": round(e.bandwidth_mbps / 8, 3),
                "rtt_ms": round(e.rtt_ms, 3),
                "measured_at": e.measured_at,
            }
            for (src, dst), e in sorted(self.links.items())
        ]
        return {"version": self.version, "nodes": nodes, "links": links,
                "up": sum(1 for r in self.nodes.values() if r.state == "up")}


def _profile_json(p: HardwareProfile) -> dict[str, object]:
    return {
        "device": p.device, "device_type": p.device_type, "num_devices": p.num_devices,
        "memory_bytes": p.memory_bytes, "matmul_tflops": p.matmul_tflops,
        "mem_bandwidth_gbps": p.mem_bandwidth_gbps, "dtype": p.dtype, "emulated": p.emulated, "host": p.host,
    }
