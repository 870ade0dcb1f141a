"""The GPUs jaxdp compiles for without having them, as data: each part's published figures, and
a target (hosts of N GPUs of one part) parsed from ``--target NAME --devices N --hosts H``.

``GPUS``: the vendor's published numbers for each part (SM count, clocks, memory size and
bandwidth, L2, peak FLOP/s, NVLink and network per GPU), which XLA's cost model (through
``Gpu.config_text``, a ``GpuTargetConfigProto``) and ``jaxdp inspect``'s estimated step time read.
XLA keeps similar specs for its own tools (``xla/tools/hlo_opt/gpu_specs/``). Nothing here is
measured: there is no autotuning without a GPU. A new part is one more row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple


class TargetError(ValueError):
    """A target that cannot be compiled for here (one line: what to do)."""


@dataclass(frozen=True)
class Gpu:
    """One GPU part as its vendor publishes it (dense peaks, no sparsity; bytes per second per direction)."""

    name: str
    description: str  # the device kind the compile-only devices report
    compute_capability: Tuple[int, int]
    sm_count: int
    clock_ghz: float  # boost
    fp32_cores_per_sm: int
    memory_bytes: int  # what the device reports (nvidia-smi's total)
    memory_bandwidth: float  # HBM, bytes/s
    l2_bytes: int
    shared_per_sm: int
    shared_per_block_optin: int
    peak_flops: Dict[str, float]  # by dtype: bf16/f16 tensor cores, tf32, f32 (no tensor cores), f64 (tensor cores)
    nvlink_bandwidth: float  # bytes/s each way per GPU, within a host
    network_bandwidth: float  # bytes/s each way per GPU, across hosts (one NIC per GPU, as in a DGX)

    def config_text(self) -> str:
        """The ``GpuTargetConfigProto`` text XLA compiles for."""
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: {self.shared_per_block_optin}
  shared_memory_per_core: {self.shared_per_sm}
  threads_per_core_limit: 2048
  core_count: {self.sm_count}
  fpus_per_core: {self.fp32_cores_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.memory_bandwidth)}
  l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory_bytes}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 patch: 0 }}
runtime_version {{ major: 12 minor: 8 }}
device_description_str: "{self.description}"
"""


_HOPPER_PEAKS = {"bfloat16": 989.4e12, "float16": 989.4e12, "tf32": 494.7e12, "float32": 66.9e12, "float64": 66.9e12}
GPUS: Dict[str, Gpu] = {g.name: g for g in (
    # NVIDIA H100 SXM5 80GB datasheet; 81,559 MiB reported; NVLink 4: 900 GB/s total; DGX H100: a 400 Gb/s NIC per GPU.
    Gpu("h100", "NVIDIA H100 80GB HBM3", (9, 0), 132, 1.98, 128, 81559 * 2**20, 3.35e12, 50 * 2**20, 228 * 1024,
        227 * 1024, _HOPPER_PEAKS, 450e9, 50e9),
    # NVIDIA H200 SXM 141GB: H100's compute with HBM3e; 143,771 MiB reported; DGX H200 networking as DGX H100.
    Gpu("h200", "NVIDIA H200", (9, 0), 132, 1.98, 128, 143771 * 2**20, 4.8e12, 50 * 2**20, 228 * 1024, 227 * 1024,
        _HOPPER_PEAKS, 450e9, 50e9),
    # NVIDIA A100 SXM4 80GB datasheet; NVLink 3: 600 GB/s total; DGX A100: a 200 Gb/s NIC per GPU.
    Gpu("a100", "NVIDIA A100-SXM4-80GB", (8, 0), 108, 1.41, 64, 81920 * 2**20, 2.039e12, 40 * 2**20, 164 * 1024,
        163 * 1024, {"bfloat16": 312e12, "float16": 312e12, "tf32": 156e12, "float32": 19.5e12, "float64": 19.5e12},
        300e9, 25e9),
)}


@dataclass(frozen=True)
class Target:
    """``hosts`` hosts of ``devices_per_host`` GPUs of one kind: what a compile is for."""

    gpu: Gpu
    devices_per_host: int = 1
    hosts: int = 1

    @classmethod
    def parse(cls, name: str, devices: Optional[int] = None, hosts: Optional[int] = None) -> "Target":
        """``--target NAME [--devices N] [--hosts H]``: N GPUs per host (default 8), H hosts (default 1)."""
        gpu = GPUS.get(str(name).lower())
        if gpu is None:
            raise TargetError(f"unknown GPU target {name!r}; choose from {', '.join(GPUS)}")
        devices, hosts = 8 if devices is None else devices, 1 if hosts is None else hosts
        for flag, value in (("--devices", devices), ("--hosts", hosts)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TargetError(f"{flag} must be a positive integer with --target, got {value!r}")
        return cls(gpu, devices, hosts)

    @property
    def devices(self) -> int:
        return self.devices_per_host * self.hosts

    @property
    def topology(self) -> str:
        return f"1x{self.hosts}x{self.devices_per_host}"

    def describe(self) -> str:
        per_host = f"{self.devices_per_host} {self.gpu.name.upper()}"
        return f"{self.hosts} hosts x {per_host}" if self.hosts > 1 else f"{per_host} (one host)"
