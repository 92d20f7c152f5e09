"""Measured node limits: the shipped vllm_capacity.csv, its parser's errors, and how profiles carry them."""

from __future__ import annotations

import pytest

from hetnode.errors import ConfigError
from hetnode.planner.model import model_spec
from hetnode.planner.node_limits import (
    NodeLimits,
    by_layers,
    from_pool,
    helix_capacities,
    limits_for,
    parse_capacity_csv,
)
from hetnode.planner.profile import kv_tokens, node_kv_tokens
from hetnode.planner.profile_sources import helix_profile

HEADER = "model,gpu,num_layers,vllm_num_blocks,prompt_max_requests,decode_max_tokens\n"


def test_helix_profiles_carry_vllms_blocks_and_caps() -> None:
    model = model_spec("llama-70b")
    t4 = helix_profile(model, "t4")
    # The artifact's row: llama2_70b,t4,4 layers -> 17566 blocks of 16 tokens, 1 prompt and 300 decodes a step.
    assert t4.limits[3] == NodeLimits(17566 * 16, 1, 300)
    assert node_kv_tokens(t4, model, 4) == 17566 * 16
    # Measured is smaller than memory minus weights, and asking for the estimate gives the estimate.
    assert node_kv_tokens(t4, model, 4, measured=False) == kv_tokens(t4.memory_bytes, model, 4) > 17566 * 16
    # Past the measured layer counts the estimate stands in.
    assert node_kv_tokens(t4, model, 9) == kv_tokens(t4.memory_bytes, model, 9)


def test_past_the_table_the_line_gives_what_helix_gave_its_separate_pipelines() -> None:
    model = model_spec("llama-70b")
    a100, t4 = helix_profile(model, "a100"), helix_profile(model, "t4")
    # Helix's cluster files for its 70B separate pipelines: an A100 holding 20 layers 35,168-35,200 token-layer
    # slots (geo, hetero), a T4 holding 6 layers 216,960 (single); both with the last measured row's caps.
    assert limits_for(a100.limits, 20, "line") == NodeLimits(1755, 3, 300)
    assert 35_100 <= 1755 * 20 <= 35_200
    assert limits_for(t4.limits, 6, "line") == NodeLimits(216_960 // 6, 1, 300)
    # Inside the table the measured row either way; past it, nothing unless the line is asked for.
    assert limits_for(a100.limits, 12, "line") == limits_for(a100.limits, 12) == a100.limits[11]
    assert limits_for(a100.limits, 20) is None
    # A pool the line leaves empty is empty, not negative.
    assert limits_for(t4.limits, 8, "line") == NodeLimits(0, 1, 300)
    # The estimate is 60 times the line for the A100: memory minus weights leaves out vLLM's reserve.
    assert node_kv_tokens(a100, model, 20) == kv_tokens(a100.memory_bytes, model, 20) > 60 * 1755
    assert node_kv_tokens(a100, model, 20, past="line") == 1755


def test_the_shipped_table_covers_every_helix_gpu_from_one_layer() -> None:
    table = helix_capacities()
    for model in ("llama1_30b", "llama2_70b"):
        for gpu in ("a100", "l4", "l4x2", "t4", "t4x2", "t4x4", "v100"):
            assert len(by_layers(table, model, gpu)) >= 4


def test_a_live_nodes_pool_is_its_used_and_free_blocks() -> None:
    assert from_pool(10, 30, 16) == NodeLimits(640)
    with pytest.raises(ValueError):
        from_pool(-1, 3, 16)


@pytest.mark.parametrize("text, problem", [
    ("model,gpu,num_layers\n", "missing column(s) vllm_num_blocks"),
    (HEADER + "m,g,1,abc,1,1\n", "line 2: vllm_num_blocks is 'abc'"),
    (HEADER + "m,g,1,100,0,1\n", "line 2: prompt_max_requests is 0, out of range"),
    (HEADER + "m,g,1,100,1,1\nm,g,1,100,1,1\n", "line 3: a second row"),
    (HEADER, "no rows"),
])
def test_a_bad_capacity_csv_names_the_file_line_and_column(text: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=r"caps\.csv") as info:
        parse_capacity_csv(text, "caps.csv")
    assert problem in str(info.value)
