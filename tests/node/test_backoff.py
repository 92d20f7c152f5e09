"""The join retry schedule: exponential, capped, jittered; and testnet nodes keep the long default budget."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetnode.cli import build_parser
from hetnode.node.backoff import JITTER, backoff_delay
from hetnode.node.daemon import NodeConfig
from hetnode.planner.cluster import NodeSpec
from hetnode.testnet.launcher import join_args


def test_backoff_doubles_up_to_the_cap() -> None:
    middle = [backoff_delay(a, initial_s=0.25, max_s=30.0, u=0.5) for a in range(10)]  # u = 0.5: no jitter
    assert middle == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert backoff_delay(10**6, initial_s=0.25, max_s=30.0, u=0.5) == 30.0  # no overflow however long it runs


@given(st.integers(0, 2000), st.floats(0, 1, exclude_max=True))
def test_jitter_stays_within_its_band(attempt: int, u: float) -> None:
    nominal = min(30.0, 0.25 * 2.0 ** min(attempt, 64))
    delay = backoff_delay(attempt, initial_s=0.25, max_s=30.0, u=u)
    assert nominal * (1 - JITTER) <= delay <= nominal * (1 + JITTER)  # the upper end: floating-point rounding


def test_bad_arguments() -> None:
    for attempt, u in ((-1, 0.5), (0, 1.0), (0, -0.1)):
        with pytest.raises(ValueError):
            backoff_delay(attempt, initial_s=1, max_s=2, u=u)


def test_nodes_keep_trying_for_an_hour_by_default() -> None:
    assert NodeConfig.retry_budget_s >= 3600 and NodeConfig.backoff_max_s <= 30
    args = build_parser().parse_args(["join", "--bootstrap", "/ip4/1.2.3.4/tcp/1/p2p/x", "--token", "t"])
    assert args.retry_budget >= 3600
    never = build_parser().parse_args(["join", "--bootstrap", "/ip4/1.2.3.4/tcp/1/p2p/x", "--retry-budget", "0"])
    assert never.retry_budget == 0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["join", "--bootstrap", "/ip4/1.2.3.4/tcp/1/p2p/x", "--retry-budget", "-1"])


def test_testnet_nodes_do_not_shorten_the_retry_budget(tmp_path: Path) -> None:
    args = argparse.Namespace(log_level="info", compute_dilation=None)
    for spec in (NodeSpec("n0", "cpu", "r1", 8.0), NodeSpec("n1", "a100", "r2", 80.0)):
        cmd = join_args(args, spec, "/ip4/127.0.0.1/tcp/4001/p2p/x", tmp_path, [])
        assert "--retry-budget" not in cmd
        parsed = build_parser().parse_args(cmd)
        assert parsed.retry_budget >= 3600 and parsed.name == spec.name
