"""Compile-only GPUs: XLA compiles jaxdp's real step for GPUs that are not there.

    devices = compile_only_devices(Target.parse("h100", devices=8, hosts=4))   # 4 hosts x 8 H100s
    mesh = make_mesh(data=32, devices=devices)

``jit(f).lower(...).compile()`` over such devices runs XLA's whole GPU pipeline for them (fusion,
the latency-hiding scheduler, buffer assignment, ptxas for the target's architecture) and nothing
runs. One host of N GPUs is ``1x1xN``; H hosts of N each is ``1xHxN``, its devices on H processes,
so collectives get the replica groups of a real multi-host job.

Three jobs, three modules; their public names are imported from here:

- ``gpu_specs``: the GPU parts as data (``GPUS``: the vendor's published figures) and ``Target``;
- ``gpu_install``: the installer, ``python -m jaxdp.runtime.target install`` (``make
  install-gpu-target``), which puts JAX's CUDA plugin in ``plugin_dir()``, never site-packages;
- ``gpu_plugin``: the loader, which registers it in this process only and makes the devices
  (``compile_only_devices``).

jax-free at import (``jaxdp inspect``'s parser reads the table).
"""

from __future__ import annotations

import sys

from jaxdp.runtime.gpu_install import (  # noqa: F401  (the installer's names, read from here)
    ENV_DIR,
    NVCC_PACKAGE,
    PLUGIN_PACKAGES,
    TOOLKIT_DIRS,
    install,
    install_command,
    jaxlib_version,
    main,
    plugin_dir,
    ptxas_available,
)
from jaxdp.runtime.gpu_plugin import compile_only_devices, quiet_native_stderr, register_plugin  # noqa: F401
from jaxdp.runtime.gpu_specs import GPUS, Gpu, Target, TargetError  # noqa: F401

__all__ = ["ENV_DIR", "GPUS", "Gpu", "NVCC_PACKAGE", "PLUGIN_PACKAGES", "TOOLKIT_DIRS", "Target", "TargetError",
           "compile_only_devices", "install", "install_command", "jaxlib_version", "main", "plugin_dir",
           "ptxas_available", "quiet_native_stderr", "register_plugin"]

if __name__ == "__main__":
    sys.exit(main())
