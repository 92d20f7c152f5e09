"""Where profile tables come from: Helix's measurements, a file, the roofline cost model, or a live node.

- `helix_profile_table(model)`: the per-layer step times the Helix authors measured with vLLM (shipped in
  `hetnode/planner/data/helix/`, Apache-2.0), for llama-30b and llama-70b on a100, l4, t4, v100, 2xl4, 2xt4 and
  4xt4, with the most layers per node from the table that comes with them.
- `load_profile_table(path, model)`: a TOML or JSON file (docs/planner.md) with, per device type or per node,
  `max_layers` and either the throughputs T_1..T_k directly or prompt/decode step-time curves to compute them
  from. `save_profile_table` writes one back (a table measured on the testnet, say) so that it loads again.
- `roofline_profile_table(cluster, model)`: one roofline profile per device type of the cluster, from the
  papers' GPU tables (`planner.costmodel`); a multi-GPU device pays its tensor-parallel all-reduces over the
  node's GPU link (`profile.roofline_profile`).
- `measured_profile(...)`: a roofline over a live node's measured matmul rate and memory bandwidth.
- `profile_table_for(cluster, model, source)`: picks one of these by name ("auto", "helix", "roofline") or path;
  optionally with T_j of a node inside that cluster's pipelines (`in_pipelines`, `profile.pipeline_throughputs`).

`kv_share` is the configurable share of a device's memory kept for KV; it decides how many layers a device
holds (`profile.max_layers_for`). Helix's table was made with about half kept for KV (kv_share = 0.5); another
share scales its counts by (1 - kv_share) / 0.5.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import replace
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import tomli_w

from hetnode.errors import ConfigError
from hetnode.planner.cluster import PCIE_LINK, ClusterSpec
from hetnode.planner.costmodel import COMPUTE_EFFICIENCY, MEMORY_EFFICIENCY
from hetnode.planner.devices import DeviceSpec, parse_device
from hetnode.planner.model import ALIASES, PRESETS, ModelSpec
from hetnode.planner.node_limits import by_layers, helix_capacities
from hetnode.planner.profile import (
    Curve,
    DeviceProfile,
    ProfileTable,
    Workload,
    pipeline_throughputs,
    roofline_profile,
    with_throughput,
)
from hetnode.planner.splitwise_profiles import SPLITWISE_DEVICES, splitwise_model_key, splitwise_profile_table

# -- Helix's measured profiles --------------------------------------------------------------------------------

HELIX_MODELS = {"llama-30b": "llama1_30b", "llama-70b": "llama2_70b"}  # our preset -> the artifact's directory
HELIX_GPUS = {"a100": "a100", "l4": "l4", "t4": "t4", "v100": "v100", "l4x2": "2xl4", "t4x2": "2xt4",
              "t4x4": "4xt4"}  # the artifact's directory -> our device name
# The most layers a node holds with about half its memory kept for KV (the table shipped with the profiles).
HELIX_MAX_LAYERS: dict[str, dict[str, int]] = {
    "llama-30b": {"a100": 18, "l4": 11, "2xl4": 22, "t4": 7, "2xt4": 15, "4xt4": 30, "v100": 7},
    "llama-70b": {"a100": 12, "l4": 7, "2xl4": 14, "t4": 4, "2xt4": 9, "4xt4": 18, "v100": 4},
}
HELIX_KV_SHARE = 0.5
HELIX_SOURCE = "Helix-ASPLOS25 artifact (Mei et al., ASPLOS 2025; Apache-2.0), measured with vLLM"
_SHAPE_FIELDS = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                 "bytes_per_param")


def helix_model_key(model: ModelSpec) -> str | None:
    """"llama-30b" or "llama-70b" when `model` is the preset Helix measured, else None."""
    preset = PRESETS.get(ALIASES.get(model.name.lower(), model.name.lower()))
    if preset is None or preset.name not in HELIX_MODELS:
        return None
    if any(getattr(model, f) != getattr(preset, f) for f in _SHAPE_FIELDS):
        return None
    return preset.name


def helix_devices(model: ModelSpec) -> list[str]:
    """The device types Helix measured for `model` (empty for a model it did not measure)."""
    key = helix_model_key(model)
    return sorted(HELIX_MAX_LAYERS[key]) if key else []


def _read_curve(model_dir: str, gpu_dir: str, name: str) -> Curve:
    text = (resources.files("hetnode.planner") / "data" / "helix" / model_dir / gpu_dir / name).read_text()
    points = []
    for line in text.splitlines():
        if line.strip():
            x, ms = line.split(",")
            points.append((float(x), float(ms) / 1e3))
    return tuple(points)


@cache
def _helix_curves(model_key: str, device: str) -> tuple[Curve, Curve]:
    gpu_dir = next(d for d, name in HELIX_GPUS.items() if name == device)
    model_dir = HELIX_MODELS[model_key]
    return _read_curve(model_dir, gpu_dir, "prompt_bs2time.csv"), _read_curve(model_dir, gpu_dir, "decode_bs2time.csv")


def helix_max_layers(model_key: str, device: str, kv_share: float = HELIX_KV_SHARE) -> int:
    """The table's count at kv_share 0.5; scaled by the weight share (1 - kv_share) / 0.5 otherwise."""
    table = HELIX_MAX_LAYERS[model_key][device]
    if kv_share == HELIX_KV_SHARE:
        return table
    return min(PRESETS[model_key].num_layers, int(table * (1 - kv_share) / (1 - HELIX_KV_SHARE) + 1e-9))


def helix_profile(model: ModelSpec, device: str, *, kv_share: float = HELIX_KV_SHARE,
                  workload: Workload | None = None) -> DeviceProfile:
    key = helix_model_key(model)
    if key is None:
        raise ConfigError(f"Helix measured only {', '.join(sorted(HELIX_MODELS))}, not {model.name!r}")
    spec = parse_device(device)
    if spec.name not in HELIX_MAX_LAYERS[key]:
        raise ConfigError(f"Helix has no profile of {device!r}; it measured {', '.join(helix_devices(model))}")
    _check_kv_share(kv_share)
    prompt, decode = _helix_curves(key, spec.name)
    gpu_dir = next(d for d, name in HELIX_GPUS.items() if name == spec.name)
    base = DeviceProfile(name=spec.name, memory_bytes=spec.memory_bytes,
                         max_layers=helix_max_layers(key, spec.name, kv_share), prompt_curve=prompt,
                         decode_curve=decode, source=f"{HELIX_SOURCE}: {spec.name}, {key}",
                         limits=by_layers(helix_capacities(), HELIX_MODELS[key], gpu_dir))
    return with_throughput(base, model, workload or Workload())


def helix_profile_table(model: ModelSpec, *, kv_share: float = HELIX_KV_SHARE,
                        workload: Workload | None = None) -> ProfileTable:
    """Every device type Helix measured for llama-30b or llama-70b; ConfigError for any other model."""
    key = helix_model_key(model)
    if key is None:
        raise ConfigError(f"Helix's measured profiles cover {', '.join(sorted(HELIX_MODELS))} only, not "
                          f"{model.name!r}; use the roofline profiles or a profile-table file", key="--profile")
    profiles = {d: helix_profile(model, d, kv_share=kv_share, workload=workload) for d in helix_devices(model)}
    return ProfileTable(model=model.name, profiles=profiles, source=f"helix ({HELIX_SOURCE})")


# -- roofline and live nodes ----------------------------------------------------------------------------------


def _check_kv_share(kv_share: float) -> None:
    if not 0 <= kv_share < 1:
        raise ConfigError(f"the KV share of memory must be in [0, 1), not {kv_share}", key="--kv-share")


def roofline_profile_table(cluster: ClusterSpec, model: ModelSpec, *, kv_share: float = 0.5,
                           workload: Workload | None = None) -> ProfileTable:
    """One roofline profile per device type in the cluster, plus one per node whose memory_gb differs or whose
    GPUs have a link of their own (`NodeSpec.gpu_link`; a multi-GPU device's all-reduces run over it,
    `profile.roofline_profile`)."""
    _check_kv_share(kv_share)
    profiles: dict[str, DeviceProfile] = {}
    for node in cluster.nodes:
        spec = node.device_spec
        if spec.name not in profiles:
            profiles[spec.name] = roofline_profile(spec, model, kv_share=kv_share, workload=workload)
        memory = int(node.memory_gb * 2**30)
        own_link = spec.count > 1 and node.gpu_link not in (None, PCIE_LINK)
        if memory != spec.memory_bytes or own_link:
            profiles[node.name] = replace(
                roofline_profile(spec, model, kv_share=kv_share, workload=workload, memory_bytes=memory,
                                 gpu_link=node.gpu_link),
                name=node.name)
    return ProfileTable(model=model.name, profiles=profiles,
                        source="roofline (papers' GPU tables, planner.costmodel)")


def measured_profile(name: str, matmul_tflops: float, mem_bandwidth_gbps: float, memory_bytes: int,
                     model: ModelSpec, kv_share: float = 0.5, *, workload: Workload | None = None,
                     achieved: bool = True) -> DeviceProfile:
    """A roofline over a live node's own numbers (HardwareProfile.matmul_tflops, .mem_bandwidth_gbps, ...).

    With achieved=True the numbers are rates the node measured (a large matmul, a large copy), which serving
    kernels reach about as well: the roofline runs at exactly these rates. With achieved=False they are peak
    figures from a data sheet (an emulated node reports its table's numbers), and the roofline applies the
    cost model's efficiency shares to them, as for the papers' tables."""
    for key, value in (("matmul_tflops", matmul_tflops), ("mem_bandwidth_gbps", mem_bandwidth_gbps),
                       ("memory_bytes", memory_bytes)):
        if isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"node {name}: a measured profile needs a positive {key}, not {value!r}", key=key)
    _check_kv_share(kv_share)
    scale_c, scale_m = (1 / COMPUTE_EFFICIENCY, 1 / MEMORY_EFFICIENCY) if achieved else (1.0, 1.0)
    spec = DeviceSpec(name=name, kind=name, count=1, fp16_tflops=matmul_tflops * scale_c,
                      memory_gb=memory_bytes / 2**30, mem_bandwidth_gbps=mem_bandwidth_gbps * scale_m,
                      source="measured on the node" if achieved else "the node's reported peak figures")
    return roofline_profile(spec, model, kv_share=kv_share, workload=workload, memory_bytes=memory_bytes)


# -- choosing a source ----------------------------------------------------------------------------------------

SOURCES = ("auto", "helix", "roofline", "splitwise")


def in_pipelines(table: ProfileTable, cluster: ClusterSpec, model: ModelSpec,
                 workload: Workload | None = None) -> ProfileTable:
    """The table with T_j of a node in this cluster's pipelines rather than alone (`pipeline_throughputs`)."""
    counts: dict[str, int] = {}
    for node in cluster.nodes:
        key = node.name if node.name in table.profiles else node.device
        counts[key] = counts.get(key, 0) + 1
    profiles = pipeline_throughputs(table.profiles, counts, model, workload or Workload())
    return ProfileTable(model=table.model, profiles=profiles, source=table.source)


def kv_share_for(method: str, given: float | None = None) -> float:
    """The share of device memory a profile table keeps for KV when planning with `method`: `given`, else
    ThunderServe's own (`ThunderServeOptions.kv_reserve`: the table that prices its plan must assume what its
    layouts leave), else Helix's half (Table 1's rule)."""
    if given is not None:
        return given
    if method == "thunderserve":
        from hetnode.planner.thunderserve.settings import ThunderServeOptions

        return ThunderServeOptions().kv_reserve
    return 0.5


def profile_table_for(cluster: ClusterSpec, model: ModelSpec, source: str = "auto", *, kv_share: float = 0.5,
                      workload: Workload | None = None, in_pipeline: bool = False) -> ProfileTable:
    """The profile table `source` names: "roofline", "helix", "splitwise", a file path, or "auto".

    "auto" is helix when the model is Helix's llama-30b or llama-70b, every device type in the cluster has a
    Helix profile and no node overrides its memory; splitwise likewise for Llama-2 70B on DGX-A100/H100
    machines (`8xa100-80g`, `8xh100`); roofline otherwise. The table must cover every node. Its
    T_j are a node's alone; in_pipeline=True gives a node's inside this cluster's pipelines (`in_pipelines`),
    which predicts what shallow plans serve better but led the planner to deeper plans that served less in
    scripts/reproduce_helix.py (docs/reproducing-helix.md), so it is not the default."""
    _check_kv_share(kv_share)
    if source == "auto":
        stock = all(int(n.memory_gb * 2**30) == n.device_spec.memory_bytes for n in cluster.nodes)
        devices = {n.device for n in cluster.nodes}
        source = "roofline"
        for name, measured in (("helix", set(helix_devices(model))),
                               ("splitwise", set(SPLITWISE_DEVICES.values()) if splitwise_model_key(model) else set())):
            if measured and stock and devices <= measured:
                source = name
    if source == "splitwise":
        table = splitwise_profile_table(model, kv_share=kv_share, workload=workload)
    elif source == "roofline":
        table = roofline_profile_table(cluster, model, kv_share=kv_share, workload=workload)
    elif source == "helix":
        table = helix_profile_table(model, kv_share=kv_share, workload=workload)
    else:
        table = load_profile_table(source, model)
    missing = sorted({n.device for n in cluster.nodes if n.name not in table.profiles
                      and n.device not in table.profiles})
    if missing:
        raise ConfigError(f"the profile table ({table.source}) has no entry for device types "
                          f"{', '.join(missing)} of cluster {cluster.name}; it has {', '.join(sorted(table.profiles))}",
                          file=source if source not in SOURCES else None)
    return in_pipelines(table, cluster, model, workload) if in_pipeline else table


# -- profile-table files --------------------------------------------------------------------------------------

_NAME = re.compile(r"[a-z0-9_-]{1,64}")
_ENTRY_KEYS = {"max_layers", "throughput", "prompt_ms", "decode_ms", "decode_context_ms", "memory_gb", "source"}
_WORKLOAD_KEYS = {"input_len", "output_len", "max_batch"}


def load_profile_table(path: str | Path, model: ModelSpec) -> ProfileTable:
    """A profile-table file (TOML, or JSON when the name ends in .json) for `model`."""
    source = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read profile table: {exc.strerror or exc}", file=source) from exc
    is_json = source.endswith(".json")
    try:
        data = json.loads(raw) if is_json else tomllib.loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"invalid {'JSON' if is_json else 'TOML'}: {exc}", file=source) from exc
    return parse_profile_table(data, model, source)


def parse_profile_table(data: object, model: ModelSpec, source: str) -> ProfileTable:
    """Validate a decoded profile-table file; `source` names it in errors."""
    return _Parser(source, model).table(data)


def profile_table_to_dict(table: ProfileTable) -> dict[str, Any]:
    """The table in the file format; `parse_profile_table(profile_table_to_dict(t), model, ...)` gives it back.

    Every entry keeps its throughputs (so T_j come back exactly) and its curves (in ms, to float precision)."""
    devices: dict[str, Any] = {}
    nodes: dict[str, Any] = {}
    for key in sorted(table.profiles):
        prof = table.profiles[key]
        entry: dict[str, Any] = {
            "max_layers": prof.max_layers,
            "memory_gb": prof.memory_bytes / 2**30,
            "throughput": list(prof.throughput),
            "prompt_ms": [[x, s * 1e3] for x, s in prof.prompt_curve],
            "decode_ms": [[x, s * 1e3] for x, s in prof.decode_curve],
        }
        if prof.decode_context_s:
            entry["decode_context_ms"] = prof.decode_context_s * 1e3
        if prof.source:
            entry["source"] = prof.source
        (devices if _is_device(key) else nodes)[key] = entry
    out: dict[str, Any] = {"model": table.model}
    if table.source:
        out["description"] = table.source
    if devices:
        out["devices"] = devices
    if nodes:
        out["nodes"] = nodes
    return out


def save_profile_table(table: ProfileTable, path: str | Path) -> None:
    """Write the table as TOML, or JSON when the name ends in .json."""
    data = profile_table_to_dict(table)
    text = json.dumps(data, indent=2) + "\n" if str(path).endswith(".json") else tomli_w.dumps(data)
    Path(path).write_text(text)


def _is_device(name: str) -> bool:
    try:
        return parse_device(name).name == name
    except ConfigError:
        return False


class _Parser:
    def __init__(self, source: str, model: ModelSpec) -> None:
        self.source = source
        self.model = model

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError(problem, file=self.source, key=key or None)

    def mapping(self, value: object, key: str, allowed: set[str], required: set[str]) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise self.error(key, f"must be a table, not {_kind(value)}")
        for k in value:
            if k not in allowed:
                raise self.error(_join(key, k), f"unknown key (allowed here: {', '.join(sorted(allowed))})")
        for k in sorted(required):
            if k not in value:
                raise self.error(_join(key, k), "missing required key")
        return value

    def string(self, value: object, key: str) -> str:
        if not isinstance(value, str):
            raise self.error(key, f"must be a string, not {_kind(value)}")
        return value

    def number(self, value: object, key: str, *, positive: bool = False) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(key, f"must be a number, not {_kind(value)}")
        if not math.isfinite(value):
            raise self.error(key, f"must be finite, not {value}")
        if value < 0 or (positive and value == 0):
            raise self.error(key, f"must be {'> 0' if positive else '>= 0'}, not {value}")
        return float(value)

    def integer(self, value: object, key: str, low: int, high: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"must be an integer, not {_kind(value)}")
        if not low <= value <= high:
            raise self.error(key, f"must be in {low}..{high}, not {value}")
        return value

    def table(self, data: object) -> ProfileTable:
        top = self.mapping(data, "", {"model", "description", "workload", "devices", "nodes"}, set())
        if "model" in top:
            name = self.string(top["model"], "model")
            canonical = ALIASES.get(name.lower(), name.lower())
            if canonical != self.model.name.lower():
                raise self.error("model", f"the table is for {name!r}, not for {self.model.name!r}")
        description = self.string(top.get("description", ""), "description")
        workload = self.workload(top["workload"]) if "workload" in top else Workload()
        profiles: dict[str, DeviceProfile] = {}
        for section in ("devices", "nodes"):
            if section not in top:
                continue
            entries = top[section]
            if not isinstance(entries, Mapping):
                raise self.error(section, f"must be a table of entries ([{section}.NAME]), not {_kind(entries)}")
            for name, entry in entries.items():
                key = f"{section}.{name}"
                if section == "devices":
                    try:
                        spec: DeviceSpec | None = parse_device(name)
                    except ConfigError as exc:
                        raise self.error(key, exc.problem) from None
                    assert spec is not None
                    canonical = spec.name
                else:
                    if not _NAME.fullmatch(name):
                        raise self.error(key, f"{name!r}: a node name is 1-64 of lowercase letters, digits, "
                                              "'-' and '_'")
                    spec, canonical = None, name
                if canonical in profiles:
                    raise self.error(key, f"a second entry for {canonical!r}")
                profiles[canonical] = self.entry(entry, key, canonical, spec, workload)
        if not profiles:
            raise self.error("", "a profile table needs at least one entry under [devices.NAME] or [nodes.NAME]")
        return ProfileTable(model=self.model.name, profiles=profiles, source=description or self.source)

    def workload(self, value: object) -> Workload:
        t = self.mapping(value, "workload", _WORKLOAD_KEYS, set())
        d = Workload()
        return Workload(
            input_len=self.integer(t.get("input_len", d.input_len), "workload.input_len", 1, 10**7),
            output_len=self.integer(t.get("output_len", d.output_len), "workload.output_len", 0, 10**7),
            max_batch=self.integer(t.get("max_batch", d.max_batch), "workload.max_batch", 1, 10**6))

    def entry(self, value: object, key: str, name: str, spec: DeviceSpec | None,
              workload: Workload) -> DeviceProfile:
        allowed = _ENTRY_KEYS | ({"device"} if spec is None else set())
        t = self.mapping(value, key, allowed, {"max_layers"})
        k = self.integer(t["max_layers"], f"{key}.max_layers", 1, self.model.num_layers)
        if spec is None and "device" in t:
            try:
                spec = parse_device(self.string(t["device"], f"{key}.device"))
            except ConfigError as exc:
                raise self.error(f"{key}.device", exc.problem) from None
        if "memory_gb" in t:
            memory = int(self.number(t["memory_gb"], f"{key}.memory_gb", positive=True) * 2**30)
        elif spec is not None:
            memory = spec.memory_bytes
        else:
            raise self.error(f"{key}.memory_gb", "missing: a node entry needs memory_gb or a device to take it from")
        has_curves = "prompt_ms" in t or "decode_ms" in t
        if has_curves:
            for part in ("prompt_ms", "decode_ms"):
                if part not in t:
                    raise self.error(f"{key}.{part}", "missing: curves come as a prompt_ms and decode_ms pair")
        elif "throughput" not in t:
            raise self.error(key, "needs throughput (T_1..T_k, tokens/s) or prompt_ms and decode_ms curves")
        source = self.string(t.get("source", ""), f"{key}.source")
        throughput: tuple[float, ...] = ()
        if "throughput" in t:
            throughput = self.throughput(t["throughput"], f"{key}.throughput", k)
        if has_curves:
            prompt = self.curve(t["prompt_ms"], f"{key}.prompt_ms")
            decode = self.curve(t["decode_ms"], f"{key}.decode_ms")
        else:
            # Throughput only: step times linear in tokens at the node's rate when full (T_k over k layers), so
            # that a simulator replaying the table sees the same capacity as the planner.
            per_token_layer = 1.0 / (k * throughput[-1])
            prompt = decode = ((1.0, per_token_layer),)
        context = self.number(t.get("decode_context_ms", 0.0), f"{key}.decode_context_ms") / 1e3
        prof = DeviceProfile(name=name, memory_bytes=memory, max_layers=k, prompt_curve=prompt, decode_curve=decode,
                             decode_context_s=context, throughput=throughput, source=source or self.source,
                             throughput_given=bool(throughput))
        return prof if throughput else with_throughput(prof, self.model, workload)

    def throughput(self, value: object, key: str, k: int) -> tuple[float, ...]:
        if not isinstance(value, list):
            raise self.error(key, f"must be an array of T_1..T_k in tokens/s, not {_kind(value)}")
        if len(value) != k:
            raise self.error(key, f"has {len(value)} values; max_layers = {k} needs exactly {k} (T_1..T_{k})")
        return tuple(self.number(v, f"{key}[{i}]", positive=True) for i, v in enumerate(value))

    def curve(self, value: object, key: str) -> Curve:
        if not isinstance(value, list) or not value:
            raise self.error(key, f"must be a non-empty array of [x, ms] pairs, not {_kind(value)}")
        points: list[tuple[float, float]] = []
        for i, p in enumerate(value):
            if not isinstance(p, list) or len(p) != 2:
                raise self.error(f"{key}[{i}]", f"must be an [x, ms] pair, not {_kind(p)}")
            x = self.number(p[0], f"{key}[{i}][0]")
            ms = self.number(p[1], f"{key}[{i}][1]")
            if points and x <= points[-1][0]:
                raise self.error(f"{key}[{i}][0]", f"x must increase: {x:g} after {points[-1][0]:g}")
            points.append((x, ms / 1e3))
        if points[-1][1] <= 0:
            raise self.error(key, "the last point's time must be > 0")
        return tuple(points)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _kind(value: object) -> str:
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return {bool: "a boolean", int: "an integer", float: "a float", str: "a string"}.get(
        type(value), type(value).__name__)
