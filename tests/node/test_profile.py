from __future__ import annotations

import msgspec
import pytest
import torch

from hetnode.errors import ConfigError
from hetnode.node.profile import emulated_profile, gpu_device_type, measure_profile
from hetnode.planner.devices import DEVICES
from hetnode.protocol.messages import HardwareProfile


def test_measure_cpu_profile_is_positive_and_valid_on_the_wire() -> None:
    profile = measure_profile("cpu", "float32")
    assert profile.device.startswith("cpu:")
    assert profile.device_type == "cpu"
    assert profile.num_devices == 1
    assert not profile.emulated
    assert profile.dtype == "float32"
    assert profile.memory_bytes > 0
    # Sanity bounds: any CPU beats 1 GFLOP/s and 0.5 GB/s, and none reaches 100 TFLOP/s or 10 TB/s.
    assert 1e-3 < profile.matmul_tflops < 100
    assert 0.5 < profile.mem_bandwidth_gbps < 10_000
    wire = msgspec.msgpack.encode(profile)
    assert msgspec.msgpack.decode(wire, type=HardwareProfile) == profile


def test_measure_in_bfloat16() -> None:
    profile = measure_profile("cpu", "bfloat16")
    assert profile.dtype == "bfloat16"
    assert profile.matmul_tflops > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_measure_cuda_profile() -> None:
    profile = measure_profile("cuda", "float16")
    assert profile.device.startswith("cuda:")
    assert profile.matmul_tflops > 1
    assert profile.mem_bandwidth_gbps > 50


def test_measuring_cuda_without_cuda_is_a_config_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        measure_profile("cuda")


def test_unknown_dtype_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="serving dtypes"):
        measure_profile("cpu", "int8")
    with pytest.raises(ConfigError, match="serving dtypes"):
        emulated_profile("a100", "float64")


@pytest.mark.parametrize("name", sorted(set(DEVICES) - {"cpu"}))
def test_emulated_profiles_match_the_tables(name: str) -> None:
    spec = DEVICES[name]
    profile = emulated_profile(name.upper(), "float16")
    assert profile.emulated
    assert (profile.device, profile.device_type, profile.num_devices) == (name, name, 1)
    assert profile.matmul_tflops == spec.fp16_tflops
    assert profile.mem_bandwidth_gbps == spec.mem_bandwidth_gbps
    assert profile.memory_bytes == spec.memory_gb * 2**30


def test_emulated_multi_gpu_profile_aggregates() -> None:
    profile = emulated_profile("2xl4", "bfloat16")
    assert (profile.device_type, profile.num_devices, profile.dtype) == ("2xl4", 2, "bfloat16")
    assert profile.matmul_tflops == 2 * 242
    assert profile.mem_bandwidth_gbps == 2 * 300
    assert profile.memory_bytes == 48 * 2**30


def test_cpu_and_unknown_devices_cannot_be_emulated() -> None:
    with pytest.raises(ConfigError, match="measure it instead"):
        emulated_profile("cpu")
    with pytest.raises(ConfigError, match="unknown device"):
        emulated_profile("b200")


@pytest.mark.parametrize("gpu_name, key", [
    ("NVIDIA A100-SXM4-40GB", "a100"),
    ("NVIDIA A100-SXM4-80GB", "a100-80g"),
    ("NVIDIA A100 80GB PCIe", "a100-80g"),
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA L4", "l4"),
    ("NVIDIA L40S", "nvidia-l40s"),
    ("Tesla T4", "t4"),
    ("Tesla V100-SXM2-16GB", "v100"),
    ("NVIDIA RTX A6000", "a6000"),
    ("NVIDIA RTX A5000", "a5000"),
    ("NVIDIA A40", "a40"),
    ("NVIDIA RTX A4000", "nvidia-rtx-a4000"),
    ("NVIDIA GeForce RTX 3090 Ti", "3090ti"),
    ("NVIDIA GeForce RTX 3090", "nvidia-geforce-rtx-3090"),
])
def test_gpu_names_map_to_table_keys(gpu_name: str, key: str) -> None:
    assert gpu_device_type(gpu_name) == key
