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

Past the last measured layer count (`PAST_TABLE`): "estimate" leaves the node to the estimate and no step caps;
"line" follows the measured rows' own line. vLLM's pool is the memory its fraction leaves after the weights and
a fixed reserve, so the token-layer slots (pool tokens x layers held) fall by one layer's weights per layer held;
past the one-layer row the rows of `vllm_capacity.csv` lie on that line (LLaMA-2 70B on an A100: 8,391,014 -
417,795 x layers, every row within a block). It is what Helix's simulator gave its separate-pipelines baseline,
whose nodes hold more layers than the table: in its artifact's cluster files for 70B an A100 holding 20 layers
has 35,168-35,200 slots (the line: 35,100) and a T4 holding 6 has 216,960 (the line: the same), with the caps
of the last row (`allow_force_set` takes the settings of min(layers, max)). Memory minus weights gives that A100
2.1 million slots, 60 times the line: it leaves out the reserve, which is most of what 20 layers leave free.
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


PAST_TABLE = ("estimate", "line")


def limits_for(limits: Sequence[NodeLimits], layers: int, past: str = "estimate") -> NodeLimits | None:
    """The measured limits of a node holding `layers` layers; past the table, the line's (`past="line"`) or None."""
    if 1 <= layers <= len(limits):
        return limits[layers - 1]
    if past == "line" and layers > len(limits) >= 2:
        return along_line(limits, layers)
    return None


def along_line(limits: Sequence[NodeLimits], layers: int) -> NodeLimits:
    """The pool on the line through the measured rows' slots, and the last row's caps.

    The line runs from the two-layer row to the last: the one-layer row often sits off it (by up to 64,000 slots
    on LLaMA-2 70B's L4 and multi-GPU rows), and the others lie on it to within 1,500 blocks."""
    n = len(limits)
    a = 2 if n >= 3 else 1
    start, end = limits[a - 1].kv_tokens * a, limits[-1].kv_tokens * n  # token-layer slots at a and n layers
    slots = end - (start - end) / (n - a) * (layers - n)
    return NodeLimits(max(0, int(slots // layers)), limits[-1].max_prompts, limits[-1].max_decodes)
