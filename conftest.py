"""Test set-up shared by tests/ and parity_tests/.

XLA reads the simulated-device flag when jax is first imported, so it is set
here, before any test module imports jax.

64-bit types: off, as in a user's float32 program, except in tests marked ``float64``
(the exact comparisons). The parity runner and ``jaxdp train --dtype float64`` turn them
on themselves; the setting is restored after every test, so none leaks into the next.

Also here: the user's own settings for tests that run a command as a user would (``user_env``),
one directory in which the session's xdist workers share torch parity runs, and the subprocess
that runs a module's ``production_compiler`` tests with XLA's default emitters.
"""

import json
import os

import pytest

# The user's own values of what this file sets, saved by the first process that reads it (pytest,
# or the xdist controller: its workers inherit the environment it changed): commands that must run
# as a user runs them (the quickstart) get these back (fixture ``user_env``).
_USER_SETTINGS = "JAXDP_TEST_USER_SETTINGS"
_SET_HERE = ("XLA_FLAGS", "JAX_PLATFORMS", "JAXDP_COMPILER_OPTIONS", "JAXDP_TORCH_BACKEND",
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
os.environ.setdefault(_USER_SETTINGS, json.dumps({k: os.environ.get(k) for k in _SET_HERE}))

# Tests run tiny models, so XLA's compile time dominates; backend optimisation level 0
# cuts the suite's CPU time by ~40% (measured: test_ddp 135 s -> 85 s), and XLA:CPU's
# older elemental emitters instead of its MLIR fusion emitters halve what is left: the
# tiny float64 ResNet's DDP step compiled in 0.64 s instead of 1.36 s (ZeRO-3: 1.17 vs
# 2.07) and ran 1.6x faster. Results stay within rounding of the optimised build, and
# every comparison is against a reference computed in the same process or the torch
# side, never against stored numbers. XLA's default level for every program took the suite
# over 50 min with the compilation cache empty, instead of 26 (2 cores): level 0 stays, except
# for the training step (JAXDP_COMPILER_OPTIONS, below).
# Tests marked ``production_compiler`` assert that two different programs agree to the last
# bit (FSDP units composed vs model.apply, a sharded vs an unsharded init). That is a property
# of XLA's default emitters, which users run; the older emitters round a few values of such
# pairs differently (1 ulp). Those tests re-run themselves in a subprocess without the flag.
# jaxlib 0.12's XLA:CPU has the fusion emitters only, and aborts on the flag: there every test
# compiles with XLA's default emitters already, and production_compiler tests run in-process.
# Whether XLA takes it is asked once a session (a child process); the answer goes to the xdist
# workers and subprocesses in the environment.
_FAST_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
_FAST_EMITTERS_KNOWN = "JAXDP_TEST_FAST_EMITTERS"
_PRODUCTION_ENV = "JAXDP_TEST_PRODUCTION_COMPILER"
if _FAST_EMITTERS_KNOWN not in os.environ:
    from jaxdp.runtime.startup import xla_accepts

    os.environ[_FAST_EMITTERS_KNOWN] = "1" if xla_accepts(_FAST_EMITTERS) else "0"
_FAST = os.environ[_FAST_EMITTERS_KNOWN] == "1" and not os.environ.get(_PRODUCTION_ENV)
_TEST_FLAGS = ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0") + \
    ((_FAST_EMITTERS,) if _FAST else ())
_flags = os.environ.get("XLA_FLAGS", "")
for _flag in _TEST_FLAGS:
    if _flag.split("=")[0] not in _flags:
        _flags = f"{_flags} {_flag}".strip()
os.environ["XLA_FLAGS"] = _flags
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The training step, and only it, compiles with XLA's optimising backend (level 2, a strategy's
# compile options: jaxdp.runtime.compile_options). It is the program a test runs many times:
# the process running a float64 ZeRO-3 parity pair's jax side used 12.5 CPU-s instead of 22.1
# with its step cached, 31.9 instead of 25.2 without. Fresh clone, 2 cores: 12 min warm instead
# of 17 (1,442 instead of ~2,120 CPU-s, with the XLA_FLAGS fixture below), 27 min with the cache
# empty instead of 26. jaxdp's CPU default options (YNNPACK without convolutions) are left out:
# they change f32 and f64 steps by an ulp, and the tests compare strategies bit for bit with
# plain jax.jit references, so they keep XLA's own kernels. test_compile_options checks the
# default.
os.environ.setdefault("JAXDP_COMPILER_OPTIONS", "xla_backend_optimization_level=2")
# torch_ref's side stays on the CPU as well (gloo ranks), also on a GPU host: a CPU suite must
# not turn into an NCCL run because CUDA is visible. JAXDP_TORCH_BACKEND=auto (or nccl) in the
# environment puts the suite's torch launches on the GPUs instead (torch_ref.dist). Tests
# marked gpu ask for CUDA themselves (JAX and torch, in a subprocess: see test_parity.py).
os.environ.setdefault("JAXDP_TORCH_BACKEND", "gloo")
# Every program the suite compiles in its workers, and in the `jaxdp train` runs it starts, goes
# through jaxdp's persistent compilation cache (``jaxdp.run.perf``: the directory `jaxdp train`
# uses, one per process count), not only those of train runs and not only those that took over a
# second, so a rerun loads most of them (fresh clone, 2 cores: 27 min with the cache empty, 12
# warm; tracing and lowering stay). Its keys hold the program, the XLA flags (the environment's,
# at each compile: see _xla_flags_restored) and jax's version, so no result comes from another
# build. Within one cold run it saves nothing: tests rarely repeat a program. ``user_env`` gives
# commands the user's own threshold back.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402

from jaxdp.run.perf import enable_compile_cache  # noqa: E402

enable_compile_cache(True)
# JAX decides once per process, at its first compile, whether it uses the cache. One compile now
# settles that, so a test that turns the cache off in-process (a train run with
# --no-compile-cache) before its worker compiled anything cannot turn it off for the tests after it.
jax.jit(lambda x: x + 1)(0)

from parity_tests.torch_side import SHARED_CACHE_ENV  # noqa: E402


@pytest.fixture(autouse=True)
def _x64_only_where_marked(request):
    """Global (not a context manager): threads a test starts, e.g. the data prefetcher, see it too."""
    before = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", request.node.get_closest_marker("float64") is not None)
    yield
    jax.config.update("jax_enable_x64", before)


@pytest.fixture(autouse=True)
def _xla_flags_restored():
    """``XLA_FLAGS`` as it was before the test. An in-process ``jaxdp parity`` appends parity
    mode's GPU flags (parity_tests.parity_mode). XLA read its flags when the backend started, so
    they change no program, but JAX puts the variable into every compilation-cache key: a worker
    that ran such a test missed the cache for every program after it (measured: ~40 steps
    compiled again on a warm run)."""
    before = os.environ["XLA_FLAGS"]  # set above, at start-up
    yield
    os.environ["XLA_FLAGS"] = before


def pytest_configure(config):
    """One directory for the session's torch parity runs (``parity_tests.torch_side``), made by the
    controlling process before its xdist workers start, so that they all inherit it: a torch run
    that two test modules need is launched once, by whichever worker asks first."""
    _ctrl_c_as_python_has_it()
    if hasattr(config, "workerinput") or SHARED_CACHE_ENV in os.environ:
        return
    import tempfile

    config._jaxdp_torch_cache = tempfile.mkdtemp(prefix="jaxdp-parity-torch-")
    os.environ[SHARED_CACHE_ENV] = config._jaxdp_torch_cache


def _ctrl_c_as_python_has_it():
    """A shell that starts the suite in the background (``make test &``, nohup) hands it SIGINT ignored,
    and Python then never installs its KeyboardInterrupt handler, here or in the runs the tests launch:
    the Ctrl-C tests would test the shell. Every process of the suite gets Python's own handler back."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_unconfigure(config):
    directory = getattr(config, "_jaxdp_torch_cache", None)
    if directory is not None:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)
        os.environ.pop(SHARED_CACHE_ENV, None)


def pytest_collection_modifyitems(config, items):
    """Modules with long tests (marked slow) first, each module kept whole (its module-scoped
    fixtures build once): the xdist workers then finish on short tests, together, rather
    than one waiting for another's last long parity run."""
    long_modules = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module.__name__ not in long_modules)  # stable: order kept within


@pytest.fixture
def user_env():
    """The environment a user's shell gives a command: none of this suite's compile-time XLA
    flags or jaxdp settings, so the command compiles and runs as theirs does (their XLA
    optimises; the suite's level-0 build runs a 78-step ResNet-18 twice as slow). Its
    devices stay on the CPU, and its torch side on gloo, as the suite's do."""
    return user_environment()


@pytest.fixture(scope="module")
def module_user_env():
    """``user_env`` for a module's fixtures (commands a module runs once for all its tests)."""
    return user_environment()


def user_environment() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (_USER_SETTINGS, SHARED_CACHE_ENV, "PYTEST_XDIST_WORKER")}
    for name, value in json.loads(os.environ[_USER_SETTINGS]).items():
        env.pop(name, None)
        if value is not None:
            env[name] = value
    return dict(env, JAX_PLATFORMS="cpu", JAXDP_TORCH_BACKEND=os.environ["JAXDP_TORCH_BACKEND"])


def pytest_pyfunc_call(pyfuncitem):
    """A ``production_compiler`` test runs in a subprocess whose XLA uses its default emitters:
    one subprocess per module runs all of that module's marked tests (one start-up, its
    module fixtures built once), and each test reports its own outcome from there."""
    if pyfuncitem.get_closest_marker("production_compiler") is None or not _FAST:
        return None  # not marked, or this process compiles with XLA's default emitters already
    outcome = _production_outcomes(pyfuncitem).get(pyfuncitem.nodeid)
    assert outcome is not None, f"{pyfuncitem.nodeid}: no outcome from the subprocess with XLA's default emitters"
    status, text = outcome
    if status == "skipped":
        pytest.skip(text)
    assert status == "passed", f"{pyfuncitem.nodeid} with XLA's default emitters:\n{text[-6000:]}"
    return True


_PRODUCTION_RUNS = {}  # module path -> {nodeid: (passed | failed | skipped, its message)}


def _production_outcomes(item):
    """Every production_compiler test of ``item``'s module, run once in one subprocess."""
    import subprocess
    import sys
    import tempfile
    import xml.etree.ElementTree as ET

    module = item.nodeid.split("::")[0]
    if module in _PRODUCTION_RUNS:
        return _PRODUCTION_RUNS[module]
    ids = [i.nodeid for i in item.session.items
           if i.nodeid.split("::")[0] == module and i.get_closest_marker("production_compiler") is not None]
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if f != _FAST_EMITTERS)
    env = dict(os.environ, XLA_FLAGS=flags, **{_PRODUCTION_ENV: "1"})
    env.pop("PYTEST_XDIST_WORKER", None)
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.xml")
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                               f"--junitxml={report}", *ids], cwd=str(item.config.rootpath), env=env,
                              capture_output=True, text=True, timeout=1800)
        cases = ET.parse(report).getroot().iter("testcase") if os.path.exists(report) else ()
        outcomes = {}
        for case in cases:
            name = case.get("name")
            nodeid = next((i for i in ids if i.endswith("::" + name)), None)
            bad = [e for e in case if e.tag in ("failure", "error")]
            skipped = [e for e in case if e.tag == "skipped"]
            if nodeid is not None:
                status = "failed" if bad else "skipped" if skipped else "passed"
                outcomes[nodeid] = (status, "\n".join(e.text or e.get("message", "") for e in bad + skipped))
    for nodeid in ids:  # a subprocess that died part-way: every test it did not report fails with its output
        outcomes.setdefault(nodeid, ("failed", done.stdout + done.stderr))
    _PRODUCTION_RUNS[module] = outcomes
    return outcomes
