"""Whole or layer-wise: small transfers go whole after the step, large ones stream in bounded groups of layers."""

from __future__ import annotations

import pytest

from hetnode.policy import KVTransferPolicy
from hetnode.policy.kv_transfer import MAX_GROUPS, MIN_GROUP_BYTES, MIN_LAYERWISE_BYTES

FP16 = 768.0  # bytes per token-layer of SmolLM2-135M's KV in fp16 (3 KV heads x 64 x K and V x 2 bytes)


def test_small_transfers_go_whole_and_large_ones_layer_by_layer() -> None:
    policy = KVTransferPolicy()
    tokens = int(MIN_LAYERWISE_BYTES / (30 * FP16))  # just below the threshold
    small = policy.choose(tokens, 30, FP16)
    assert (small.mode, small.group_layers, small.groups) == ("whole", 30, 1)
    assert small.wire_bytes == tokens * 30 * 768 < MIN_LAYERWISE_BYTES
    large = policy.choose(512, 30, FP16)  # 11.8 MB
    assert large.mode == "layerwise" and large.wire_bytes == 512 * 30 * 768
    # 393 KB a layer: no byte floor binds, so the group count does: 30 layers in groups of 2.
    assert (large.group_layers, large.groups) == (2, 15) and large.groups <= MAX_GROUPS


def test_groups_are_at_least_min_group_bytes_and_at_most_max_groups() -> None:
    policy = KVTransferPolicy(min_layerwise_bytes=0)
    for tokens in (1, 7, 64, 200, 512, 4096):
        for layers in (1, 2, 5, 30, 80):
            c = policy.choose(tokens, layers, 216.0)
            if c.mode == "whole":
                assert (c.group_layers, c.groups) == (layers, 1)
                continue
            assert 2 <= c.groups <= MAX_GROUPS and c.groups == -(-layers // c.group_layers)
            assert c.group_layers * tokens * 216.0 >= MIN_GROUP_BYTES  # every group but maybe the last
    # A layer far below the floor: groups of many layers, or whole when one group would hold them all.
    assert policy.choose(64, 30, 216.0).group_layers == 5  # 13.8 KB a layer, 64 KiB floor
    assert policy.choose(8, 30, 216.0).mode == "whole"  # 1.7 KB a layer: 38 layers for one group


def test_thresholds_are_configurable_and_checked() -> None:
    assert KVTransferPolicy(min_layerwise_bytes=1 << 62).choose(4096, 30, FP16).mode == "whole"
    every_layer = KVTransferPolicy(min_layerwise_bytes=0, min_group_bytes=0, max_groups=1 << 20)
    c = every_layer.choose(1, 30, 1.0)
    assert (c.mode, c.group_layers, c.groups) == ("layerwise", 1, 30)
    assert every_layer.choose(1, 1, 1.0).mode == "whole"  # one layer is one message either way
    for bad in ({"min_layerwise_bytes": -1}, {"min_group_bytes": -1}, {"max_groups": 1}):
        with pytest.raises(ValueError):
            KVTransferPolicy(**bad)  # type: ignore[arg-type]
    for args in ((0, 30, FP16), (8, 0, FP16), (8, 30, 0.0), (8, 30, float("inf")), (8, 30, float("nan"))):
        with pytest.raises(ValueError):
            KVTransferPolicy().choose(*args)
