"""Compute emulation on the testnet: an emulated GPU's step lasts as long, relative to the other nodes, as
that device's modelled step would.

The pace of a step is `dilation` times the roofline time (`hetnode.planner.costmodel`) of the emulated device
for the step's tokens and context, over the layers this node holds; the batch loop stretches the real step to
that (a real step that is already longer stays as it is). With the default dilation of 100, a T4 holding 8 of
SmolLM2's layers takes ~20 ms per decode step and an A100 ~4 ms, far above the scheduling noise of one
2-core machine, so the heterogeneity the planner sees is the one the testnet runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hetnode.node.batcher import Pace
from hetnode.node.engine import StepItem, TorchEngine
from hetnode.planner.costmodel import layer_shape, step_time
from hetnode.planner.devices import parse_device


def pace_factory(device: str, dilation: float) -> Callable[[TorchEngine], Pace]:
    spec = parse_device(device)

    def make(engine: TorchEngine) -> Pace:
        shape = layer_shape(engine.config)
        layers = engine.last_layer - engine.first_layer

        def pace(items: Sequence[StepItem]) -> float:
            new = sum(it.num_tokens for it in items)
            context = sum(it.start + it.num_tokens for it in items)
            pairs = sum(it.num_tokens * (it.start + it.num_tokens) for it in items)
            return dilation * step_time(spec, shape, layers, new, context, attended_pairs=pairs)

        return pace

    return make
