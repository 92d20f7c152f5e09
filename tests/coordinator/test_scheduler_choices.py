"""The CLI offers exactly the request schedulers the coordinator can build (the CLI keeps its list literal so that
`hetnode --help` does not import the coordinator), and each is a scheduler the coordinator's planning accepts."""

from __future__ import annotations

import argparse

from hetnode.cli import build_parser
from hetnode.coordinator.deployment import PlanningConfig
from hetnode.coordinator.routing import SCHEDULERS, SPLIT_SCHEDULERS


def _choices(parser: argparse.ArgumentParser, *path: str) -> set[str]:
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    action = next(a for a in parser._actions if a.dest == "scheduler")
    assert action.choices is not None
    return set(action.choices)


def test_the_cli_offers_every_scheduler_the_coordinator_builds() -> None:
    built = set(SCHEDULERS) | set(SPLIT_SCHEDULERS)
    assert _choices(build_parser(), "coordinator") == built
    assert _choices(build_parser(), "testnet", "up") == built
    for name in built:  # each one passes the coordinator's own check
        PlanningConfig(scheduler=name)
