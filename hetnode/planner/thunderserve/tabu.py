"""Algorithm 1: tabu search over deployments, from the clustered first one.

Each step proposes N_neigh neighbours of the current deployment (neighbours.py; a failed move or memory check
proposes nothing), drops those in the tabu list, and moves to the best of the rest even when it is worse than
the current one (which is how tabu search leaves local optima); the best deployment seen is the answer. The
tabu list holds the last N_mem deployments moved to, and starts empty (Algorithm 1, line 3): the first
deployment is not tabu, so a walk may come back through it. Everything random comes from one seeded generator,
and the work is counted in steps and evaluations, never in seconds, so a seed gives one plan on any machine.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from hetnode.planner.model import ModelSpec
from hetnode.planner.thunderserve.deployment import Deployment
from hetnode.planner.thunderserve.gpus import GpuPool
from hetnode.planner.thunderserve.lower import LowerLevel, Solution
from hetnode.planner.thunderserve.neighbours import neighbour

Progress = Callable[[int, Solution], None]  # (step, best so far): hears every improvement


@dataclass(frozen=True)
class SearchLog:
    steps: int
    proposed: int  # neighbours that passed the moves and the memory check
    evaluations: int  # lower-level solves
    improvements: int
    best_step: int  # the step that found the best (0: the first deployment)


def tabu_search(start: Deployment, pool: GpuPool, model: ModelSpec, lower: LowerLevel, rng: random.Random,
                *, steps: int, neighbours: int, memory: int, moves: tuple[str, ...],
                progress: Progress | None = None) -> tuple[Solution, SearchLog]:
    first = lower.solve(start)
    if first is None:
        raise ValueError("the first deployment has a group without a layout")
    current, best = first, first
    tabu: list[Deployment] = []
    proposed = improvements = best_step = 0
    for step in range(1, steps + 1):
        seen: set[Deployment] = set()
        candidates: list[Solution] = []
        for _ in range(neighbours):
            found = neighbour(current.deployment, pool, model, rng, moves)
            if found is None or found in tabu or found in seen:
                continue
            seen.add(found)
            proposed += 1
            solved = lower.solve(found)
            if solved is not None:
                candidates.append(solved)
        if not candidates:
            continue
        current = max(candidates, key=lambda s: s.score)
        if current.score > best.score:
            best, best_step = current, step
            improvements += 1
            if progress is not None:
                progress(step, best)
        tabu.append(current.deployment)
        if len(tabu) > memory:
            tabu = tabu[-memory:]
    return best, SearchLog(steps=steps, proposed=proposed, evaluations=lower.evaluations,
                           improvements=improvements, best_step=best_step)
