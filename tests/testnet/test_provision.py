"""Splitwise's provisioning: designs of prompt and token machines, judged by the nine SLOs in the simulator, and
the search for the cheapest one that meets them."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from hetnode.cli import main
from hetnode.errors import ConfigError
from hetnode.planner.model import PRESETS
from hetnode.planner.profile_sources import profile_table_for
from hetnode.testnet.sim.provision import (
    MACHINES,
    SLOS,
    Design,
    alone,
    design_cluster,
    evaluate,
    picture,
    price,
    search,
    search_throughput,
)
from hetnode.testnet.sim.runner import SimOptions, simulate
from hetnode.testnet.sim.workload import Workload, load_trace, poisson

LLAMA70 = PRESETS["llama-70b"]


def test_a_design_is_whole_model_replicas_with_their_roles_on_one_fabric() -> None:
    cluster, plan = design_cluster("8xh100", "8xa100-80g", 2, 3, LLAMA70)
    assert [n.device for n in cluster.nodes] == ["8xh100"] * 2 + ["8xa100-80g"] * 3
    assert [(r.role, r.nodes) for r in plan.replicas] == [("prefill", ("p0",)), ("prefill", ("p1",)),
                                                           ("decode", ("t0",)), ("decode", ("t1",)),
                                                           ("decode", ("t2",))]
    assert all((p.first_layer, p.last_layer) == (0, 80) for p in plan.placements)
    assert cluster.link("p0", "t2").bandwidth_mbps == 200_000  # the slower machine's InfiniBand
    with pytest.raises(ConfigError, match="no cost and power"):
        design_cluster("8xh100", "4xt4", 1, 1, LLAMA70)
    with pytest.raises(ConfigError, match="at least one"):
        design_cluster("8xh100", "8xh100", 0, 1, LLAMA70)


def design(prompt: int, token: int, ok: bool) -> Design:
    limits = {m: tuple(x * (0.5 if ok else 2.0) for x in lim) for m, lim in SLOS.items()}
    return Design(prompt, token, prompt * 38.0 + token * 17.6, prompt * 1.75 + token, limits, 10, 10)  # type: ignore[arg-type]


def test_the_search_bisects_token_counts_and_picks_the_cheapest_design_that_meets_every_slo() -> None:
    calls: list[tuple[int, int]] = []

    def fake(p: int, t: int) -> Design:  # meets when there is capacity for both phases
        calls.append((p, t))
        return design(p, t, p >= 2 and t >= 7 - 2 * p)

    best, designs = search(fake, max_prompt=4, max_token=8)
    # p=1 misses even at 8; p=2 needs 3 ($128.8), p=3 needs 1 ($131.6), p=4 needs 1 ($169.6).
    assert best is not None and (best.prompt, best.token) == (2, 3)
    assert len(calls) == len(set(calls)) < 4 * 8  # each design at most once, and far from all of them
    assert [(d.prompt, d.token) for d in designs] == sorted(calls)
    best_power, _ = search(fake, max_prompt=4, max_token=8, goal="power")
    assert best_power is not None and (best_power.prompt, best_power.token) == (3, 1)  # 5.25 + 1 < 3.5 + 3
    none, _ = search(lambda p, t: design(p, t, False), max_prompt=2, max_token=2)
    assert none is None
    with pytest.raises(ConfigError, match="cost or power"):
        search(fake, max_prompt=1, max_token=1, goal="speed")


def test_between_designs_of_the_same_cost_the_search_picks_the_one_with_the_most_headroom() -> None:
    def same_price(p: int, t: int) -> Design:  # machines of one price; more prompt machines, more headroom
        share = {(1, 2): 0.9, (2, 1): 0.6, (1, 1): 2.0}.get((p, t), 0.5)
        limits = {m: tuple(x * share for x in lim) for m, lim in SLOS.items()}
        return Design(p, t, (p + t) * 38.0, (p + t) * 1.75, limits, 10, 10)  # type: ignore[arg-type]

    best, _ = search(same_price, max_prompt=2, max_token=2)
    assert best is not None and (best.prompt, best.token) == (2, 1)  # $114 as (1, 2) is, 0.6 of its SLOs used
    assert same_price(2, 1).tightest == pytest.approx(0.6) and Design(1, 1, 1.0, 1.0).tightest == math.inf


def test_a_design_meets_the_slos_at_a_light_load_and_misses_them_when_overloaded() -> None:
    cluster, _ = design_cluster("8xh100", "8xa100-80g", 1, 1, LLAMA70)
    profiles = profile_table_for(cluster, LLAMA70, "auto")
    lengths = load_trace("code", length_filter=False)

    def at(rate: float) -> Design:
        workload = poisson(rate, lengths=lengths, duration_s=40, seed=1)
        return evaluate("8xh100", "8xa100-80g", 1, 1, model=LLAMA70, profiles=profiles, workload=workload,
                        duration_s=40, warmup_s=5)

    light, heavy = at(1.0), at(40.0)
    assert light.meets and light.worst == "" and light.finished == light.arrived > 0
    assert light.cost_per_hour == pytest.approx(MACHINES["8xh100"].cost_per_hour + MACHINES["8xa100-80g"].cost_per_hour)
    assert not heavy.meets and heavy.worst
    # Alone on a DGX-A100 is the reference: an H100 prefills faster, so the light load's TTFT is under 1x.
    assert light.slowdowns["ttft"][0] < 1 < heavy.slowdowns["ttft"][2]


def test_a_short_prompt_is_never_faster_than_a_decode_step_alone_or_simulated() -> None:
    # Splitwise measured prompts from 128 tokens up; below, the profile starts at a one-sequence decode step, and
    # both the SLOs' reference and the simulated machine see that floor (the curve to the origin priced a
    # 2-token prompt at 1 ms, so one step shared with decodes made it tens of times "slower" than alone).
    cluster, plan = design_cluster("8xa100-80g", "8xa100-80g", 1, 0, LLAMA70)
    profiles = profile_table_for(cluster, LLAMA70, "splitwise")
    a100 = profiles.profiles["8xa100-80g"]
    step = a100.decode_time(1, 80, 1)
    ttft, tbt, _ = alone(a100, 80, 2, 4)
    assert step <= ttft <= a100.prefill_time(128, 80) and tbt >= step
    one = Workload("one", inputs=(2,), outputs=(4,), arrivals=(0.5,))
    result = simulate(cluster, LLAMA70, profiles, plan, workload=one, scheduler="shortest-queue", duration_s=5,
                      warmup_s=0, options=SimOptions(batching="splitwise"))
    (r,) = result.requests
    assert r.ttft >= step and r.ttft == pytest.approx(ttft, rel=0.05)


def test_the_picture_marks_what_meets_and_the_choice() -> None:
    designs = [design(1, 1, False), design(1, 2, True), design(2, 1, True)]
    svg = picture(designs, designs[1], title="HA <test>")
    assert svg.startswith("<svg") and svg.count("<rect") == 3 and svg.count("#7fc97f") == 2
    assert "HA &lt;test&gt;" in svg and ">*</text>" in svg
    with pytest.raises(ValueError):
        picture([], None, title="")


def test_hetnode_provision_prints_the_designs_and_the_choice(capsys: pytest.CaptureFixture[str],
                                                              tmp_path: Path) -> None:
    args = ["provision", "--rate", "1", "--duration", "20", "--warmup", "2", "--max-prompt", "2", "--max-token", "2"]
    assert main([*args, "--json", "--picture", str(tmp_path / "p.svg")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["best"] == {**out["best"], "prompt": 1, "token": 1, "meets": True}
    assert all(math.isfinite(x) for d in out["designs"] for m in d["slowdowns"].values() for x in m)
    assert (tmp_path / "p.svg").read_text().startswith("<svg")
    assert main(args) == 0
    assert "chosen (least cost): 1 x 8xh100 prompt + 1 x 8xa100-80g token machines" in capsys.readouterr().out
    assert main([*args[:-4], "--max-prompt", "1", "--max-token", "1", "--warmup", "30"]) == 2  # warmup >= duration


# -- Splitwise-HHcap and the throughput-under-a-budget goal ---------------------------------------------------


def test_a_power_capped_h100_prefills_slower_and_decodes_alike() -> None:
    cluster, _ = design_cluster("8xh100", "8xh100-pcap", 1, 1, LLAMA70)
    table = profile_table_for(cluster, LLAMA70)
    assert table.source.startswith("splitwise")
    h, cap = table.profiles["8xh100"], table.profiles["8xh100-pcap"]
    assert cap.prefill_time(2048, 80) == pytest.approx(1.3 * h.prefill_time(2048, 80))
    assert cap.decode_time(32, 80, 1000) == pytest.approx(h.decode_time(32, 80, 1000))
    assert MACHINES["8xh100-pcap"].power == 1.23
    assert price("8xh100", "8xh100-pcap", 2, 3) == (190.0, 2 * 1.75 + 3 * 1.23)


def test_the_throughput_search_takes_the_largest_designs_a_budget_allows_and_bisects_their_rate() -> None:
    calls: list[tuple[int, int, float]] = []

    def fake(p: int, t: int, rate: float) -> Design:  # serves up to 3 req/s a prompt machine and 5 a token one
        calls.append((p, t, rate))
        return replace(design(p, t, rate <= min(3 * p, 5 * t)), rate=rate)

    # Power budget 6 DGX-A100s of H100 prompt (1.75) and A100 token (1) machines: (1, 4), (2, 2), (3, 0: none).
    best, designs = search_throughput(fake, prompt_machine="8xh100", token_machine="8xa100-80g", budget=6.0,
                                      of="power", max_prompt=5, max_token=8, max_rate=40, resolution=0.5)
    assert [(d.prompt, d.token) for d in designs] == [(1, 4), (2, 2)]
    assert [d.rate for d in designs] == [3.0, 6.0]  # min(3, 20) and min(6, 10), to the half
    assert best is not None and (best.prompt, best.token, best.rate) == (2, 2, 6.0)
    assert len(calls) < 2 * 10  # bisected, not swept (80 grid points each)
    by_cost, _ = search_throughput(fake, prompt_machine="8xh100", token_machine="8xa100-80g", budget=100.0,
                                   of="cost", max_prompt=5, max_token=8, max_rate=40, resolution=0.5)
    # $100 buys (1, 3) at 3 req/s or (2, 1) at 5.
    assert by_cost is not None and (by_cost.prompt, by_cost.token, by_cost.rate) == (2, 1, 5.0)
    nothing, designs = search_throughput(lambda p, t, r: replace(design(p, t, False), rate=r),
                                         prompt_machine="8xh100", token_machine="8xa100-80g", budget=6.0,
                                         of="power", max_prompt=5, max_token=8, max_rate=40, resolution=1)
    assert nothing is None and all(d.rate == 1 for d in designs)


def test_the_throughput_search_refuses_bad_budgets() -> None:
    def never(p: int, t: int, rate: float) -> Design:
        raise AssertionError("nothing should be simulated")

    kw = {"prompt_machine": "8xh100", "token_machine": "8xh100", "max_prompt": 4, "max_token": 4, "max_rate": 10.0,
          "resolution": 1.0}
    with pytest.raises(ConfigError, match="no design fits a cost budget of 50"):
        search_throughput(never, budget=50.0, of="cost", **kw)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cost or power"):
        search_throughput(never, budget=50.0, of="space", **kw)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="resolution"):
        search_throughput(never, budget=500.0, of="cost", **{**kw, "resolution": 20.0})  # type: ignore[arg-type]


def test_hetnode_provision_maximizes_throughput_under_a_budget(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["provision", "--prompt-machine", "8xh100", "--token-machine", "8xh100-pcap", "--goal", "throughput",
            "--budget-power", "3", "--max-prompt", "2", "--max-token", "2", "--duration", "20", "--warmup", "2",
            "--max-rate", "8", "--rate-resolution", "2", "--trace", "conv"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(d["prompt"], d["token"]) for d in out["designs"]] == [(1, 1)]  # 1.75 + 1.23 <= 3; nothing larger
    assert out["best"]["meets"] and 2 <= out["best"]["rate"] <= 8 and out["best"]["power"] == 2.98


@pytest.mark.parametrize("extra, problem", [
    (["--goal", "throughput"], "needs one budget"),
    (["--goal", "throughput", "--budget-cost", "100", "--budget-power", "3"], "needs one budget"),
    (["--goal", "throughput", "--budget-cost", "10"], "no design fits a cost budget of 10"),
    (["--goal", "throughput", "--budget-cost", "100", "--rate", "3"], "give --max-rate, not --rate"),
    (["--goal", "cost", "--budget-power", "3", "--rate", "3"], "--budget-power goes with --goal throughput"),
    (["--goal", "power"], "needs a target load: --rate"),
])
def test_hetnode_provision_refuses_bad_goals_and_budgets(extra: list[str], problem: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["provision", "--duration", "20", "--warmup", "2", *extra]) == 2
    assert problem in capsys.readouterr().err


def test_hetnode_provision_rejects_a_negative_budget(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["provision", "--goal", "throughput", "--budget-power", "-1"])
    assert "--budget-power" in capsys.readouterr().err
