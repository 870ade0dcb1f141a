"""Test set-up shared by tests/ and parity_tests/.

XLA reads the simulated-device flag when jax is first imported, so it is set
here, before any test module imports jax. float64 is enabled for the tight
parity checks; float32 paths use explicit dtypes and are unaffected.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
