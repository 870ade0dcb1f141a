"""Test set-up shared by tests/ and parity_tests/.

XLA reads the simulated-device flag when jax is first imported, so it is set
here, before any test module imports jax.

64-bit types: off, as in a user's float32 program, except in tests marked ``float64``
(the exact comparisons). The parity runner and ``jaxdp train --dtype float64`` turn them
on themselves; the setting is restored after every test, so none leaks into the next.
"""

import os

import pytest

# Tests run tiny models, so XLA's compile time dominates; backend optimisation level 0
# cuts the suite's CPU time by ~40% (measured: test_ddp 135 s -> 85 s), and XLA:CPU's
# older elemental emitters instead of its MLIR fusion emitters halve what is left: the
# tiny float64 ResNet's DDP step compiled in 0.64 s instead of 1.36 s (ZeRO-3: 1.17 vs
# 2.07) and ran 1.6x faster. Results stay within rounding of the optimised build, and
# every comparison is against a reference computed in the same process or the torch
# side, never against stored numbers.
# Tests marked ``production_compiler`` assert that two different programs agree to the last
# bit (FSDP units composed vs model.apply, a sharded vs an unsharded init). That is a property
# of XLA's default emitters, which users run; the older emitters round a few values of such
# pairs differently (1 ulp). Those tests re-run themselves in a subprocess without the flag.
_FAST_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
_PRODUCTION_ENV = "JAXDP_TEST_PRODUCTION_COMPILER"
_TEST_FLAGS = ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0") + \
    (() if os.environ.get(_PRODUCTION_ENV) else (_FAST_EMITTERS,))
_flags = os.environ.get("XLA_FLAGS", "")
for _flag in _TEST_FLAGS:
    if _flag.split("=")[0] not in _flags:
        _flags = f"{_flags} {_flag}".strip()
os.environ["XLA_FLAGS"] = _flags
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# jaxdp's CPU default compile options (YNNPACK without convolutions, jaxdp.compile_options)
# change f32 and f64 steps by an ulp; the tests compare strategies bit for bit with plain
# jax.jit references, so they keep XLA's own kernels. test_compile_options checks the default.
os.environ.setdefault("JAXDP_COMPILER_OPTIONS", "none")
# torch_ref's side stays on the CPU as well (gloo ranks), also on a GPU host: a CPU suite must
# not turn into an NCCL run because CUDA is visible. JAXDP_TORCH_BACKEND=auto (or nccl) in the
# environment puts the suite's torch launches on the GPUs instead (torch_ref.dist). Tests
# marked gpu ask for CUDA themselves (JAX and torch, in a subprocess: see test_parity.py).
os.environ.setdefault("JAXDP_TORCH_BACKEND", "gloo")

import jax  # noqa: E402


@pytest.fixture(autouse=True)
def _x64_only_where_marked(request):
    """Global (not a context manager): threads a test starts, e.g. the data prefetcher, see it too."""
    before = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", request.node.get_closest_marker("float64") is not None)
    yield
    jax.config.update("jax_enable_x64", before)


def pytest_collection_modifyitems(config, items):
    """Modules with long tests (marked slow) first, each module kept whole (its module-scoped
    fixtures build once): the xdist workers then finish on short tests, together, rather
    than one waiting for another's last long parity run."""
    long_modules = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module.__name__ not in long_modules)  # stable: order kept within


def pytest_pyfunc_call(pyfuncitem):
    """A ``production_compiler`` test runs in a subprocess whose XLA uses its default emitters."""
    if pyfuncitem.get_closest_marker("production_compiler") is None or os.environ.get(_PRODUCTION_ENV):
        return None
    import subprocess
    import sys

    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if f != _FAST_EMITTERS)
    env = dict(os.environ, XLA_FLAGS=flags, **{_PRODUCTION_ENV: "1"})
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           pyfuncitem.nodeid], cwd=str(pyfuncitem.config.rootpath), env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{pyfuncitem.nodeid} with XLA's default emitters:\n{done.stdout[-6000:]}"
    return True
