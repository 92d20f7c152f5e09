"""The instance simulator (EcoServe and its NoDG/FuDG baselines): requests complete with consistent metrics,
EcoServe's routing is the macro-instance scheduler's, the phase-switch wait shows in EcoServe's TTFT, KV moves in
FuDG, mitosis adds instances under load, and `hetnode sim --placement ecoserve` runs."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from hetnode.cli import main
from hetnode.errors import ConfigError
from hetnode.planner.devices import parse_device
from hetnode.planner.instance_cost import Chunk, InstanceCost
from hetnode.planner.model import model_spec
from hetnode.policy.ecoserve import Slos
from hetnode.testnet.sim.padg import DESIGNS, PadgOptions, PadgSim, fit_predictor, simulate_instances
from hetnode.testnet.sim.synthetic import TABLE4, check, table4_trace
from hetnode.testnet.sim.workload import poisson

MODEL = model_spec("codellama-34b")
SLOS = Slos(5.0, 0.1)


def run(design: str, rate: float = 6.0, **kw: object) -> list:
    w = poisson(rate, lengths=table4_trace("sharegpt", n=500), duration_s=20, seed=1)
    opts = PadgOptions(design=design, tp=4, instances=4, per_host=2 if design == "distserve" else 1, **kw)
    return simulate_instances(MODEL, w, opts, duration_s=20, warmup_s=2, slos=SLOS).requests


@pytest.mark.parametrize("design", DESIGNS)
def test_every_request_completes_with_ordered_timestamps(design: str) -> None:
    reqs = run(design)
    assert reqs and all(r.finished and r.gen == r.output for r in reqs)
    for r in reqs:
        assert r.arrival <= r.first_token <= r.last_token
        assert r.ttft <= r.ttft_eco + 1e-9  # EcoServe's TTFT adds the wait for the decode phase
        if r.output > 1:
            assert r.first_token <= r.decode_start <= r.last_token and r.tpot > 0


def test_fudg_decodes_start_after_the_kv_transfer() -> None:
    slow = run("mooncake", nic_gbps=1.0)
    fast = run("mooncake", nic_gbps=100.0)

    def gap(rs: list) -> float:
        waits = [r.decode_start - r.first_token for r in rs if r.output > 1]
        return sum(waits) / len(waits)

    assert gap(slow) > 10 * gap(fast)


def test_ecoserve_routes_by_the_macro_instance_scheduler() -> None:
    """Prompts concentrate on the instance Algorithm 1 keeps while its checks hold, and roll on in order."""
    def moves(design: str) -> tuple[int, int]:
        order = [r.instance for r in sorted(run(design, rate=12.0), key=lambda r: r.arrival)]
        changes = [(a, b) for a, b in itertools.pairwise(order) if a != b]
        return len(changes), sum(b != (a + 1) % 4 for a, b in changes)

    eco, vllm = moves("ecoserve"), moves("vllm")
    assert eco[0] < vllm[0] / 2  # requests stay on an instance while they fit
    assert eco[1] == 0  # and roll to the next one (Algorithm 1), never elsewhere


def test_mitosis_adds_instances_when_slos_are_missed() -> None:
    w = poisson(40.0, lengths=table4_trace("sharegpt", n=500), duration_s=40, seed=1)
    opts = PadgOptions(design="ecoserve", tp=4, instances=1, max_instances=4, n_lower=2, n_upper=3,
                       window_s=5.0, drain_s=60)
    result = simulate_instances(MODEL, w, opts, duration_s=40, warmup_s=2, slos=SLOS)
    adds = [e for e in result.scaling if e["action"] == "add"]
    assert len(adds) == 3 and any(e["moves"] for e in adds)  # the split at N_u moved an instance


def test_predictor_and_cost_model() -> None:
    cost = InstanceCost(parse_device("l20"), 4, MODEL)
    predictor = fit_predictor(cost)
    for n in (100, 1000, 3000):
        assert predictor(n) == pytest.approx(cost.prefill_s(n), rel=0.05)
    # A hybrid step reads the weights once: decodes beside a long chunk cost (almost) nothing more.
    assert cost.step_s([Chunk(512)], [300] * 8) < 1.05 * cost.step_s([Chunk(512)])
    assert cost.kv_tokens > 0 and 0 < cost.comm_share([], [300] * 8) < 1
    with pytest.raises(ValueError):
        InstanceCost(parse_device("l20"), 3, MODEL)  # 3 does not divide 64 heads
    with pytest.raises(ConfigError):
        PadgSim(model_spec("qwen2-72b"), PadgOptions(tp=2), SLOS)  # 145 GB of weights on 96 GB


def test_table4_lengths_match_the_table() -> None:
    for name, row in TABLE4.items():
        got = check(table4_trace(name, n=4000))
        assert got["in_median"] == pytest.approx(row.in_median, rel=0.06)
        assert got["out_median"] == pytest.approx(row.out_median, rel=0.1)
        assert got["in_mean"] == pytest.approx(row.in_mean, rel=0.06)


def test_cli_runs_ecoserve(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["sim", "--cluster", "ecoserve-l20", "--model", "codellama-34b", "--placement", "ecoserve",
               "--instances", "2", "--trace", "sharegpt", "--rate", "2", "--duration", "10", "--warmup", "1",
               "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["design"] == "ecoserve" and out["requests"] > 0
    assert not math.isnan(out["slo_attainment"])
    assert main(["sim", "--cluster", "ecoserve-l20", "--model", "codellama-34b", "--placement", "ecoserve",
                 "--tp", "16", "--trace", "sharegpt", "--rate", "2"]) == 2


def test_cli_deploys_distserves_pairs_on_a_host_as_the_cluster_holds_them() -> None:
    """The A800 testbed holds four TP=2 instances a host: DistServe-like's prefill/decode pairs stay on a host, two
    pairs each, and nothing pretends there are more hosts than the cluster has."""
    import argparse
    from importlib.resources import files

    from hetnode.planner.cluster import load_cluster
    from hetnode.testnet.sim.padg_cli import options_for

    cluster = load_cluster(str(files("hetnode.testnet") / "clusters" / "ecoserve-a800.toml"))
    args = argparse.Namespace(method="fudg-distserve", tp=2, instances=0, prefill_instances=0, max_instances=0,
                              n_lower=4, n_upper=16, token_budget=512)
    got = options_for(cluster, args)
    assert (got["device"], got["instances"], got["per_host"], got["nic_gbps"]) == ("a800", 8, 4, 25.0)
    assert options_for(cluster, argparse.Namespace(**{**vars(args), "tp": 4}))["per_host"] == 2
