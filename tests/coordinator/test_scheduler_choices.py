"""The CLI offers exactly the request schedulers the coordinator can build (the CLI keeps its list literal so that
`hetnode --help` does not import the coordinator), and each is a scheduler the coordinator's planning accepts."""

from __future__ import annotations

import argparse

import pytest

from hetnode.cli import build_parser
from hetnode.coordinator.deployment import PlanningConfig
from hetnode.coordinator.routing import SCHEDULERS, SPLIT_SCHEDULERS
from hetnode.errors import ConfigError
from hetnode.policy.decode_booking import ADMISSION, DECODE_BOOKINGS


def _choices(parser: argparse.ArgumentParser, *path: str, dest: str = "scheduler") -> set[str]:
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    action = next(a for a in parser._actions if a.dest == dest)
    assert action.choices is not None
    return set(action.choices)


def test_the_cli_offers_every_scheduler_the_coordinator_builds() -> None:
    built = set(SCHEDULERS) | set(SPLIT_SCHEDULERS)
    assert _choices(build_parser(), "coordinator") == built
    assert _choices(build_parser(), "testnet", "up") == built
    for name in built:  # each one passes the coordinator's own check
        PlanningConfig(scheduler=name)


def test_bad_slos_are_refused_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args(["coordinator", "--slo", "2,0.1"]).slo == (2.0, 0.1)
    for bad, why in (("2", "expected TTFT,TPOT"), ("0,0.1", "positive and finite"), ("a,b", "expected TTFT,TPOT")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["coordinator", "--slo", bad])
        assert why in capsys.readouterr().err


def test_the_cli_offers_every_decode_booking_and_splitwises_pools_refuse_the_hand_off() -> None:
    for path in (("coordinator",), ("testnet", "up")):
        assert _choices(build_parser(), *path, dest="decode_booking") == set(DECODE_BOOKINGS)
        assert build_parser().parse_args([*path]).decode_booking == ADMISSION
    for name in set(SCHEDULERS) | set(SPLIT_SCHEDULERS):
        if name == "splitwise":  # its pools lend replicas across roles: it books at admission only
            with pytest.raises(ConfigError, match="Splitwise's pools book at admission"):
                PlanningConfig(scheduler=name, decode_booking="handoff")
        else:  # a non-split plan's scheduler ignores it; a split plan's cls, tstp and random-pairs take it
            PlanningConfig(scheduler=name, decode_booking="handoff")
    with pytest.raises(ConfigError, match="decode booking must be one of"):
        PlanningConfig(decode_booking="later")
