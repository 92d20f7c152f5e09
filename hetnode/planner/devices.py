"""GPU device types from the papers' tables, and multi-GPU nodes built from them ("2xl4", "4xt4").

The numbers are the ones the papers print, so that a cost model built on them reproduces the papers'
setups; they are not always like for like, and a cost model should know where they differ:

- Helix, Table 3 (NVIDIA data sheets; SXM parts for H100 and A100): h100, a100 (40 GB), l4, t4.
  The H100 (1979) and L4 (242) FP16 figures are NVIDIA's "with 2:4 sparsity" numbers; the dense tensor-core
  figures are half of that (989.5 and 121). A100 (312) and T4 (65) are dense.
- ThunderServe, Table 1: a100-80g, a6000, a5000, a40, 3090ti, for memory and bandwidth. Its FLOP/s column is
  not like for like (A6000 38.7 and A5000 27.8 are FP32 non-tensor peaks, A40 149.7 the dense FP16 tensor peak,
  3090Ti 71 the RTX 3090's dense FP16 tensor peak with FP32 accumulate), and FP16 serving runs on the tensor
  cores, so these four take the figure a PyTorch fp16 matmul can reach: dense FP16 tensor with FP32 accumulate
  (cuBLAS accumulates fp16 GEMMs in FP32), from NVIDIA's data sheets and the Ampere GA102 whitepaper (v2.1,
  Table 9 / Appendix A; https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.1.pdf).
  Table 1's number stays in each source string. RTX A6000 154.8 (309.7 with sparsity; RTX A6000 data sheet),
  RTX A5000 111.1 (222.2 with sparsity; RTX A5000 data sheet), A40 149.7 (299.4; A40 data sheet): the
  professional parts run FP32 accumulate at the full tensor rate, 1,024 FLOP/clock per SM (84 SMs x 1.80 GHz,
  64 x 1.695, 84 x 1.74). GeForce GA102 runs FP32 accumulate at half that rate (whitepaper: RTX 3090 142 TFLOP/s
  with FP16 accumulate, 71 with FP32, 82 SMs x 1.695 GHz x 512); the RTX 3090 Ti, released after the
  whitepaper, has 84 SMs (10,752 CUDA cores) at 1.86 GHz boost (NVIDIA's RTX 3090 Ti specifications), so
  84 x 1.86 GHz x 512 = 80.0.
- a10 and a30 (Cronus §5.1's low-end GPUs; Cronus prints no table) come from NVIDIA's data sheets: A10 Tensor
  Core GPU (PCIe, 24 GB GDDR6, 600 GB/s, 125 TFLOP/s dense FP16/BF16 tensor core, 250 with sparsity;
  https://www.nvidia.com/en-us/data-center/products/a10-gpu/) and A30 Tensor Core GPU (PCIe, 24 GB HBM2,
  933 GB/s, 165 TFLOP/s dense FP16/BF16 tensor core, 330 with sparsity;
  https://www.nvidia.com/en-us/data-center/products/a30-gpu/). Both dense, as a100's 312.
- l20 (EcoServe's cluster) is in no paper's table: NVIDIA L20 data sheet, dense FP16 (119.5; 239 with sparsity).
- a800 (EcoServe's second cluster, "A800-80GB ... connected via PCIe only") is in no paper's table either: the
  A800 PCIe 80 GB is the A100 PCIe 80 GB's GA100 with NVLink capped at 400 GB/s, so the A100 data sheet's 80 GB
  PCIe figures: 312 TFLOP/s dense FP16/BF16 tensor (624 with sparsity), 80 GB HBM2e at 1,935 GB/s.
- v100 is not in either paper's table; its numbers come from the NVIDIA Tesla V100 data sheet (SXM2 16 GB,
  the part Google Compute Engine offers): 125 TFLOP/s tensor-core FP16, 900 GB/s HBM2.

Memory sizes are the marketed "GB", which for these parts are GiB of device memory (an "80 GB" H100 reports
81559 MiB); `DeviceSpec.memory_bytes` converts with 2**30.

A multi-GPU node ("2xl4") is modelled as one device whose FLOP/s, memory and memory bandwidth are the sums
over its GPUs: that is what tensor parallelism inside the node gives, less its communication overhead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from hetnode.errors import ConfigError

MAX_COUNT = 64  # the most GPUs one node may report (HardwareProfile.num_devices has the same bound)


@dataclass(frozen=True)
class DeviceSpec:
    """One node's accelerator: a device type from the tables, `count` of them, with aggregate numbers."""

    name: str  # canonical name: "a100", "2xl4"
    kind: str  # the single-device type: "l4" for "2xl4"
    count: int  # GPUs in the node
    fp16_tflops: float  # peak FP16 TFLOP/s, summed over the node's GPUs
    memory_gb: float  # device memory in GiB, summed over the node's GPUs
    mem_bandwidth_gbps: float  # device memory bandwidth in GB/s (bytes, as in HardwareProfile), summed
    source: str  # where the single-device numbers come from
    # True for "cpu": its numbers are nominal, so a node of this type must measure itself.
    needs_measurement: bool = False

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 2**30)

    def per_device(self) -> DeviceSpec:
        """The spec of one of this node's GPUs."""
        return DEVICES[self.kind]

    def times(self, count: int) -> DeviceSpec:
        """`count` of this node's GPUs (this must be a single-device spec)."""
        if self.count != 1:
            raise ValueError(f"{self.name} is already a multi-device spec")
        if not 1 <= count <= MAX_COUNT:
            raise ValueError(f"count must be in 1..{MAX_COUNT}, not {count}")
        if count == 1:
            return self
        return replace(
            self,
            name=f"{count}x{self.kind}",
            count=count,
            fp16_tflops=self.fp16_tflops * count,
            memory_gb=self.memory_gb * count,
            mem_bandwidth_gbps=self.mem_bandwidth_gbps * count,
        )


_HELIX = "Helix Table 3 (NVIDIA data sheet)"
_THUNDERSERVE = "ThunderServe Table 1"


def _spec(name: str, tflops: float, memory_gb: float, bandwidth: float, source: str,
          needs_measurement: bool = False) -> DeviceSpec:
    return DeviceSpec(name=name, kind=name, count=1, fp16_tflops=tflops, memory_gb=memory_gb,
                      mem_bandwidth_gbps=bandwidth, source=source, needs_measurement=needs_measurement)


DEVICES: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        _spec("h100", 1979.0, 80.0, 3350.0, _HELIX + "; FP16 figure is with sparsity"),
        # Splitwise-HHcap's token machines: an H100 capped at 50% of its power. Memory-bound work is unchanged and
        # compute-bound work takes 1.30x as long in Splitwise's measured model (planner/data/splitwise).
        _spec("h100-pcap", 1979.0 / 1.3, 80.0, 3350.0, "Splitwise §IV-D, Fig. 9: H100 SXM at a 50% power cap"),
        _spec("a100", 312.0, 40.0, 1555.0, _HELIX + "; A100 SXM 40 GB"),
        _spec("l4", 242.0, 24.0, 300.0, _HELIX + "; FP16 figure is with sparsity"),
        _spec("t4", 65.0, 16.0, 300.0, _HELIX),
        _spec("a100-80g", 312.0, 80.0, 2000.0, _THUNDERSERVE + "; A100 80 GB"),
        _spec("a6000", 154.8, 48.0, 768.0, _THUNDERSERVE + " (38.7, the FP32 non-tensor peak); FP16 figure: RTX A6000 "
              "data sheet, dense FP16 tensor with FP32 accumulate"),
        _spec("a5000", 111.1, 24.0, 626.8, _THUNDERSERVE + " (27.8, the FP32 non-tensor peak); FP16 figure: RTX A5000 "
              "data sheet, dense FP16 tensor with FP32 accumulate"),
        _spec("a40", 149.7, 48.0, 696.0, _THUNDERSERVE + " (149.7); A40 data sheet, dense FP16 tensor with FP32 "
              "accumulate"),
        _spec("3090ti", 80.0, 24.0, 1008.0, _THUNDERSERVE + " (71, the RTX 3090's figure); FP16 figure: GA102 "
              "whitepaper's GeForce rate (dense FP16 tensor, FP32 accumulate: 512 FLOP/clock/SM) x 84 SMs x 1.86 GHz"),
        _spec("a10", 125.0, 24.0, 600.0, "NVIDIA A10 data sheet (PCIe 24 GB); dense FP16 tensor core"),
        _spec("a30", 165.0, 24.0, 933.0, "NVIDIA A30 data sheet (PCIe 24 GB); dense FP16 tensor core"),
        _spec("v100", 125.0, 16.0, 900.0, "NVIDIA Tesla V100 data sheet (SXM2 16 GB)"),
        # EcoServe's cluster (§4.1): 8 L20 48 GB per node, PCIe only. NVIDIA L20 data sheet: 119.5 TFLOP/s dense
        # FP16/BF16 tensor (239 with sparsity), 48 GB GDDR6 at 864 GB/s, PCIe Gen4 x16.
        _spec("l20", 119.5, 48.0, 864.0, "NVIDIA L20 data sheet (dense FP16 tensor figure)"),
        _spec("a800", 312.0, 80.0, 1935.0, "NVIDIA A100 data sheet, 80 GB PCIe (the A800 PCIe 80 GB's GA100; dense "
              "FP16 tensor figure)"),
        # Nominal numbers (a few server cores with AVX2), so that a planner can still run over a CPU cluster
        # before any profile arrives; a cpu node always reports measured numbers (node/profile.py).
        _spec("cpu", 0.5, 16.0, 20.0, "nominal; measured on the host", needs_measurement=True),
    )
}

_NAME = re.compile(r"(?:(?P<count>\d+)x)?(?P<kind>[a-z0-9-]+)")


def known_devices() -> list[str]:
    return sorted(DEVICES)


def parse_device(name: str) -> DeviceSpec:
    """"a100", "L4", "2xl4", "4xT4" -> its DeviceSpec; raises ConfigError naming the known types."""
    text = name.strip().lower()
    match = _NAME.fullmatch(text)
    spec = DEVICES.get(match.group("kind")) if match else None
    if match is None or spec is None:
        raise ConfigError(
            f"unknown device {name!r}; known: {', '.join(known_devices())} "
            f"(optionally prefixed with a count, as in 2xl4)"
        )
    if match.group("count") is None:
        return spec
    count = int(match.group("count"))
    if spec.needs_measurement:
        raise ConfigError(f"device {name!r}: a count applies to GPU types only, not {spec.kind}")
    if not 1 <= count <= MAX_COUNT:
        raise ConfigError(f"device {name!r}: the count must be in 1..{MAX_COUNT}")
    return spec.times(count)
