"""Splitwise's measured performance model as profiles: Llama-2 70B on a DGX-A100, a DGX-H100 and a DGX-H100
with its GPUs power-capped to 50% (TP 8).

The Splitwise authors timed whole prompt phases and decode iterations on 8-GPU machines (`data/splitwise/`, MIT;
its README gives the columns). A profile here is per layer, as Helix's are, so each measured time is divided by
the model's 80 layers:

- Prompt curve: (tokens in the prompt batch, seconds per layer), from the batches of one prompt of 128 to 8,192
  tokens and of up to 64 prompts of 512; points of the same token count are averaged. Below 128 tokens nothing
  was measured, and a curve run linearly to the origin would make a 2-token prompt cost 1 ms on a DGX-A100, far
  under any forward pass of a 70B model: a prompt step still reads every weight, as a decode step does. So the
  curve starts at 1 token with the machine's one-sequence decode step (the decode model below at one token of
  context: 45 ms on a DGX-A100, 30 ms on a DGX-H100) and runs from there to the measured 128-token prompt. The
  one curve is what every user of a prompt's time sees: the simulator's steps, the SLOs' reference
  (`provision.alone`) and the planner.
- Decode: the time of an iteration grows with the batch and with the context the batch attends to. The rows
  with one sequence and longer and longer generations (128 to 8,192 tokens after a 512-token prompt) give the
  context term: a least-squares line of the iteration time against the generation's mean context is
  `decode_context_s` per token of context; the rows with 1 to 64 sequences of a 512-token prompt and 128
  generated tokens, less that term at their mean context (576 tokens each), give the batch curve.

Five repetitions of every point are averaged. Memory and the most layers a machine holds come from the device
table (`8xa100-80g`, `8xh100`, `8xh100-pcap`: 640 GB each), as for roofline profiles.
"""

from __future__ import annotations

import csv
import io
import statistics
from collections import defaultdict
from functools import cache
from importlib import resources

from hetnode.errors import ConfigError
from hetnode.planner.devices import parse_device
from hetnode.planner.model import ALIASES, PRESETS, ModelSpec
from hetnode.planner.profile import Curve, DeviceProfile, ProfileTable, Workload, max_layers_for, with_throughput

SPLITWISE_SOURCE = "Splitwise's performance model (Patel et al., ISCA 2024; splitwise-sim, MIT), measured on DGX"
# The machines measured, as hetnode devices: the model's hardware column -> device name.
SPLITWISE_DEVICES = {"a100-80gb": "8xa100-80g", "h100-80gb": "8xh100", "h100-80gb-pcap": "8xh100-pcap"}
SPLITWISE_MODEL = "llama-70b"  # hetnode's preset for the table's llama2-70b
_PROMPT_OF_DECODE_ROWS = 512  # the prompt before the decode rows' generations
_BATCH_ROWS_GENERATED = 128  # generated tokens in the rows that vary the batch
_SHAPE_FIELDS = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                 "bytes_per_param")


@cache
def _rows() -> tuple[tuple[str, int, int, int, float, float], ...]:
    """(hardware, prompt_size, batch_size, token_size, prompt_ms, token_ms) of every measured row."""
    text = (resources.files("hetnode.planner") / "data" / "splitwise" / "perf_model.csv").read_text()
    out = []
    for row in csv.DictReader(io.StringIO(text)):
        out.append((row["hardware"], int(row["prompt_size"]), int(row["batch_size"]), int(row["token_size"]),
                    float(row["prompt_time"]), float(row["token_time"])))
    return tuple(out)


def _mean_by(points: list[tuple[float, float]]) -> Curve:
    by: dict[float, list[float]] = defaultdict(list)
    for x, y in points:
        by[x].append(y)
    return tuple((x, statistics.fmean(ys)) for x, ys in sorted(by.items()))


@cache
def splitwise_curves(hardware: str, num_layers: int) -> tuple[Curve, Curve, float]:
    """(prompt curve, decode batch curve, decode_context_s) per layer for one measured machine."""
    rows = [r for r in _rows() if r[0] == hardware]
    if not rows:
        raise ConfigError(f"Splitwise's model has no rows for {hardware!r}")
    prompt = _mean_by([(p * b, ms / 1e3 / num_layers) for _, p, b, _, ms, _ in rows])
    # The context term: one sequence, a 512-token prompt, generations of 128 to 8,192 tokens.
    lengths = [(p + t / 2, ms / 1e3 / num_layers) for _, p, b, t, _, ms in rows
               if b == 1 and p == _PROMPT_OF_DECODE_ROWS]
    slope = max(0.0, statistics.linear_regression([x for x, _ in lengths], [y for _, y in lengths]).slope) \
        if len({x for x, _ in lengths}) > 1 else 0.0
    mean_context = _PROMPT_OF_DECODE_ROWS + _BATCH_ROWS_GENERATED / 2
    decode = _mean_by([(b, max(1e-9, ms / 1e3 / num_layers - slope * b * mean_context))
                       for _, p, b, t, _, ms in rows
                       if p == _PROMPT_OF_DECODE_ROWS and t == _BATCH_ROWS_GENERATED])
    # The floor (module docstring): a 1-token prompt costs what a one-sequence decode step at one token of
    # context does, so no prompt is ever priced under a forward pass.
    one = [(x, y) for x, y in decode if x == 1]
    if one and prompt[0][0] > 1:
        prompt = ((1.0, one[0][1] + slope), *prompt)
    return prompt, decode, slope


def splitwise_model_key(model: ModelSpec) -> str | None:
    """"llama-70b" when `model` is the preset Splitwise measured (Llama-2 70B), else None."""
    preset = PRESETS.get(ALIASES.get(model.name.lower(), model.name.lower()))
    if preset is None or preset.name != SPLITWISE_MODEL:
        return None
    if any(getattr(model, f) != getattr(preset, f) for f in _SHAPE_FIELDS):
        return None
    return preset.name


def splitwise_profile_table(model: ModelSpec, *, kv_share: float = 0.5,
                            workload: Workload | None = None) -> ProfileTable:
    """Both measured machines for Llama-2 70B; ConfigError for any other model."""
    if splitwise_model_key(model) is None:
        raise ConfigError(f"Splitwise's performance model covers {SPLITWISE_MODEL} only, not {model.name!r}; "
                          "use the roofline profiles or a profile-table file", key="--profile")
    profiles = {}
    for hardware, device in SPLITWISE_DEVICES.items():
        spec = parse_device(device)
        prompt, decode, context = splitwise_curves(hardware, model.num_layers)
        base = DeviceProfile(name=spec.name, memory_bytes=spec.memory_bytes,
                             max_layers=max_layers_for(spec.memory_bytes, model, kv_share), prompt_curve=prompt,
                             decode_curve=decode, decode_context_s=context,
                             source=f"{SPLITWISE_SOURCE}: {hardware}, tensor parallel 8")
        profiles[spec.name] = with_throughput(base, model, workload or Workload())
    return ProfileTable(model=model.name, profiles=profiles, source=f"splitwise ({SPLITWISE_SOURCE})")
