"""The coordinator follows the workload: a phase-split deployment is planned again for the observed mix when
its lengths move away from what it was sized for (ThunderServe's rescheduling on a workload shift)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from hetnode.coordinator.deployment import Deployment, PlanningConfig
from hetnode.coordinator.registry import Registry
from hetnode.errors import ConfigError
from hetnode.ids import NodeId
from hetnode.models.resolve import load_config
from hetnode.models.tiny import write_tiny_model
from hetnode.planner.plan import PlacementPlan
from hetnode.planner.thunderserve import reschedule as reschedule_module
from hetnode.planner.thunderserve.settings import ThunderServeOptions


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama") / "m", "llama")


def deployment(model: Path, planning: PlanningConfig) -> Deployment:
    async def no_control(*args: Any) -> None:
        raise AssertionError("no assignments here")

    registry = Registry(token="t", heartbeat_deadline_s=1e9)
    return Deployment(registry, no_control, model=str(model), model_config=load_config(model),  # type: ignore[arg-type]
                      coordinator=NodeId("coord"), planning=planning)


async def feed(d: Deployment, n: int, prompt: int, output: int) -> None:
    for _ in range(n):
        d.request_arrived(prompt)
        await trio.sleep(0.5)
        d.request_finished(output)
        await trio.sleep(0.5)


@pytest.mark.parametrize("shift", [0.5, 0.0])
def test_a_shift_of_the_mix_replans_a_split_deployment_for_it(tiny_model: Path, shift: float) -> None:
    async def run() -> None:
        d = deployment(tiny_model, PlanningConfig(method="split", split_workload=(750, 240), reschedule_shift=shift,
                                                  workload_window_s=60))
        await feed(d, 60, 800, 250)  # near what it was sized for
        assert d._pending_reason == "initial"
        await feed(d, 60, 3000, 40)  # long prompts, short answers: coding rather than conversation
        if shift:  # re-planned while the window still mixed the two
            assert d._pending_reason.startswith("workload shift: mean prompt length 750 -> ")
            assert d.planning.split_workload[0] > 1000
        await feed(d, 70, 3000, 40)  # a window later, again for the new mix alone
        shown = d.to_json()["workload"]
        assert shown["mean_input"] == pytest.approx(3000) and shown["rate"] == pytest.approx(1.0, rel=0.1)  # type: ignore[index]
        assert shown["input_cv"] == 0.0  # type: ignore[index]  # every prompt the same length here
        if shift:
            assert d.planning.split_workload == (3000, 40)
            assert shown["planned_for"] == [3000, 40]  # type: ignore[index]
        else:  # off: the mix is shown, nothing is re-planned
            assert d._pending_reason == "initial" and d.planning.split_workload == (750, 240)

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))


def test_other_methods_are_not_replanned_for_a_shift(tiny_model: Path) -> None:
    async def run() -> None:
        d = deployment(tiny_model, PlanningConfig(method="helix", reschedule_shift=0.5, workload_window_s=60))
        await feed(d, 120, 3000, 40)
        assert d._pending_reason == "initial"

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))


async def arrive(d: Deployment, n: int, gap: float, prompt: int = 750, output: int = 240) -> None:
    """`n` requests of one mix, one every `gap` seconds."""
    for _ in range(n):
        d.request_arrived(prompt)
        d.request_finished(output)
        await trio.sleep(gap)


@pytest.mark.parametrize("method", ["thunderserve", "split"])
def test_a_shift_of_the_arrival_rate_replans_a_thunderserve_deployment(tiny_model: Path, method: str) -> None:
    async def run() -> None:
        d = deployment(tiny_model, PlanningConfig(method=method, split_workload=(750, 240), reschedule_shift=0.5,
                                                  workload_window_s=60))
        await arrive(d, 120, 1.0)  # steady at the rate it is planned for (1 request/s before any arrival)
        assert d._pending_reason == "initial"
        await arrive(d, 240, 0.25)  # four a second, the same lengths, for a window
        if method == "thunderserve":
            assert d._pending_reason.startswith("workload shift: arrival rate 1.00 -> ")
            assert d.planning.split_workload == (750, 240)  # the lengths did not move
        else:  # the split planner sizes its pools by lengths only: the rate is not judged for it
            assert d._pending_reason == "initial"
        assert d.to_json()["workload"]["rate"] == pytest.approx(4.0, rel=0.05)  # type: ignore[index]

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))


def test_thunderserve_is_replanned_at_the_windows_rate(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the re-plan after a rate shift solves for: the window's rate, which the monitor then judges
    against."""
    asked: list[float] = []

    def search(cluster: object, spec: object, options: ThunderServeOptions) -> PlacementPlan:
        asked.append(options.traffic.rate)
        raise ConfigError("not searched here")

    monkeypatch.setattr(reschedule_module, "thunderserve_placement", search)

    async def run() -> None:
        d = deployment(tiny_model, PlanningConfig(method="thunderserve", split_workload=(750, 240),
                                                  reschedule_shift=0.5, workload_window_s=60))
        await arrive(d, 120, 1.0)
        await arrive(d, 240, 0.25)
        with pytest.raises(ConfigError):
            await d._thunderserve([], None, "workload_shift")  # type: ignore[arg-type]
        assert asked == [pytest.approx(4.0, rel=0.05)]
        assert d.to_json()["workload"]["planned_rate"] == asked[0]  # type: ignore[index]
        await arrive(d, 240, 0.25)  # steady at the rate it was planned for: no re-plan
        d._pending_reason = "served"
        await arrive(d, 240, 0.25)
        assert d._pending_reason == "served"

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_plan_no_scheduler_can_route_is_no_plan_and_the_replan_loop_goes_on(tiny_model: Path) -> None:
    """An operator's `--scheduler tstp` over a phase-split plan without an orchestration: the re-plan reports why
    (409 through POST /v1/plan) rather than raising out of the deployment's loop."""
    from dataclasses import replace
    from importlib.resources import files

    from hetnode.planner.cluster import load_cluster
    from hetnode.planner.profile_sources import profile_table_for
    from hetnode.planner.split import split_placement

    async def run() -> None:
        d = deployment(tiny_model, PlanningConfig(method="split", scheduler="tstp"))
        cluster = load_cluster(str(files("hetnode.testnet") / "clusters" / "local3.toml"))
        by_type = profile_table_for(cluster, d.spec, "roofline")
        # As the live coordinator's table has them: by node (its members' peer ids).
        profiles = replace(by_type, profiles={n.name: by_type.for_node(n.name, n.device) for n in cluster.nodes})
        placement = split_placement(cluster, d.spec, profiles)

        async def place(members: Any, kind: str = "operator") -> tuple[PlacementPlan, Any]:
            return placement, profiles

        d._place = place  # type: ignore[method-assign]
        assert await d.replan("test") is None
        assert d.plan is None and "scheduler 'tstp' routes by a plan's orchestration" in d.problem

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
