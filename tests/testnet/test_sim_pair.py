"""Cronus §5's designs on a GPU pair (pair_designs.py): every request served, each design's structure as §5.1
sets it, and `hetnode sim --placement cronus`."""

from __future__ import annotations

import json
import math

import pytest

from hetnode.cli import main
from hetnode.planner.devices import parse_device
from hetnode.planner.model import model_spec
from hetnode.testnet.sim.pair_designs import DESIGNS, PairSetup, pp_layers, simulate_pair
from hetnode.testnet.sim.pair_engine import kv_tokens

PROMPTS = (1800, 40, 700, 3000, 260, 1200, 90, 2500, 512, 1024, 5, 1500)
OUTPUTS = (30, 200, 1, 80, 12, 64, 5, 40, 100, 7, 33, 20)


def setup(low: str = "a10", model: str = "llama3-8b") -> PairSetup:
    return PairSetup(parse_device("a100-80g"), parse_device(low), model_spec(model))


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("at_once", [True, False])
def test_every_request_gets_all_its_tokens_in_order(design: str, at_once: bool) -> None:
    arrivals = [0.0] * len(PROMPTS) if at_once else [0.2 * i for i in range(len(PROMPTS))]
    result = simulate_pair(design, setup(), PROMPTS, OUTPUTS, arrivals)
    for r in result.requests:
        assert r.generated == r.output and r.arrival <= r.first_token <= r.finish
        assert len(r.gaps) == r.output - 1 and all(g >= 0 for g in r.gaps)
    assert result.throughput > 0 and all(0 < u <= 1 for u in result.utilization().values())
    assert math.isfinite(result.ttft(0.99))


def test_cronus_splits_each_prompt_and_the_disaggregated_ones_prefill_it_whole() -> None:
    cronus = simulate_pair("cronus", setup(), PROMPTS, OUTPUTS, [0.0] * len(PROMPTS))
    assert sorted(cronus.splits) != sorted(PROMPTS)  # some prompt was split
    assert all(1 <= r.split <= r.prompt for r in cronus.requests)
    assert any(r.split < r.prompt for r in cronus.requests)
    for design in ("disagg-hl", "disagg-lh"):
        whole = simulate_pair(design, setup(), PROMPTS, OUTPUTS, [0.0] * len(PROMPTS))
        assert all(r.split == r.prompt for r in whole.requests)
    assert cronus.decisions == len(PROMPTS)


def test_a_slower_ppi_takes_a_smaller_share_of_each_prompt() -> None:
    """The balancer's predictors come from the devices: an A30 PPI prefills more of a prompt than an A10."""
    share = {low: sum(simulate_pair("cronus", setup(low), PROMPTS, OUTPUTS, [0.3 * i for i in range(len(PROMPTS))])
                      .splits) for low in ("a10", "a30")}
    assert share["a10"] < share["a30"]


def test_pipeline_layers_follow_the_flops_as_in_the_paper() -> None:
    # §5.1: LLaMA3-8B 23+9 on A100+A10, 21+11 on A100+A30; Qwen2-7B 20+8 and 18+10.
    assert [pp_layers(setup(low, m)) for low in ("a10", "a30") for m in ("llama3-8b", "qwen2-7b")] == [
        (23, 9), (20, 8), (21, 11), (18, 10)]


def test_kv_pools_are_what_the_memory_leaves_beside_the_weights() -> None:
    llama = model_spec("llama3-8b")
    a10 = kv_tokens(parse_device("a10"), llama, 32)
    a100 = kv_tokens(parse_device("a100-80g"), llama, 32)
    assert 30_000 < a10 < 70_000 and a100 > 6 * a10
    with pytest.raises(ValueError, match="do not fit"):
        kv_tokens(parse_device("a10"), model_spec("llama-30b"), 60)


def test_bad_requests_are_refused() -> None:
    with pytest.raises(ValueError, match="as many"):
        simulate_pair("cronus", setup(), (10,), (1, 2), (0.0,))
    with pytest.raises(ValueError, match="at least one token"):
        simulate_pair("dp", setup(), (0,), (1,), (0.0,))
    with pytest.raises(ValueError, match="unknown design"):
        simulate_pair("helix", setup(), (10,), (1,), (0.0,))


def test_hetnode_sim_placement_cronus(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--cluster", "cronus-a100-a30", "--model", "qwen2-7b", "--placement", "cronus",
                 "--offline", "--first", "30", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["design"] == "cronus" and (out["high"], out["low"]) == ("a100-80g", "a30")
    assert out["requests"] == 30 and out["throughput_rps"] > 0 and out["mean_split"] > 0


def test_hetnode_sim_pair_errors_name_the_problem(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--cluster", "cronus-a100-a10", "--model", "llama3-8b", "--placement", "dp",
                 "--first", "10"]) == 2
    assert "--rate" in capsys.readouterr().err
    # (cronus on a cluster of another size runs in the main simulator: test_sim_cronus.py)
    assert main(["sim", "--cluster", "local3", "--model", "llama3-8b", "--placement", "dp", "--offline"]) == 2
    assert "pair of GPUs" in capsys.readouterr().err
