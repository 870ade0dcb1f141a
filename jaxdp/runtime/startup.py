"""Start-up: the XLA and device flags, set after parsing and before jax starts.

jax reads ``XLA_FLAGS`` once, when it creates its backend (the first ``jax.devices()`` or array),
not when it is imported (measured on jax 0.10.2: ``import jax, flax, optax``, then the flag, gives
that many devices). The command line (``jaxdp.cli.command``) parses its arguments with jax-free
modules only (the configuration tree), so that ``--help`` starts without jax's second of imports,
sets the flags here, and only then imports the modules that run the command; those import jax
at module level. A script that simulates devices calls ``simulate_cpu_devices`` before its first
``jax.devices()`` (before ``import jax`` is simplest). Imports nothing of jaxdp (and no jax).
"""

import os
import subprocess
import sys
from typing import Optional

FORCE_FLAG = "--xla_force_host_platform_device_count"


def backend_started() -> bool:
    """Whether jax has created a backend in this process: after that, ``XLA_FLAGS`` and
    ``XLA_PYTHON_CLIENT_PREALLOCATE`` are read already (``import jax`` alone reads neither)."""
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge  # jax is imported already: no cost, and no backend started

    return xla_bridge.backends_are_initialized()


def simulate_cpu_devices(n: int) -> None:
    """Ask XLA for ``n`` host (CPU) devices: a no-op for GPUs, once jax runs, and when
    XLA_FLAGS already fixes the count."""
    flags = os.environ.get("XLA_FLAGS", "")
    if FORCE_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {FORCE_FLAG}={n}".strip()


def with_device_count(flags: str, n: int) -> str:
    """``flags`` (an XLA_FLAGS value) asking for ``n`` host devices instead of any count it gave."""
    kept = " ".join(f for f in flags.split() if not f.startswith(FORCE_FLAG))
    return f"{kept} {FORCE_FLAG}={n}".strip()


def preset_device_count() -> Optional[str]:
    """The XLA_FLAGS entry that fixed the host device count before this process could, if any."""
    preset = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith(FORCE_FLAG + "=")]
    return preset[-1] if preset else None


def xla_accepts(flag: str) -> bool:
    """Whether this jaxlib's XLA takes ``flag`` in ``XLA_FLAGS``. XLA aborts a process whose
    XLA_FLAGS hold a flag it does not know (jaxlib 0.12 dropped ``--xla_cpu_use_fusion_emitters``,
    which 0.10.2 has), so a child process asks it: about a second, jax's import."""
    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True)
    return probe.returncode == 0


def configure(devices: Optional[int], processes: int = 1) -> None:
    """The command's flags, before jax starts: ``devices`` in the whole job (``--devices``, or
    the product of ``--mesh``), split evenly over its ``processes`` where it can be."""
    if devices:
        simulate_cpu_devices(devices // processes if devices % processes == 0 else devices)
