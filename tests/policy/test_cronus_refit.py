"""Cronus's predictors refitted while serving: the features of the CPI's time are the balancer's own arithmetic;
the ridge fit stays near the join-time fit on a few observations and follows a steady stream to what the node
really does; the coordinator's scheduler refits each pair's balancer from the hand-over and first-token times,
which moves its split; and the mirror test with refitting on: the simulator's Cronus design and a scheduler built
as the coordinator builds it, given the same calls, decide the same."""

from __future__ import annotations

import random

import pytest

from hetnode.coordinator.cronus_scheduler import CronusScheduler
from hetnode.coordinator.scheduler import Decision
from hetnode.planner.cronus_fit import fit_chunked_iteration, fit_partial_prefill
from hetnode.planner.cronus_plan import cronus_placement
from hetnode.planner.devices import parse_device
from hetnode.planner.model import model_spec
from hetnode.policy.cronus import ChunkedIteration, CpiState, CronusBalancer, LinearPrefill
from hetnode.policy.cronus_refit import PredictorRefit, chunked_features
from hetnode.testnet.sim.pair_designs import Loop, PairSetup, build
from hetnode.testnet.sim.pair_engine import PairRequest

PPI = LinearPrefill(k=2e-4, b=0.01)
CPI = ChunkedIteration(k_ctxp=2e-6, k_ctxd=1e-7, b=0.03)
MODEL = model_spec("llama3-8b")
A100, A10 = parse_device("a100-80g"), parse_device("a10")


def state(decodes: int = 0, context: int = 0) -> CpiState:
    return CpiState(decodes=decodes, decode_context=context, free_blocks=100_000, block_size=16,
                    max_batch_tokens=512)


def test_the_chunked_features_give_the_balancers_cpi_time() -> None:
    rng = random.Random(3)
    balancer = CronusBalancer(PPI, CPI)
    for _ in range(300):
        prompt, s = rng.randint(1, 9000), state(rng.randint(0, 200), rng.randint(0, 400_000))
        split = balancer.split(prompt, s)
        x = chunked_features(prompt, split.tokens, s)
        assert CPI.k_ctxp * x[0] + CPI.k_ctxd * x[1] + CPI.b * x[2] == pytest.approx(split.cpi_s, rel=1e-9, abs=1e-12)


def test_a_few_times_move_the_fit_a_little_and_a_steady_stream_to_the_truth() -> None:
    rng = random.Random(5)
    true_ppi = LinearPrefill(k=6e-4, b=0.02)  # the node is three times slower than its profile said
    true_cpi = ChunkedIteration(k_ctxp=4e-6, k_ctxd=1e-7, b=0.05)
    refit = PredictorRefit(PPI, CPI, window=64)
    first = refit.observe_partial(1000, true_ppi.seconds(1000))
    assert PPI.k < first.k < true_ppi.k  # one observation against a prior of four
    for _ in range(200):
        n = rng.randint(100, 4000)
        ppi = refit.observe_partial(n, true_ppi.seconds(n) * rng.uniform(0.97, 1.03))
        prompt, s = rng.randint(600, 6000), state(0, 0)  # no decodes: k_ctxd is never exercised
        tokens = rng.randint(1, prompt - 1)
        x = chunked_features(prompt, tokens, s)
        cpi = refit.observe_chunked(prompt, tokens, s, true_cpi.k_ctxp * x[0] + true_cpi.b * x[2])
    # What the balancer reads is the predicted times: on fresh requests, within a fifth of the join-time fit's
    # error (what is left is the prior's pull, 4 observations of 68; Eq. 3's two features are nearly collinear
    # here, so the coefficients one by one are less telling than the times they predict).
    def error(ppi_fit: LinearPrefill, cpi_fit: ChunkedIteration) -> tuple[float, float]:
        e_ppi = e_cpi = 0.0
        for n in range(200, 6000, 97):
            e_ppi += abs(ppi_fit.seconds(n) / true_ppi.seconds(n) - 1)
            x = chunked_features(n + 500, n, state(0, 0))
            truth = true_cpi.k_ctxp * x[0] + true_cpi.b * x[2]
            e_cpi += abs((cpi_fit.k_ctxp * x[0] + cpi_fit.b * x[2]) / truth - 1)
        return e_ppi, e_cpi

    (fit_ppi, fit_cpi), (prior_ppi, prior_cpi) = error(ppi, cpi), error(PPI, CPI)
    assert fit_ppi < 0.2 * prior_ppi and fit_cpi < 0.2 * prior_cpi, (fit_ppi, prior_ppi, fit_cpi, prior_cpi)
    assert cpi.k_ctxd == CPI.k_ctxd  # kept from the join-time fit
    assert len(refit.partial) == len(refit.chunked) == 64


def test_the_scheduler_refits_from_hand_overs_and_first_tokens_and_the_split_moves() -> None:
    p = cronus_placement("test", MODEL, {"big": A100.fp16_tflops, "small": A10.fp16_tflops},
                         {"big": A100.memory_bytes, "small": A10.memory_bytes})
    fixed = CronusScheduler(p, splitters=[CronusBalancer(PPI, CPI)], cpi_state=lambda _: state())
    learning = CronusScheduler(p, splitters=[CronusBalancer(PPI, CPI)], cpi_state=lambda _: state(),
                               refit_window=16)
    t = 0.0
    for i in range(30):
        d = learning.submit(f"r{i}", 3000, t)
        k = d.split or 3000
        # The PPI takes three times its predicted time; the CPI's rest takes what was predicted.
        done = t + 3 * PPI.seconds(k)
        learning.partial_done(f"r{i}", done)
        x = chunked_features(3000, k, state())
        first = done + CPI.k_ctxp * x[0] + CPI.b * x[2]
        learning.prefilled(f"r{i}", first)
        learning.finish(f"r{i}", 1, first)
        t = first + 0.01
    want = fixed.submit("a", 3000, t).split
    got = learning.submit("b", 3000, t).split
    assert want is not None and got is not None and got < 0.6 * want  # a slow PPI gets less of each prompt
    # A request whose hand-over was never reported teaches nothing.
    quiet = CronusScheduler(p, splitters=[CronusBalancer(PPI, CPI)], cpi_state=lambda _: state(), refit_window=16)
    quiet.submit("c", 3000, 0.0)
    quiet.prefilled("c", 50.0)
    assert (quiet._pairs[0].splitter.ppi, quiet._pairs[0].splitter.cpi) == (PPI, CPI)  # type: ignore[attr-defined]


def test_mirror_with_refitting_the_simulator_and_the_coordinator_decide_the_same() -> None:
    """As tests/coordinator/test_cronus_scheduler.py's mirror, with both refitting: the simulator's Cronus design
    drives its scheduler at its simulated times; a scheduler built as the coordinator builds one replays the
    same calls and CPI states, and every decision (request, split, queueing) is the same."""
    setup = PairSetup(A100, A10, MODEL)
    loop = Loop()
    design = build("cronus", setup, loop, queue_limit=100, refit_window=8)
    calls: list[tuple[str, tuple[object, ...], list[Decision]]] = []
    states: list[CpiState] = []
    inner = design.scheduler  # type: ignore[attr-defined]
    reader = inner._cpi_state
    inner._cpi_state = lambda node: states.append(reader(node)) or states[-1]

    class Recorder:
        def __getattr__(self, name: str) -> object:
            attr = getattr(inner, name)
            if name not in ("submit", "partial_done", "prefilled", "finish", "cancel", "progress"):
                return attr

            def call(*args: object) -> object:
                out = attr(*args)
                calls.append((name, args, [out] if isinstance(out, Decision) else list(out or [])))
                return out
            return call

    design.scheduler = Recorder()  # type: ignore[attr-defined]
    rng = random.Random(11)
    for i in range(40):
        r = PairRequest(f"r{i}", 0.4 * i, rng.randint(200, 6000), rng.randint(2, 30))
        loop.at(r.arrival, design.arrive, r)
    loop.run()
    balancer = CronusBalancer(fit_partial_prefill(A10, MODEL), fit_chunked_iteration(A100, MODEL, 512))
    replay = iter(states)
    runtime = CronusScheduler(cronus_placement("t", MODEL, {"big": A100.fp16_tflops, "small": A10.fp16_tflops},
                                               {"big": A100.memory_bytes, "small": A10.memory_bytes}),
                              splitters=[balancer], cpi_state=lambda node: next(replay), queue_limit=100,
                              refit_window=8)
    for name, args, decided in calls:
        again = getattr(runtime, name)(*args)
        again = [again] if isinstance(again, Decision) else list(again or [])
        assert [(d.request_id, d.split, d.queued) for d in again] == [
            (d.request_id, d.split, d.queued) for d in decided], (name, args)
    sim_balancer = inner._pairs[0].splitter
    assert (balancer.ppi, balancer.cpi) == (sim_balancer.ppi, sim_balancer.cpi)
    assert balancer.ppi != fit_partial_prefill(A10, MODEL)  # it did refit
    assert sum(1 for _, _, ds in calls for d in ds if d.split) > 10
