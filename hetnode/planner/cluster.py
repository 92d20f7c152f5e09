"""Cluster files: the nodes, their device types and regions, and the links between them.

One model serves the testnet (which emulates the devices and links) and the planner (which plans over them).
Parsing is pure and strict: every mistake raises ConfigError naming the file, the key (`nodes[2].device`,
`links.regions[0].bandwidth_mbps`) and the problem, because a silently ignored typo in a link table makes an
experiment measure something other than what its author meant.

The format (TOML; docs/cluster-files.md has the long version)::

    name = "demo"
    description = "optional free text"

    [coordinator]                 # optional; region defaults to the first node's region
    region = "us"                 # links to the coordinator follow the region rules
    links = "regions"             # optional; "listed": only links.pairs/links.directed naming it exist

    [[nodes]]
    name = "a100-0"               # unique; lowercase letters, digits, "-" and "_"; not "coordinator"
    device = "a100"               # a planner.devices name, optionally with a count: "2xl4"
    region = "us"                 # same character set as node names
    memory_gb = 40                # optional; overrides the device's memory (GiB)
    host = "box-0"                # optional; the machine the GPU sits in (GPU-granularity files)
    gpu_link = { bandwidth_mbps = 2400000, latency_ms = 0.005 }  # optional; among a multi-GPU node's own
                                  # GPUs (its roofline profile's all-reduces; default: PCIE_LINK)

    [links.default]               # optional; where nothing more specific applies
    bandwidth_mbps = 1000         # megabits per second, > 0
    latency_ms = 0.5              # one way, >= 0 (the round trip is twice this)
    loss = 0.0                    # optional, in [0, 1): the probability that a packet is lost

    [links.intra_host]            # optional; between two nodes with the same `host` (default: PCIE_LINK)
    bandwidth_mbps = 128000
    latency_ms = 0.01

    [links.intra_region]          # optional; between two endpoints in the same region
    bandwidth_mbps = 10000
    latency_ms = 0.1

    [[links.regions]]             # per region pair, symmetric; a == b sets one region's own links
    a = "us"
    b = "eu"
    bandwidth_mbps = 100
    latency_ms = 25

    [[links.pairs]]               # per endpoint pair, symmetric; "coordinator" names the coordinator
    a = "a100-0"
    b = "t4-1"
    bandwidth_mbps = 200
    latency_ms = 5

    [[links.directed]]            # one direction only: from -> to
    from = "coordinator"
    to = "t4-1"
    none = true                   # any rule may say `none = true` (and nothing else): there is no link

`ClusterSpec.link(a, b)` is the link from a to b; it picks the most specific rule: directed > pair > region
pair > intra_host (same host) > region pair > intra_region (same region) > default; with no rule at all the
link is `UNLIMITED` (not emulated). Two nodes of one host without an intra_host rule get `PCIE_LINK`: GPUs in
one machine talk over PCIe, and a region rule written for the Ethernet between machines would otherwise
price them as if they were far apart.

A node is one device. ThunderServe plans at GPU granularity (tensor parallelism only among GPUs of one
machine), so its files list one node per GPU and say which machine each is in with `host`; a node without
one is a machine of its own. The GPUs of a host must share its region.

Links are directed because measured ones are (a path's two directions are probed separately, and Helix's
problem instances list each direction's capacity, some only one), and some do not exist at all: Helix §4.5
prunes slow connections, the coordinator's included, and a plan that sends tokens over a link that is not
there is wrong however good its flow. `has_link(a, b)` says whether one exists; `link(a, b)` raises
`MissingLinkError` for one that does not, so nothing uses it by accident. With `[coordinator] links =
"listed"` the coordinator reaches exactly the nodes that a pair or directed entry naming it lists: the
pruned instances list a few links to and from the coordinator, and writing "none" for every other node (both
ways) would bury them.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetnode.errors import ConfigError
from hetnode.planner.devices import DeviceSpec, parse_device

# Re-exported: cluster files are where most callers meet link conditions.
from hetnode.protocol.link_conditions import UNLIMITED as UNLIMITED
from hetnode.protocol.link_conditions import LinkSpec as LinkSpec

COORDINATOR = "coordinator"  # the name that links.pairs uses for the coordinator
_NAME = re.compile(r"[a-z0-9_-]{1,64}")
COORDINATOR_LINKS = ("regions", "listed")
# GPUs of one host without an intra_host rule: PCIe 4.0 x16 peer to peer as NCCL measures it between consumer
# and workstation GPUs without NVLink (about half the bus's 32 GB/s), with a few microseconds of latency.
PCIE_LINK = LinkSpec(bandwidth_mbps=128_000, latency_ms=0.01)


@dataclass(frozen=True)
class NoLink:
    """A rule that says there is no link (`none = true` in a cluster file)."""


NO_LINK = NoLink()
Rule = LinkSpec | NoLink  # what one link rule says


class MissingLinkError(KeyError):
    """`ClusterSpec.link(a, b)` for endpoints that no link joins in that direction."""


@dataclass(frozen=True)
class NodeSpec:
    name: str
    device: str  # canonical device name ("a100", "2xl4"): what `hetnode join --emulate` takes
    region: str
    memory_gb: float  # the device's memory, or the file's override
    host: str = ""  # the machine it sits in; "": a machine of its own
    # The link among the node's own GPUs (a multi-GPU device such as "4xa6000", which its roofline profile runs
    # tensor parallel over them); None: PCIE_LINK, a machine without NVLink.
    gpu_link: LinkSpec | None = None

    @property
    def machine(self) -> str:
        """The host it sits in: its `host`, or one of its own (a space keeps it apart from every host name)."""
        return self.host or f"node {self.name}"

    @property
    def device_spec(self) -> DeviceSpec:
        return parse_device(self.device)


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    nodes: tuple[NodeSpec, ...]
    coordinator_region: str
    default_link: Rule | None = None  # None: not given (NO_LINK: given, and it says there is no link)
    intra_region_link: Rule | None = None
    # Keyed by the unordered pair; a one-element set is a region's links to itself.
    region_links: Mapping[frozenset[str], Rule] = field(default_factory=dict, hash=False)
    pair_links: Mapping[frozenset[str], Rule] = field(default_factory=dict, hash=False)
    description: str = ""
    # Keyed by (from, to): one direction, beating every symmetric rule.
    directed_links: Mapping[tuple[str, str], Rule] = field(default_factory=dict, hash=False)
    coordinator_links: str = "regions"  # "listed": only pair/directed rules naming the coordinator link it
    intra_host_link: Rule | None = None  # between nodes of one host; None: PCIE_LINK

    def __post_init__(self) -> None:
        if self.coordinator_links not in COORDINATOR_LINKS:
            raise ValueError(f"coordinator_links must be one of {', '.join(COORDINATOR_LINKS)}, "
                             f"not {self.coordinator_links!r}")

    def node(self, name: str) -> NodeSpec:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(f"cluster {self.name} has no node {name!r}")

    def region_of(self, name: str) -> str:
        """The region of a node, or of the coordinator when name is "coordinator"."""
        return self.coordinator_region if name == COORDINATOR else self.node(name).region

    @property
    def regions(self) -> tuple[str, ...]:
        return tuple(sorted({n.region for n in self.nodes} | {self.coordinator_region}))

    def link_or_none(self, a: str, b: str) -> LinkSpec | None:
        """The link from endpoint a to endpoint b (node names or "coordinator"), None when there is none.

        An endpoint's link to itself is UNLIMITED; so is any link that no rule covers."""
        ra, rb = self.region_of(a), self.region_of(b)
        if a == b:
            return UNLIMITED
        found = self.directed_links.get((a, b)) or self.pair_links.get(frozenset((a, b)))
        if found is None and COORDINATOR in (a, b) and self.coordinator_links == "listed":
            return None
        if found is None and COORDINATOR not in (a, b) and self.node(a).machine == self.node(b).machine:
            found = self.intra_host_link or PCIE_LINK
        if found is None:
            found = self.region_links.get(frozenset((ra, rb)))
        if found is None and ra == rb:
            found = self.intra_region_link
        found = found or self.default_link or UNLIMITED
        return None if isinstance(found, NoLink) else found

    def has_link(self, a: str, b: str) -> bool:
        return self.link_or_none(a, b) is not None

    def link(self, a: str, b: str) -> LinkSpec:
        """The link from a to b; MissingLinkError when there is none (`has_link` asks first)."""
        found = self.link_or_none(a, b)
        if found is None:
            raise MissingLinkError(f"cluster {self.name} has no link from {a} to {b}")
        return found

    @property
    def fully_connected(self) -> bool:
        """Every endpoint has a link to every other, both ways (what the files before directed links said)."""
        ends = [n.name for n in self.nodes] + [COORDINATOR]
        return all(self.has_link(a, b) for a in ends for b in ends)

    def to_dict(self) -> dict[str, Any]:
        """The cluster as a TOML-ready dict; `parse_cluster(spec.to_dict(), ...)` gives back an equal spec."""
        links: dict[str, Any] = {}
        if self.default_link is not None:
            links["default"] = _link_dict(self.default_link)
        if self.intra_host_link is not None:
            links["intra_host"] = _link_dict(self.intra_host_link)
        if self.intra_region_link is not None:
            links["intra_region"] = _link_dict(self.intra_region_link)
        if self.region_links:
            links["regions"] = [_pair_dict(k, v) for k, v in self.region_links.items()]
        if self.pair_links:
            links["pairs"] = [_pair_dict(k, v) for k, v in self.pair_links.items()]
        if self.directed_links:
            links["directed"] = [{"from": a, "to": b, **_link_dict(v)} for (a, b), v in self.directed_links.items()]
        out: dict[str, Any] = {"name": self.name}
        if self.description:
            out["description"] = self.description
        out["coordinator"] = {"region": self.coordinator_region}
        if self.coordinator_links != "regions":
            out["coordinator"]["links"] = self.coordinator_links
        out["nodes"] = [
            {"name": n.name, "device": n.device, "region": n.region, "memory_gb": n.memory_gb,
             **({"host": n.host} if n.host else {}),
             **({"gpu_link": _link_dict(n.gpu_link)} if n.gpu_link is not None else {})}
            for n in self.nodes
        ]
        if links:
            out["links"] = links
        return out


def _link_dict(link: Rule) -> dict[str, Any]:
    if isinstance(link, NoLink):
        return {"none": True}
    return {"bandwidth_mbps": link.bandwidth_mbps, "latency_ms": link.latency_ms, "loss": link.loss}


def _pair_dict(key: frozenset[str], link: Rule) -> dict[str, Any]:
    ends = sorted(key)
    return {"a": ends[0], "b": ends[-1], **_link_dict(link)}


def uniform_cluster(n: int, device: str = "cpu", *, region: str = "local", link: LinkSpec | None = None,
                    name: str | None = None) -> ClusterSpec:
    """n identical nodes "node-0".."node-{n-1}" in one region (what `--nodes N` means)."""
    if n < 1:
        raise ConfigError(f"need at least one node, not {n}", key="nodes")
    spec = parse_device(device)
    nodes = tuple(NodeSpec(f"node-{i}", spec.name, region, spec.memory_gb) for i in range(n))
    return ClusterSpec(name=name or f"uniform-{n}x{spec.name}", nodes=nodes, coordinator_region=region,
                       default_link=link)


def load_cluster(path: str | Path) -> ClusterSpec:
    source = str(path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read cluster file: {exc.strerror or exc}", file=source) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"invalid TOML: {exc}", file=source) from exc
    return parse_cluster(data, source)


def parse_cluster(data: Mapping[str, Any], source: str) -> ClusterSpec:
    """Validate a decoded cluster file; `source` names it in errors."""
    return _Parser(source).cluster(data)


_LINK_KEYS = {"bandwidth_mbps", "latency_ms", "loss", "none"}


class _Parser:
    def __init__(self, source: str) -> None:
        self.source = source

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError(problem, file=self.source, key=key or None)

    # -- typed getters ------------------------------------------------------------------------------------

    def table(self, value: object, key: str, allowed: set[str], required: set[str]) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise self.error(key, f"must be a table, not {_kind(value)}")
        for k in value:
            if k not in allowed:
                raise self.error(_join(key, k), f"unknown key (allowed here: {', '.join(sorted(allowed))})")
        for k in sorted(required):
            if k not in value:
                raise self.error(_join(key, k), "missing required key")
        return value

    def array_of_tables(self, value: object, key: str) -> list[Any]:
        if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
            raise self.error(key, f"must be an array of tables ([[{key}]]), not {_kind(value)}")
        return value

    def string(self, value: object, key: str) -> str:
        if not isinstance(value, str):
            raise self.error(key, f"must be a string, not {_kind(value)}")
        return value

    def ident(self, value: object, key: str) -> str:
        text = self.string(value, key)
        if not _NAME.fullmatch(text):
            raise self.error(key, f"{text!r} must be 1-64 of lowercase letters, digits, '-' and '_'")
        return text

    def number(self, value: object, key: str) -> float:
        # bool is an int subclass in Python; `bandwidth_mbps = true` is a mistake, not 1.
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(key, f"must be a number, not {_kind(value)}")
        if not math.isfinite(value):
            raise self.error(key, f"must be finite, not {value}")
        return float(value)

    def positive(self, value: object, key: str) -> float:
        x = self.number(value, key)
        if x <= 0:
            raise self.error(key, f"must be > 0, not {value}")
        return x

    # -- sections -----------------------------------------------------------------------------------------

    def cluster(self, data: Mapping[str, Any]) -> ClusterSpec:
        top = self.table(data, "", {"name", "description", "coordinator", "nodes", "links"}, {"name", "nodes"})
        name = self.string(top["name"], "name")
        description = self.string(top.get("description", ""), "description")
        nodes = self.nodes(top["nodes"])
        coordinator_region = nodes[0].region
        coordinator_links = "regions"
        if "coordinator" in top:
            coord = self.table(top["coordinator"], "coordinator", {"region", "links"}, {"region"})
            coordinator_region = self.ident(coord["region"], "coordinator.region")
            if "links" in coord:
                coordinator_links = self.string(coord["links"], "coordinator.links")
                if coordinator_links not in COORDINATOR_LINKS:
                    raise self.error("coordinator.links", f"must be one of {', '.join(COORDINATOR_LINKS)}, "
                                     f"not {coordinator_links!r}")
        regions = {n.region for n in nodes} | {coordinator_region}
        endpoints = {n.name for n in nodes} | {COORDINATOR}

        default: Rule | None = None
        intra: Rule | None = None
        intra_host: Rule | None = None
        region_links: dict[frozenset[str], Rule] = {}
        pair_links: dict[frozenset[str], Rule] = {}
        directed: dict[tuple[str, str], Rule] = {}
        if "links" in top:
            links = self.table(top["links"], "links",
                               {"default", "intra_host", "intra_region", "regions", "pairs", "directed"}, set())
            if "default" in links:
                default = self.link(links["default"], "links.default", set())
            if "intra_host" in links:
                intra_host = self.link(links["intra_host"], "links.intra_host", set())
            if "intra_region" in links:
                intra = self.link(links["intra_region"], "links.intra_region", set())
            if "regions" in links:
                region_links = self.pairs(links["regions"], "links.regions", regions, "region",
                                          allow_same=True)
            if "pairs" in links:
                pair_links = self.pairs(links["pairs"], "links.pairs", endpoints, "node", allow_same=False)
            if "directed" in links:
                directed = self.directed(links["directed"], "links.directed", endpoints)
        return ClusterSpec(name=name, nodes=nodes, coordinator_region=coordinator_region,
                           default_link=default, intra_region_link=intra, region_links=region_links,
                           pair_links=pair_links, description=description, directed_links=directed,
                           coordinator_links=coordinator_links, intra_host_link=intra_host)

    def nodes(self, value: object) -> tuple[NodeSpec, ...]:
        entries = self.array_of_tables(value, "nodes")
        if not entries:
            raise self.error("nodes", "a cluster needs at least one node")
        out: list[NodeSpec] = []
        seen: dict[str, int] = {}
        host_region: dict[str, tuple[str, int]] = {}  # host -> (its region, the first node naming it)
        for i, entry in enumerate(entries):
            key = f"nodes[{i}]"
            t = self.table(entry, key, {"name", "device", "region", "memory_gb", "host", "gpu_link"},
                           {"name", "device", "region"})
            name = self.ident(t["name"], f"{key}.name")
            if name == COORDINATOR:
                raise self.error(f"{key}.name", f"{COORDINATOR!r} is reserved for the coordinator")
            if name in seen:
                raise self.error(f"{key}.name", f"duplicate node name {name!r} (also nodes[{seen[name]}])")
            seen[name] = i
            device_name = self.string(t["device"], f"{key}.device")
            try:
                device = parse_device(device_name)
            except ConfigError as exc:
                raise self.error(f"{key}.device", exc.problem) from None
            region = self.ident(t["region"], f"{key}.region")
            memory = device.memory_gb
            if "memory_gb" in t:
                memory = self.positive(t["memory_gb"], f"{key}.memory_gb")
            host = ""
            if "host" in t:
                host = self.ident(t["host"], f"{key}.host")
                first = host_region.setdefault(host, (region, i))
                if first[0] != region:
                    raise self.error(f"{key}.host", f"host {host!r} is in region {first[0]!r} "
                                     f"(nodes[{first[1]}]); its GPUs cannot be in region {region!r}")
            gpu_link = None
            if "gpu_link" in t:
                rule = self.link(t["gpu_link"], f"{key}.gpu_link", set())
                if isinstance(rule, NoLink):
                    raise self.error(f"{key}.gpu_link", "a node's GPUs always have a link; leave it out for PCIe")
                gpu_link = rule
            out.append(NodeSpec(name=name, device=device.name, region=region, memory_gb=memory, host=host,
                                gpu_link=gpu_link))
        return tuple(out)

    def link(self, value: object, key: str, extra: set[str]) -> Rule:
        if isinstance(value, Mapping) and "none" in value:
            t = self.table(value, key, {"none"} | extra, {"none"} | extra)
            if t["none"] is not True:
                raise self.error(f"{key}.none", f"must be true (leave it out for a link), not {t['none']!r}")
            return NO_LINK
        t = self.table(value, key, _LINK_KEYS | extra, {"bandwidth_mbps", "latency_ms"} | extra)
        bandwidth = self.positive(t["bandwidth_mbps"], f"{key}.bandwidth_mbps")
        latency = self.number(t["latency_ms"], f"{key}.latency_ms")
        if latency < 0:
            raise self.error(f"{key}.latency_ms", f"must be >= 0, not {t['latency_ms']}")
        loss = self.number(t.get("loss", 0.0), f"{key}.loss")
        if not 0 <= loss < 1:
            raise self.error(f"{key}.loss", f"must be in [0, 1), not {t['loss']}")
        return LinkSpec(bandwidth_mbps=bandwidth, latency_ms=latency, loss=loss)

    def pairs(self, value: object, key: str, known: set[str], what: str,
              allow_same: bool) -> dict[frozenset[str], Rule]:
        out: dict[frozenset[str], Rule] = {}
        where: dict[frozenset[str], int] = {}
        for i, entry in enumerate(self.array_of_tables(value, key)):
            k = f"{key}[{i}]"
            link = self.link(entry, k, {"a", "b"})
            ends = []
            for side in ("a", "b"):
                end = self.string(entry[side], f"{k}.{side}")
                if end not in known:
                    raise self.error(f"{k}.{side}",
                                     f"unknown {what} {end!r}; known: {', '.join(sorted(known))}")
                ends.append(end)
            if ends[0] == ends[1] and not allow_same:
                raise self.error(k, f"a link needs two different endpoints, not {ends[0]!r} twice")
            pair = frozenset(ends)
            if pair in out:
                raise self.error(k, f"duplicate link {ends[0]}-{ends[1]} (also {key}[{where[pair]}])")
            out[pair] = link
            where[pair] = i
        return out


    def directed(self, value: object, key: str, known: set[str]) -> dict[tuple[str, str], Rule]:
        out: dict[tuple[str, str], Rule] = {}
        where: dict[tuple[str, str], int] = {}
        for i, entry in enumerate(self.array_of_tables(value, key)):
            k = f"{key}[{i}]"
            link = self.link(entry, k, {"from", "to"})
            ends = []
            for side in ("from", "to"):
                end = self.string(entry[side], f"{k}.{side}")
                if end not in known:
                    raise self.error(f"{k}.{side}", f"unknown node {end!r}; known: {', '.join(sorted(known))}")
                ends.append(end)
            edge = (ends[0], ends[1])
            if edge[0] == edge[1]:
                raise self.error(k, f"a link needs two different endpoints, not {edge[0]!r} twice")
            if edge in out:
                raise self.error(k, f"duplicate link {edge[0]}->{edge[1]} (also {key}[{where[edge]}])")
            out[edge] = link
            where[edge] = i
        return out


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _kind(value: object) -> str:
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return {bool: "a boolean", int: "an integer", float: "a float", str: "a string"}.get(
        type(value), type(value).__name__)
