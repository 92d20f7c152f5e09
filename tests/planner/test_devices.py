from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetnode.errors import ConfigError
from hetnode.planner.devices import DEVICES, MAX_COUNT, known_devices, parse_device

# (FP16 TFLOP/s, memory GB, memory bandwidth GB/s), copied from the papers' tables by hand.
HELIX_TABLE_3 = {"h100": (1979, 80, 3350), "a100": (312, 40, 1555), "l4": (242, 24, 300), "t4": (65, 16, 300)}
# Memory and bandwidth from ThunderServe's Table 1; FLOP/s the dense FP16 tensor peak with FP32 accumulate from
# NVIDIA's data sheets and the GA102 whitepaper (Table 1's column mixes FP32 non-tensor and tensor peaks: A6000
# 38.7, A5000 27.8, 3090Ti 71, the RTX 3090's).
THUNDERSERVE_TABLE_1 = {
    "a100-80g": (312, 80, 2000),
    "a6000": (154.8, 48, 768),
    "a5000": (111.1, 24, 626.8),
    "a40": (149.7, 48, 696),
    "3090ti": (80.0, 24, 1008),
}
V100_DATA_SHEET = {"v100": (125, 16, 900)}
# Splitwise-HHcap's token machines: an H100 at a 50% power cap, its compute 1/1.3 (Splitwise's measured model).
SPLITWISE_CAPPED = {"h100-pcap": (1979 / 1.3, 80, 3350)}
# Cronus's low-end GPUs, from NVIDIA's A10 and A30 data sheets (dense FP16 tensor core).
CRONUS_DATA_SHEETS = {"a10": (125, 24, 600), "a30": (165, 24, 933)}
L20_DATA_SHEET = {"l20": (119.5, 48, 864)}  # EcoServe's cluster; dense FP16 tensor figure
A800_DATA_SHEET = {"a800": (312.0, 80, 1935)}  # EcoServe's second cluster: the A100 data sheet's 80 GB PCIe


@pytest.mark.parametrize("name, numbers", [*HELIX_TABLE_3.items(), *THUNDERSERVE_TABLE_1.items(),
                                           *V100_DATA_SHEET.items(), *SPLITWISE_CAPPED.items(),
                                           *CRONUS_DATA_SHEETS.items(), *L20_DATA_SHEET.items(),
                                           *A800_DATA_SHEET.items()])
def test_single_devices_match_the_tables(name: str, numbers: tuple[float, float, float]) -> None:
    spec = parse_device(name)
    assert (spec.fp16_tflops, spec.memory_gb, spec.mem_bandwidth_gbps) == numbers
    assert (spec.name, spec.kind, spec.count) == (name, name, 1)
    assert spec.memory_bytes == numbers[1] * 2**30


def test_every_table_device_is_known() -> None:
    expected = {*HELIX_TABLE_3, *THUNDERSERVE_TABLE_1, *V100_DATA_SHEET, *SPLITWISE_CAPPED, *CRONUS_DATA_SHEETS,
                *L20_DATA_SHEET, *A800_DATA_SHEET, "cpu"}
    assert set(known_devices()) == expected


@pytest.mark.parametrize("text", ["2xl4", "2XL4", " 2xL4 ", "2Xl4"])
def test_multi_gpu_specs_aggregate(text: str) -> None:
    spec = parse_device(text)
    l4 = DEVICES["l4"]
    assert (spec.name, spec.kind, spec.count) == ("2xl4", "l4", 2)
    assert spec.fp16_tflops == 2 * l4.fp16_tflops
    assert spec.memory_gb == 2 * l4.memory_gb
    assert spec.mem_bandwidth_gbps == 2 * l4.mem_bandwidth_gbps
    assert spec.per_device() == l4


def test_names_are_case_insensitive_and_a_count_of_one_is_the_plain_device() -> None:
    assert parse_device("T4") == parse_device("t4") == parse_device("1xt4")
    assert parse_device("4xT4").name == "4xt4"
    assert parse_device("2x3090Ti").kind == "3090ti"
    assert parse_device("3090ti").count == 1


@given(st.sampled_from(sorted(set(DEVICES) - {"cpu"})), st.integers(1, MAX_COUNT))
def test_any_count_of_any_gpu_scales_linearly(kind: str, count: int) -> None:
    spec = parse_device(f"{count}x{kind}")
    base = DEVICES[kind]
    assert spec.count == count
    assert spec.fp16_tflops == pytest.approx(count * base.fp16_tflops)
    assert spec.memory_gb == pytest.approx(count * base.memory_gb)
    assert spec.mem_bandwidth_gbps == pytest.approx(count * base.mem_bandwidth_gbps)


def test_cpu_is_a_placeholder_that_must_be_measured() -> None:
    assert parse_device("cpu").needs_measurement
    assert not any(spec.needs_measurement for name, spec in DEVICES.items() if name != "cpu")


@pytest.mark.parametrize("text, fragment", [
    ("b200", "unknown device 'b200'"),
    ("", "unknown device"),
    ("2x", "unknown device"),
    ("x2", "unknown device"),
    ("2xa100x", "unknown device"),
    ("0xl4", "count must be in 1..64"),
    ("65xl4", "count must be in 1..64"),
    ("2xcpu", "GPU types only"),
])
def test_bad_names_raise_config_error(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment) as info:
        parse_device(text)
    if "unknown" in fragment:
        for name in known_devices():
            assert name in info.value.problem
