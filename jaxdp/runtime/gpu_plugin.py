"""The loader: JAX's CUDA plugin registered in this process, from ``plugin_dir()``, and the
compile-only devices of a target.

JAX's CUDA plugin describes a GPU it does not have from a ``TargetConfig`` (``Gpu.config_text``),
and ``jax.experimental.topologies.get_topology_desc`` turns it into compile-only devices. To get
there without a GPU, in this process only:

- the plugin's directory goes on ``sys.path`` (after site-packages) and the plugin is registered
  by hand (``gpu_install`` keeps it out of site-packages);
- XLA is told where the pip-installed ptxas lives (``_point_xla_at_ptxas``);
- the plugin's CUDA constraints check, which needs a driver, is skipped (``_skip_cuda_check``);
- jax's default backend stays the CPU (``_keep_cpu_default``): the plugin's 'cuda' backend would
  take priority and fail to start;
- the plugin's native start-up lines about the missing driver are dropped (``quiet_native_stderr``).

jax's private API is touched in two functions only, ``_cuda_topology_registered`` and
``_backends_started``, each saying why no public API does it. Works whether or not jax has started
its CPU backend already. jax is imported where it is used: ``jaxdp inspect``'s parser and ``import
jaxdp`` read the target table without it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
import tempfile
from typing import List

from jaxdp.runtime.gpu_install import cuda_data_dir, install_command, jaxlib_version, plugin_dir, plugin_installed
from jaxdp.runtime.gpu_specs import Target, TargetError

_NOISE = re.compile(r"cudart_stub\.cc|absl::InitializeLog|Could not find cuda drivers")


def compile_only_devices(target: Target) -> List:
    """``target.devices`` compile-only GPUs (process by process, host by host) to build a mesh over."""
    from jax.experimental import topologies

    register_plugin()
    with quiet_native_stderr():
        topology = topologies.get_topology_desc(platform="cuda", target_config=target.gpu.config_text(),
                                                topology=target.topology)
    return sorted(topology.devices, key=lambda d: (d.process_index, d.id))


def register_plugin() -> None:
    """Make jax's CUDA topology available in this process: the installed one if jax found a CUDA
    plugin by itself (a GPU host), else ours from ``plugin_dir()``. TargetError if there is none."""
    if _cuda_topology_registered():
        return
    path = plugin_dir()
    if not plugin_installed(path):
        raise TargetError(f"compiling for a GPU target needs JAX's CUDA plugin {jaxlib_version()}, not installed "
                          f"in {path}: run {install_command()}")
    if path not in sys.path:
        sys.path.append(path)  # after site-packages: nothing of ours shadows the environment's packages
    _point_xla_at_ptxas(cuda_data_dir(path))
    _skip_cuda_check()
    _keep_cpu_default()
    with quiet_native_stderr():
        importlib.import_module("jax_plugins.xla_cuda12").initialize()


def _cuda_topology_registered() -> bool:
    """Whether jax has a CUDA topology factory, once its plugin discovery has run (as jax's own
    start-up runs it; idempotent). No public API runs the discovery without starting a backend,
    nor lists the topology factories (``get_topology_desc`` only fails, deep inside, without one)."""
    from jax._src import xla_bridge

    xla_bridge._discover_and_register_pjrt_plugins()
    return "cuda" in xla_bridge._topology_factories


def _backends_started() -> bool:
    """Whether jax has started its backends. No public API asks without starting them (``jax.devices()``
    and ``jax.extend.backend.backends()`` start them)."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def _point_xla_at_ptxas(data_dir) -> None:
    """``--xla_gpu_cuda_data_dir`` in ``XLA_FLAGS`` for the pip-installed ptxas and libdevice, unless the
    user set it (or a CUDA toolkit has them: ``data_dir`` None)."""
    if data_dir and "--xla_gpu_cuda_data_dir" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_cuda_data_dir={data_dir}".strip()


def _skip_cuda_check() -> None:
    """The plugin checks the CUDA runtime's versions, which need a driver: skipped in this process only."""
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"


def _keep_cpu_default() -> None:
    """Before jax starts a backend, pin it to the CPU: the plugin registers a 'cuda' backend (priority
    over the CPU's) whose start would fail without a driver. Once a backend runs, nothing changes."""
    import jax

    if not _backends_started() and not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")


@contextlib.contextmanager
def quiet_native_stderr():
    """The plugin's native start-up lines about the missing driver dropped; anything else it writes kept.
    At the file-descriptor level: the plugin's C++ writes to fd 2, past ``sys.stderr``."""
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
