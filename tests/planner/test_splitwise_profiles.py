"""Splitwise's measured performance model as per-layer profiles of a DGX-A100 and a DGX-H100."""

from __future__ import annotations

import csv
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from hetnode.errors import ConfigError
from hetnode.planner.cluster import parse_cluster
from hetnode.planner.model import PRESETS
from hetnode.planner.profile_sources import profile_table_for
from hetnode.planner.splitwise_profiles import splitwise_profile_table

LLAMA70 = PRESETS["llama-70b"]
DATA = Path(__file__).resolve().parents[2] / "hetnode" / "planner" / "data" / "splitwise" / "perf_model.csv"


def measured(hardware: str, prompt: int, batch: int, tokens: int, column: str) -> float:
    with DATA.open() as f:
        return statistics.fmean(float(r[column]) for r in csv.DictReader(f)
                                if (r["hardware"], int(r["prompt_size"]), int(r["batch_size"]),
                                    int(r["token_size"])) == (hardware, prompt, batch, tokens))


def test_the_curves_are_the_measured_times_per_layer() -> None:
    table = splitwise_profile_table(LLAMA70)
    a100, h100 = table.profiles["8xa100-80g"], table.profiles["8xh100"]
    # A prompt of 256 tokens alone is one measured point: its time over 80 layers. 2,048 tokens were measured
    # as one prompt and as four of 512: the curve takes their mean.
    assert a100.prefill_time(256, 80) == pytest.approx(measured("a100-80gb", 256, 1, 128, "prompt_time") / 1e3)
    both = (measured("a100-80gb", 2048, 1, 128, "prompt_time") + measured("a100-80gb", 512, 4, 128, "prompt_time"))
    assert a100.prefill_time(2048, 80) == pytest.approx(both / 2 / 1e3)
    # A decode iteration of 16 sequences after 512-token prompts, at the rows' own mean context.
    want = measured("h100-80gb", 512, 16, 128, "token_time") / 1e3
    assert h100.decode_time(16, 80, 16 * (512 + 64)) == pytest.approx(want, rel=1e-9)
    # The context term comes from longer generations: 8,192 tokens after 512 cost more per iteration.
    long = measured("a100-80gb", 512, 1, 8192, "token_time") / 1e3
    assert a100.decode_time(1, 80, 512 + 4096) == pytest.approx(long, rel=0.15)
    assert a100.decode_context_s > 0
    # The H100 machine is faster in both phases, by more in the compute-bound one (Splitwise Insight VII).
    prefill_gain = a100.prefill_time(4096, 80) / h100.prefill_time(4096, 80)
    decode_gain = a100.decode_time(32, 80) / h100.decode_time(32, 80)
    assert prefill_gain > decode_gain > 1


def test_auto_picks_it_for_llama_70b_on_dgx_machines_and_refuses_other_models() -> None:
    cluster = parse_cluster({"name": "ha", "nodes": [{"name": "p0", "device": "8xh100", "region": "r"},
                                                     {"name": "t0", "device": "8xa100-80g", "region": "r"}]}, "test")
    table = profile_table_for(cluster, LLAMA70, "auto")
    assert table.source.startswith("splitwise") and set(table.profiles) == {"8xh100", "8xa100-80g", "8xh100-pcap"}
    assert table.profiles["8xh100"].max_layers == 80 and table.profiles["8xh100"].tokens_per_s(80) > 0
    assert profile_table_for(cluster, PRESETS["llama-30b"], "auto").source.startswith("roofline")
    with pytest.raises(ConfigError, match="llama-70b only"):
        profile_table_for(cluster, PRESETS["llama-30b"], "splitwise")
    with pytest.raises(ConfigError, match="llama-70b only"):
        splitwise_profile_table(replace(LLAMA70, num_layers=40))


def test_a_short_prompt_costs_at_least_a_decode_step_and_the_measured_prompts_are_unchanged() -> None:
    table = splitwise_profile_table(LLAMA70)
    for hardware, device in (("a100-80gb", "8xa100-80g"), ("h100-80gb", "8xh100"), ("h100-80gb-pcap", "8xh100-pcap")):
        prof = table.profiles[device]
        step = prof.decode_time(1, 80, 1)
        for tokens in (1, 2):
            assert step <= prof.prefill_time(tokens, 80) <= prof.prefill_time(128, 80), (device, tokens)
        assert prof.prefill_time(1, 80) == pytest.approx(step, rel=1e-9)
        # Every measured prompt batch (128 to 8,192 tokens, one prompt or several of 512) is still its own time.
        with DATA.open() as f:
            rows = [r for r in csv.DictReader(f) if r["hardware"] == hardware]
        totals = {int(r["prompt_size"]) * int(r["batch_size"]) for r in rows}
        assert min(totals) == 128
        for tokens in sorted(totals):
            want = statistics.fmean(float(r["prompt_time"]) for r in rows
                                    if int(r["prompt_size"]) * int(r["batch_size"]) == tokens) / 1e3
            assert prof.prefill_time(tokens, 80) == pytest.approx(want, rel=1e-9), (device, tokens)
