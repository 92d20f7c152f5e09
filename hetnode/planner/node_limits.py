"""What one node can hold and run per step, measured rather than estimated: its real KV pool and its step caps.

`kv_tokens(memory, model, layers)` estimates a node's KV as the memory its weights leave. A real engine
allocates less (activations, the CUDA context, fragmentation): on Helix's clusters vLLM allocated 1.4-2.2x
fewer blocks. Where the real number is known it is a `NodeLimits`, per layer count held:

- Helix's profiles: `vllm_capacity.csv` (shipped in `data/helix/`, from the Helix artifact), the blocks vLLM
  allocated and the per-step caps Helix's simulator applies (`prompt_max_requests`, `decode_max_tokens`).
- A live node: the pool its engine allocated, as its Load reports it (`kv_blocks_used + kv_blocks_free` blocks of
  `kv_block_size` tokens), the number the coordinator's scheduler takes (`Deployment`, `set_capacity`):
  `from_pool`.

A profile carries them in `DeviceProfile.limits` (index: layers held - 1; empty where nothing was measured);
`limits_for` reads them; `profile.node_kv_tokens` picks the measured pool or the estimate. Pure: the CSV parser takes
text, not a path it opens.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources

from hetnode.errors import ConfigError

VLLM_BLOCK = 16  # tokens per vLLM block in the artifact's measurements
CAPACITY_COLUMNS = ("model", "gpu", "num_layers", "vllm_num_blocks", "prompt_max_requests", "decode_max_tokens")


@dataclass(frozen=True, slots=True)
class NodeLimits:
    """A node's measured KV pool (tokens, each a slot in every layer it holds) and step caps (None: none)."""

    kv_tokens: int
    max_prompts: int | None = None  # prompt items one step takes
    max_decodes: int | None = None  # decode items one step takes

    def __post_init__(self) -> None:
        if self.kv_tokens < 0:
            raise ValueError(f"kv_tokens must be >= 0, not {self.kv_tokens}")
        for cap in (self.max_prompts, self.max_decodes):
            if cap is not None and cap < 1:
                raise ValueError(f"a step cap must be >= 1 or None, not {cap}")


def from_pool(used_blocks: int, free_blocks: int, block_size: int) -> NodeLimits:
    """A live node's pool as its Load reports it (no step caps: the runtime's budget is in tokens)."""
    if used_blocks < 0 or free_blocks < 0 or block_size < 1:
        raise ValueError(f"bad pool: {used_blocks} used + {free_blocks} free blocks of {block_size} tokens")
    return NodeLimits((used_blocks + free_blocks) * block_size)


def parse_capacity_csv(text: str, source: str) -> dict[tuple[str, str, int], NodeLimits]:
    """(model, gpu, layers) -> limits, from `vllm_capacity.csv`'s text; ConfigError naming the line and column."""
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in CAPACITY_COLUMNS if c not in (reader.fieldnames or ())]
    if missing:
        raise ConfigError(f"missing column(s) {', '.join(missing)}; expected {','.join(CAPACITY_COLUMNS)}",
                          file=source)
    out: dict[tuple[str, str, int], NodeLimits] = {}
    for line, row in enumerate(reader, start=2):
        values: dict[str, int] = {}
        for column in CAPACITY_COLUMNS[2:]:
            raw = (row.get(column) or "").strip()
            try:
                values[column] = int(raw)
            except ValueError:
                raise ConfigError(f"line {line}: {column} is {raw!r}, not a whole number", file=source,
                                  key=column) from None
            if values[column] < (0 if column == "vllm_num_blocks" else 1):
                raise ConfigError(f"line {line}: {column} is {raw}, out of range", file=source, key=column)
        key = ((row["model"] or "").strip(), (row["gpu"] or "").strip(), values["num_layers"])
        if key in out:
            raise ConfigError(f"line {line}: a second row for {key[0]} on {key[1]} with {key[2]} layers",
                              file=source)
        out[key] = NodeLimits(values["vllm_num_blocks"] * VLLM_BLOCK, values["prompt_max_requests"],
                              values["decode_max_tokens"])
    if not out:
        raise ConfigError("no rows", file=source)
    return out


@cache
def helix_capacities() -> Mapping[tuple[str, str, int], NodeLimits]:
    """The shipped `data/helix/vllm_capacity.csv`, keyed by the artifact's model and GPU directory names."""
    path = resources.files("hetnode.planner") / "data" / "helix" / "vllm_capacity.csv"
    return parse_capacity_csv(path.read_text(), str(path))


def by_layers(table: Mapping[tuple[str, str, int], NodeLimits], model: str, gpu: str) -> tuple[NodeLimits, ...]:
    """The limits for 1, 2, ... layers of `model` on `gpu`, up to the first layer count the table lacks."""
    out: list[NodeLimits] = []
    while (model, gpu, len(out) + 1) in table:
        out.append(table[(model, gpu, len(out) + 1)])
    return tuple(out)


def limits_for(limits: Sequence[NodeLimits], layers: int) -> NodeLimits | None:
    """The measured limits of a node holding `layers` layers, or None where none were measured."""
    return limits[layers - 1] if 1 <= layers <= len(limits) else None
