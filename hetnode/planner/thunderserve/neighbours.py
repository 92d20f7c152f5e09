"""The four moves that make a deployment's neighbours (§3.2, Fig. 4), and the memory check on each.

- flip: one group changes phase;
- split: one group becomes two, each GPU type t cut by one random ratio r (floor(g_t r) GPUs to the first),
  phases drawn anew;
- merge: two groups become one, its phase drawn anew;
- move: m_t GPUs of one type t go from one group to another (1 <= m_t <= g_t, the first group kept
  non-empty), phases kept.

Which GPUs of a type move is the paper's open choice; here a split keeps a host's GPUs together as far as the
ratio allows (GPUs taken in host order), and a move takes first the GPUs on hosts the receiving group already
uses, so that moves tend to keep tensor parallel cells whole. A move that would leave a group empty, or a group
that cannot hold the weights (`holds_model`), gives no neighbour (None).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from hetnode.planner.model import ModelSpec
from hetnode.planner.thunderserve.deployment import Deployment, Group, flipped, holds_model
from hetnode.planner.thunderserve.gpus import GpuPool
from hetnode.planner.thunderserve.parallel import DECODE, PREFILL

Move = Callable[[Deployment, GpuPool, random.Random], Deployment | None]


def flip(dep: Deployment, pool: GpuPool, rng: random.Random) -> Deployment | None:
    i = rng.randrange(len(dep.groups))
    groups = list(dep.groups)
    groups[i] = Group(groups[i].gpus, flipped(groups[i].role))
    return Deployment.of(groups)


def split(dep: Deployment, pool: GpuPool, rng: random.Random) -> Deployment | None:
    i = rng.randrange(len(dep.groups))
    r = rng.random()
    first: list[int] = []
    second: list[int] = []
    for members in _by_type(pool, dep.groups[i].gpus).values():
        k = int(len(members) * r)
        first += members[:k]
        second += members[k:]
    if not first or not second:
        return None
    groups = [g for k, g in enumerate(dep.groups) if k != i]
    groups += [Group(tuple(first), _phase(rng)), Group(tuple(second), _phase(rng))]
    return Deployment.of(groups)


def merge(dep: Deployment, pool: GpuPool, rng: random.Random) -> Deployment | None:
    if len(dep.groups) < 2:
        return None
    i, j = rng.sample(range(len(dep.groups)), 2)
    groups = [g for k, g in enumerate(dep.groups) if k not in (i, j)]
    groups.append(Group(dep.groups[i].gpus + dep.groups[j].gpus, _phase(rng)))
    return Deployment.of(groups)


def move(dep: Deployment, pool: GpuPool, rng: random.Random) -> Deployment | None:
    if len(dep.groups) < 2:
        return None
    i, j = rng.sample(range(len(dep.groups)), 2)
    source, target = dep.groups[i], dep.groups[j]
    types = _by_type(pool, source.gpus)
    kind = rng.choice(sorted(types))
    m = rng.randint(1, len(types[kind]))
    if m == len(source.gpus):
        return None
    there = {pool.gpus[g].host for g in target.gpus}
    moving = sorted(types[kind], key=lambda g: (pool.gpus[g].host not in there, pool.gpus[g].host, g))[:m]
    groups = [g for k, g in enumerate(dep.groups) if k not in (i, j)]
    groups += [Group(tuple(g for g in source.gpus if g not in moving), source.role),
               Group(target.gpus + tuple(moving), target.role)]
    return Deployment.of(groups)


MOVES: dict[str, Move] = {"flip": flip, "split": split, "merge": merge, "move": move}


def neighbour(dep: Deployment, pool: GpuPool, model: ModelSpec, rng: random.Random,
              moves: tuple[str, ...]) -> Deployment | None:
    """One neighbour by a move drawn from `moves`, or None when the move fails or the memory check does."""
    found = MOVES[rng.choice(moves)](dep, pool, rng)
    if found is None or not all(holds_model(pool, g.gpus, model) for g in found.groups):
        return None
    return found


def _phase(rng: random.Random) -> str:
    return rng.choice((PREFILL, DECODE))


def _by_type(pool: GpuPool, gpus: tuple[int, ...]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for g in sorted(gpus, key=lambda g: (pool.gpus[g].host, g)):
        out.setdefault(pool.gpus[g].kind, []).append(g)
    return out
