"""Whole or layer-wise: transfers short on their link go whole after the step, long ones stream in bounded groups."""

from __future__ import annotations

import math

import pytest

from hetnode.policy import KVTransferPolicy
from hetnode.policy.kv_transfer import DEFAULT_MBPS, MAX_GROUPS, MIN_GROUP_BYTES, MIN_LAYERWISE_S, transfer_policy

FP16 = 768.0  # bytes per token-layer of SmolLM2-135M's KV in fp16 (3 KV heads x 64 x K and V x 2 bytes)


def test_short_transfers_go_whole_and_long_ones_layer_by_layer() -> None:
    policy = KVTransferPolicy()
    threshold_bytes = MIN_LAYERWISE_S * DEFAULT_MBPS * 1e6 / 8  # an unmeasured link is taken to be 100 Mbit/s
    tokens = int(threshold_bytes / (30 * FP16))  # just below it
    small = policy.choose(tokens, 30, FP16)
    assert (small.mode, small.group_layers, small.groups) == ("whole", 30, 1)
    assert small.wire_bytes == tokens * 30 * 768 and small.serial_s < MIN_LAYERWISE_S
    large = policy.choose(512, 30, FP16)  # 11.8 MB: 0.94 s at 100 Mbit/s
    assert large.mode == "layerwise" and large.wire_bytes == 512 * 30 * 768
    assert large.serial_s == pytest.approx(512 * 30 * 768 * 8 / 100e6)
    # 393 KB a layer: no byte floor binds, so the group count does: 30 layers in groups of 2.
    assert (large.group_layers, large.groups) == (2, 15) and large.groups <= MAX_GROUPS


def test_the_same_transfer_streams_on_a_slow_link_and_goes_whole_on_a_fast_one() -> None:
    policy = KVTransferPolicy()
    assert policy.choose(64, 30, FP16, link_mbps=100.0).mode == "layerwise"  # 1.5 MB: 118 ms
    assert policy.choose(64, 30, FP16, link_mbps=1000.0).mode == "whole"  # 12 ms
    assert policy.choose(128, 30, FP16, link_mbps=1000.0).mode == "layerwise"  # 24 ms
    assert policy.choose(4096, 30, FP16, link_mbps=math.inf).mode == "whole"  # no time on the wire at all
    assert policy.choose(64, 30, FP16, link_mbps=None) == policy.choose(64, 30, FP16, link_mbps=DEFAULT_MBPS)


def test_groups_are_at_least_min_group_bytes_and_at_most_max_groups() -> None:
    policy = KVTransferPolicy(min_layerwise_s=0)
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
    assert KVTransferPolicy(min_layerwise_s=math.inf).choose(4096, 30, FP16).mode == "whole"
    every_layer = KVTransferPolicy(min_layerwise_s=0, min_group_bytes=0, max_groups=1 << 20)
    c = every_layer.choose(1, 30, 1.0)
    assert (c.mode, c.group_layers, c.groups) == ("layerwise", 1, 30)
    assert every_layer.choose(1, 1, 1.0).mode == "whole"  # one layer is one message either way
    bad_policies = ({"min_layerwise_s": -1.0}, {"min_layerwise_s": math.nan}, {"min_group_bytes": -1},
                    {"max_groups": 1}, {"default_mbps": 0.0}, {"default_mbps": math.inf})
    for bad in bad_policies:
        with pytest.raises(ValueError):
            KVTransferPolicy(**bad)  # type: ignore[arg-type]
    bad_args = ((0, 30, FP16), (8, 0, FP16), (8, 30, 0.0), (8, 30, math.inf), (8, 30, math.nan))
    for args in bad_args:
        with pytest.raises(ValueError):
            KVTransferPolicy().choose(*args)
    for mbps in (0.0, -5.0, math.nan):
        with pytest.raises(ValueError):
            KVTransferPolicy().choose(8, 30, FP16, link_mbps=mbps)


def test_a_node_may_be_told_to_send_every_transfer_whole_or_layer_wise() -> None:
    """`--kv-transfer`: the policy by size, or one mode for every transfer (to measure them side by side)."""
    big = (2048, 30, 384.0, 100.0)  # SmolLM2's fp16 KV of 2,048 tokens over 100 Mbit/s: seconds on the wire
    small = (16, 30, 384.0, 100_000.0)  # a short prompt over a fast link: well under the threshold
    assert transfer_policy("policy").choose(*big).mode == "layerwise"
    assert transfer_policy("policy").choose(*small).mode == "whole"
    assert transfer_policy("whole").choose(*big).mode == "whole"
    assert transfer_policy("layerwise").choose(*big).mode == "layerwise"
    assert transfer_policy("layerwise").choose(*small).mode == "layerwise"
    with pytest.raises(ValueError, match="policy, layerwise, whole"):
        transfer_policy("sometimes")
