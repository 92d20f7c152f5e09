"""A node's hardware profile: measured on the host, or taken from the papers' tables when emulating a GPU.

Measuring is deliberately cheap (well under a second), because a node measures at every start: a matmul
whose size grows until one run takes long enough to time, best of a few runs, and a large tensor copy for
memory bandwidth. Peaks are what the planner's roofline needs, so every number is a best, not a mean.
"""

from __future__ import annotations

import platform
import re
import time
from collections.abc import Callable

import psutil
import torch

from hetnode.errors import ConfigError
from hetnode.planner.devices import parse_device
from hetnode.protocol.messages import HardwareProfile

SERVING_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

# One timed run should take at least this long, so that timer resolution and launch overhead do not count,
# and the matmul stops growing before one run would take longer than the max (CPU float16 is very slow).
_MIN_RUN_S = 0.01
_MAX_RUN_S = 0.1
_RUNS = 3
_MAX_MATMUL_N = {"cpu": 2048, "cuda": 8192}
_COPY_BYTES = {"cpu": 64 << 20, "cuda": 512 << 20}
_NAME_LIMIT = 128  # HardwareProfile's Name bound

# Table device types recognised in CUDA device names, most specific first ("NVIDIA L40S" is not an "l4").
_GPU_TYPES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"\ba100\b.*\b80\s*gb\b"), "a100-80g"),
    (re.compile(r"\ba100\b"), "a100"),
    (re.compile(r"\bh100\b"), "h100"),
    (re.compile(r"\bv100\b"), "v100"),
    (re.compile(r"\bl4\b"), "l4"),
    (re.compile(r"\bt4\b"), "t4"),
    (re.compile(r"\ba6000\b"), "a6000"),
    (re.compile(r"\ba5000\b"), "a5000"),
    (re.compile(r"\ba40\b"), "a40"),
    (re.compile(r"\b3090\s*ti\b"), "3090ti"),
]


def measure_profile(device: str = "cpu", dtype: str = "float32") -> HardwareProfile:
    """Measure this host's `device` ("cpu", "cuda", "cuda:1") for serving in `dtype`."""
    torch_dtype = _serving_dtype(dtype)
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r}: CUDA is not available on this host")
        gpu_name = torch.cuda.get_device_name(dev)
        free_bytes, _total = torch.cuda.mem_get_info(dev)
        name, device_type, memory = f"cuda:{gpu_name}", gpu_device_type(gpu_name), free_bytes
    elif dev.type == "cpu":
        # Available rather than total: on a CPU host the OS and other processes share the memory.
        name, device_type, memory = f"cpu:{cpu_model()}", "cpu", psutil.virtual_memory().available
    else:
        raise ConfigError(f"device {device!r}: only cpu and cuda can be measured")
    return HardwareProfile(
        device=name[:_NAME_LIMIT],
        device_type=device_type,
        num_devices=1,
        memory_bytes=int(memory),
        matmul_tflops=measure_matmul_tflops(dev, torch_dtype),
        mem_bandwidth_gbps=measure_copy_gbps(dev, memory),
        dtype=dtype,
        emulated=False,
        host=platform.node()[:_NAME_LIMIT],
    )


def emulated_profile(device: str, dtype: str = "float16") -> HardwareProfile:
    """The profile of a table device type ("a100", "2xl4"); its numbers are the table's FP16 peaks.

    `dtype` records what the node serves in; the tables have FP16 numbers only, so it does not change them."""
    _serving_dtype(dtype)
    spec = parse_device(device)
    if spec.needs_measurement:
        raise ConfigError(f"device {device!r} has no table numbers to emulate; measure it instead")
    return HardwareProfile(
        device=spec.name,
        device_type=spec.name,
        num_devices=spec.count,
        memory_bytes=spec.memory_bytes,
        matmul_tflops=spec.fp16_tflops,
        mem_bandwidth_gbps=spec.mem_bandwidth_gbps,
        dtype=dtype,
        emulated=True,
        host=platform.node()[:_NAME_LIMIT],
    )


def gpu_device_type(gpu_name: str) -> str:
    """The cost-table key for a CUDA device name: "NVIDIA A100-SXM4-80GB" -> "a100-80g"."""
    lowered = gpu_name.lower().replace("-", " ")
    for pattern, key in _GPU_TYPES:
        if pattern.search(lowered):
            return key
    return re.sub(r"[^a-z0-9]+", "-", lowered).strip("-")[:_NAME_LIMIT] or "cuda"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass  # not Linux: fall back to what the platform module knows
    return platform.processor() or platform.machine() or "unknown"


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype) -> float:
    """Best-of-a-few square matmul throughput; n doubles until one run is long enough to time."""
    limit = _MAX_MATMUL_N.get(device.type, 2048)
    n = 128
    while True:
        n *= 2
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        out = torch.empty(n, n, device=device, dtype=dtype)
        op = _matmul(a, b, out)
        times = _timed_runs(op, device, runs=1)
        if times[0] >= _MIN_RUN_S or times[0] * 8 > _MAX_RUN_S or n >= limit:
            break
    times += _timed_runs(op, device, runs=_RUNS - 1, warm=False)
    return 2 * n**3 / min(times) / 1e12


def _matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> Callable[[], object]:
    return lambda: torch.matmul(a, b, out=out)


def measure_copy_gbps(device: torch.device, free_bytes: int) -> float:
    """Best-of-a-few copy bandwidth, counting the bytes read and the bytes written (as data sheets do)."""
    # Large enough to spill out of the last-level cache (a server CPU has tens of MiB of it).
    nbytes = min(_COPY_BYTES.get(device.type, 64 << 20), max(free_bytes // 8, 1 << 20))
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = _timed_runs(lambda: dst.copy_(src), device, runs=_RUNS)
    return 2 * src.nelement() * src.element_size() / min(times) / 1e9


def _timed_runs(op: Callable[[], object], device: torch.device, runs: int, warm: bool = True) -> list[float]:
    """Wall time of `runs` calls of op; the warm-up call pays for first-touch page faults and kernel choice."""
    sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else _no_sync
    if warm:
        op()
        sync()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        op()
        sync()
        times.append(max(time.perf_counter() - start, 1e-9))
    return times


def _no_sync() -> None:
    pass  # CPU ops are synchronous


def _serving_dtype(dtype: str) -> torch.dtype:
    try:
        return SERVING_DTYPES[dtype]
    except KeyError:
        raise ConfigError(f"dtype {dtype!r}: serving dtypes are {', '.join(SERVING_DTYPES)}") from None
