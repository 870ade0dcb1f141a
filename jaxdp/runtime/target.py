"""Compile-only GPUs: XLA compiles jaxdp's real step for GPUs that are not there.

    devices = compile_only_devices(Target.parse("h100", devices=8, hosts=4))   # 4 hosts x 8 H100s
    mesh = make_mesh(data=32, devices=devices)

JAX's CUDA plugin describes a GPU it does not have from a ``TargetConfig`` (the device's figures as
a text proto), and ``jax.experimental.topologies.get_topology_desc`` turns it into compile-only
devices: ``jit(f).lower(...).compile()`` runs XLA's whole GPU pipeline for them (fusion, the
latency-hiding scheduler, buffer assignment, ptxas for the target's architecture) and nothing
runs. One host of N GPUs is ``1x1xN``; H hosts of N each is ``1xHxN``, its devices on H processes,
so collectives get the replica groups of a real multi-host job.

**Where the plugin lives.** Installed into site-packages, the plugin registers at every backend
start of every ``import jax`` in that environment and, without a GPU, prints
``RuntimeError: Unable to load CUDA`` (or ``cudart_stub ... Could not find cuda drivers``)
there. So ``install()`` puts it in a directory of its own, ``plugin_dir()`` (one per jaxlib
version: the plugin must match jaxlib exactly), which only ``compile_only_devices`` adds to
``sys.path``, and registers it by hand. The CUDA constraints check (it needs a driver) is skipped
in that process, and only there. Works whether or not jax has started its CPU backend already.

**What the figures are.** ``GPUS``: the vendor's published numbers for each part (SM count,
clocks, memory size and bandwidth, L2, peak FLOP/s, NVLink and network per GPU), which XLA's cost
model and ``jaxdp inspect``'s estimated step time read. XLA keeps similar specs for its own tools
(``xla/tools/hlo_opt/gpu_specs/``). Nothing is measured: there is no autotuning without a GPU.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib.metadata import version
from typing import Dict, List, Optional, Tuple

ENV_DIR = "JAXDP_GPU_TARGET_DIR"  # overrides plugin_dir()
PLUGIN_PACKAGES = ("jax-cuda12-plugin", "jax-cuda12-pjrt")
NVCC_PACKAGE = "nvidia-cuda-nvcc-cu12"  # ptxas and libdevice, when no CUDA toolkit has them
TOOLKIT_DIRS = ("/usr/local/cuda", "/opt/cuda")


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


# ----------------------------------------------------------------------------- the plugin

def jaxlib_version() -> str:
    return version("jaxlib")


def plugin_dir() -> str:
    """Where ``install()`` puts the plugin: beside this environment, one directory per jaxlib version."""
    return os.environ.get(ENV_DIR) or os.path.join(sys.prefix, "jaxdp-gpu-target", f"jaxlib-{jaxlib_version()}")


def install_command() -> str:
    return f"{os.path.basename(sys.executable)} -m jaxdp.runtime.target install  (or: make install-gpu-target)"


def ptxas_available() -> bool:
    """Whether XLA will find ptxas: on PATH, in a CUDA toolkit, or from NVCC_PACKAGE in the plugin's directory."""
    if shutil.which("ptxas") or any(os.path.exists(os.path.join(d, "bin", "ptxas")) for d in TOOLKIT_DIRS):
        return True
    return os.path.exists(os.path.join(plugin_dir(), "nvidia", "cuda_nvcc", "bin", "ptxas"))


def install(quiet: bool = True) -> str:
    """Install the CUDA plugin and PJRT of jaxlib's exact version, and ptxas if no toolkit has it, into
    ``plugin_dir()`` (``pip --target --no-deps``: no CUDA runtime wheels, nothing in site-packages).
    Returns the directory. A second call with everything there installs nothing."""
    path, version = plugin_dir(), jaxlib_version()
    wanted = [f"{p}=={version}" for p in PLUGIN_PACKAGES] if not _plugin_installed(path) else []
    if not ptxas_available():
        wanted.append(NVCC_PACKAGE)
    if wanted:
        subprocess.run([sys.executable, "-m", "pip", "install", *(["-q"] if quiet else []), "--no-deps",
                        "--upgrade", "--target", path, *wanted], check=True)
    return path


def _plugin_installed(path: str) -> bool:
    return os.path.exists(os.path.join(path, "jax_plugins", "xla_cuda12", "__init__.py"))


def _cuda_data_dir(path: str) -> Optional[str]:
    """The pip-installed ptxas/libdevice in the plugin's directory, for ``--xla_gpu_cuda_data_dir``."""
    nvcc = os.path.join(path, "nvidia", "cuda_nvcc")
    return nvcc if os.path.exists(os.path.join(nvcc, "bin", "ptxas")) else None


def register_plugin() -> None:
    """Make jax's CUDA topology available in this process: the installed one if jax found a CUDA
    plugin by itself (a GPU host), else ours from ``plugin_dir()``. TargetError if there is none."""
    from jax._src import xla_bridge

    xla_bridge._discover_and_register_pjrt_plugins()  # what jax's own start-up does: idempotent
    if "cuda" in xla_bridge._topology_factories:
        return
    path = plugin_dir()
    if not _plugin_installed(path):
        raise TargetError(f"compiling for a GPU target needs JAX's CUDA plugin {jaxlib_version()}, not installed "
                          f"in {path}: run {install_command()}")
    if path not in sys.path:
        sys.path.append(path)  # after site-packages: nothing of ours shadows the environment's packages
    data_dir = _cuda_data_dir(path)
    if data_dir and "--xla_gpu_cuda_data_dir" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_cuda_data_dir={data_dir}".strip()
    # The plugin checks the CUDA runtime's versions, which need a driver: skipped in this process only.
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    _keep_cpu_default()
    with quiet_native_stderr():
        importlib.import_module("jax_plugins.xla_cuda12").initialize()


def _keep_cpu_default() -> None:
    """Before jax starts a backend, pin it to the CPU: the plugin registers a 'cuda' backend (priority
    over the CPU's) whose start would fail without a driver. Once a backend runs, nothing changes."""
    import jax
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized() and not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")


_NOISE = re.compile(r"cudart_stub\.cc|absl::InitializeLog|Could not find cuda drivers")


@contextlib.contextmanager
def quiet_native_stderr():
    """The plugin's native start-up lines about the missing driver dropped; anything else it writes kept."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().decode(errors="replace").splitlines() if not _NOISE.search(line)]
            if kept:
                print("\n".join(kept), file=sys.stderr)


def compile_only_devices(target: Target) -> List:
    """``target.devices`` compile-only GPUs (process by process, host by host) to build a mesh over."""
    from jax.experimental import topologies

    register_plugin()
    with quiet_native_stderr():
        topology = topologies.get_topology_desc(platform="cuda", target_config=target.gpu.config_text(),
                                                topology=target.topology)
    return sorted(topology.devices, key=lambda d: (d.process_index, d.id))


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args != ["install"]:
        print(f"usage: {os.path.basename(sys.executable)} -m jaxdp.runtime.target install", file=sys.stderr)
        return 2
    path = install(quiet=False)
    print(f"JAX's CUDA plugin {jaxlib_version()} for compile-only GPU targets: {path}"
          + ("" if ptxas_available() else " (no ptxas found: compiles will fail)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
