"""The upper level's solution (§3.2): GPUs grouped into model replicas, each with a phase; and the first one.

A `Deployment` is canonical (groups sorted by their GPUs, each group's GPUs sorted), so that two ways of
reaching the same solution compare equal in the tabu list.

The first deployment clusters the GPUs hierarchically by their bandwidth (agglomerative, average linkage on
distance 1 / bandwidth, scipy), so that the groups avoid the slowest links; it takes the finest cut of the
dendrogram in which every group can hold one copy of the weights (the paper does not say where it cuts). When
no cut does (GPUs left over from hosts that lost some), the groups too small join their nearest ones.
Phases are drawn at random (seeded); when the draw gives every group the same phase one group is flipped,
since a deployment without both phases serves nothing.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
from scipy.cluster.hierarchy import fcluster, linkage
from scipy.spatial.distance import squareform

from hetnode.planner.model import ModelSpec
from hetnode.planner.thunderserve.gpus import GpuPool
from hetnode.planner.thunderserve.parallel import DECODE, PREFILL


@dataclass(frozen=True, order=True)
class Group:
    gpus: tuple[int, ...]  # sorted pool indices
    role: str  # "prefill" or "decode"


@dataclass(frozen=True)
class Deployment:
    groups: tuple[Group, ...]  # sorted

    @staticmethod
    def of(groups: list[Group]) -> Deployment:
        return Deployment(tuple(sorted(Group(tuple(sorted(g.gpus)), g.role) for g in groups)))

    @property
    def gpu_count(self) -> int:
        return sum(len(g.gpus) for g in self.groups)


def holds_model(pool: GpuPool, gpus: tuple[int, ...], model: ModelSpec) -> bool:
    """§3.2's early check: the group's memory holds one copy of the weights."""
    return sum(pool.gpus[g].memory_bytes for g in gpus) >= model.num_layers * model.layer_bytes


def flipped(role: str) -> str:
    return DECODE if role == PREFILL else PREFILL


def initial(pool: GpuPool, model: ModelSpec, rng: random.Random) -> Deployment | None:
    """The clustered first deployment (module docstring); None when the pool cannot hold the model twice."""
    n = len(pool)
    if n < 2:
        return None
    distance = np.zeros((n, n))
    for a in range(n):
        for b in range(a + 1, n):
            bw = (pool.bandwidth[a][b] + pool.bandwidth[b][a]) / 2
            distance[a, b] = distance[b, a] = 1.0 / bw if bw > 0 else 1e6
    tree = linkage(squareform(distance, checks=False), method="average")
    cuts = []
    for k in range(n, 1, -1):
        labels = fcluster(tree, k, criterion="maxclust")
        groups: dict[int, list[int]] = {}
        for g, label in enumerate(labels):
            groups.setdefault(int(label), []).append(g)
        cuts.append([tuple(v) for _, v in sorted(groups.items())])
    for members in cuts:
        if len(members) >= 2 and all(holds_model(pool, m, model) for m in members):
            return _with_phases(members, rng)
    # No cut holds the weights in every group (GPUs left over from hosts that lost some, say): in the finest
    # cut that still has two groups once they are merged, each group too small joins its nearest one.
    for members in cuts:
        merged = _merge_small(pool, model, members, distance)
        if len(merged) >= 2:
            return _with_phases(merged, rng)
    return None


def _with_phases(members: list[tuple[int, ...]], rng: random.Random) -> Deployment:
    roles = [rng.choice((PREFILL, DECODE)) for _ in members]
    if len(set(roles)) == 1:
        roles[0] = flipped(roles[0])
    return Deployment.of([Group(m, r) for m, r in zip(members, roles, strict=True)])


def _merge_small(pool: GpuPool, model: ModelSpec, members: list[tuple[int, ...]],
                 distance: np.ndarray) -> list[tuple[int, ...]]:
    """Each group that cannot hold the weights, least memory first, merged into the group nearest it
    (average distance)."""
    groups = list(members)
    while len(groups) > 1:
        small = [i for i, m in enumerate(groups) if not holds_model(pool, m, model)]
        if not small:
            return groups
        i = min(small, key=lambda i: (sum(pool.gpus[g].memory_bytes for g in groups[i]), groups[i]))
        j = min((j for j in range(len(groups)) if j != i),
                key=lambda j: (float(distance[np.ix_(groups[i], groups[j])].mean()), groups[j]))
        groups[j] = tuple(sorted(groups[j] + groups[i]))
        del groups[i]
    return groups if groups and holds_model(pool, groups[0], model) else []
