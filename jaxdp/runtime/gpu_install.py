"""The installer of JAX's CUDA plugin for compile-only GPU targets: ``python -m
jaxdp.runtime.target install`` (``make install-gpu-target``).

Installed into site-packages, the plugin would register at every backend start of every ``import
jax`` in that environment and, without a GPU, print ``RuntimeError: Unable to load CUDA`` (or
``cudart_stub ... Could not find cuda drivers``) there. So it goes into a directory of its own,
``plugin_dir()`` (one per jaxlib version: the plugin must match jaxlib exactly), with pip's
``--target --no-deps``: no CUDA runtime wheels, nothing in site-packages. Only the loader
(``gpu_plugin``) ever puts that directory on ``sys.path``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from typing import Optional

ENV_DIR = "JAXDP_GPU_TARGET_DIR"  # overrides plugin_dir()
PLUGIN_PACKAGES = ("jax-cuda12-plugin", "jax-cuda12-pjrt")
NVCC_PACKAGE = "nvidia-cuda-nvcc-cu12"  # ptxas and libdevice, when no CUDA toolkit has them
TOOLKIT_DIRS = ("/usr/local/cuda", "/opt/cuda")


def jaxlib_version() -> str:
    return version("jaxlib")


def plugin_dir() -> str:
    """Where ``install()`` puts the plugin: beside this environment, one directory per jaxlib version."""
    return os.environ.get(ENV_DIR) or os.path.join(sys.prefix, "jaxdp-gpu-target", f"jaxlib-{jaxlib_version()}")


def install_command() -> str:
    return f"{os.path.basename(sys.executable)} -m jaxdp.runtime.target install  (or: make install-gpu-target)"


def plugin_installed(path: str) -> bool:
    return os.path.exists(os.path.join(path, "jax_plugins", "xla_cuda12", "__init__.py"))


def cuda_data_dir(path: str) -> Optional[str]:
    """The pip-installed ptxas/libdevice in the plugin's directory, for ``--xla_gpu_cuda_data_dir``."""
    nvcc = os.path.join(path, "nvidia", "cuda_nvcc")
    return nvcc if os.path.exists(os.path.join(nvcc, "bin", "ptxas")) else None


def ptxas_available() -> bool:
    """Whether XLA will find ptxas: on PATH, in a CUDA toolkit, or from NVCC_PACKAGE in the plugin's directory."""
    if shutil.which("ptxas") or any(os.path.exists(os.path.join(d, "bin", "ptxas")) for d in TOOLKIT_DIRS):
        return True
    return cuda_data_dir(plugin_dir()) is not None


def install(quiet: bool = True) -> str:
    """Install the CUDA plugin and PJRT of jaxlib's exact version, and ptxas if no toolkit has it, into
    ``plugin_dir()``. Returns the directory. A second call with everything there installs nothing."""
    path, jaxlib = plugin_dir(), jaxlib_version()
    wanted = [f"{p}=={jaxlib}" for p in PLUGIN_PACKAGES] if not plugin_installed(path) else []
    if not ptxas_available():
        wanted.append(NVCC_PACKAGE)
    if wanted:
        subprocess.run([sys.executable, "-m", "pip", "install", *(["-q"] if quiet else []), "--no-deps",
                        "--upgrade", "--target", path, *wanted], check=True)
    return path


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args != ["install"]:
        print(f"usage: {os.path.basename(sys.executable)} -m jaxdp.runtime.target install", file=sys.stderr)
        return 2
    path = install(quiet=False)
    print(f"JAX's CUDA plugin {jaxlib_version()} for compile-only GPU targets: {path}"
          + ("" if ptxas_available() else " (no ptxas found: compiles will fail)"))
    return 0
