"""Parity mode (``parity_tests.parity_mode``): exactly its XLA flags, variables and torch
settings, set by ``jaxdp parity`` and ``gpu_check`` before jax starts, and by no other command.

CPU only: the flags and torch's cuDNN switches are what a GPU would read; whether they make
the two sides agree on a GPU is ``make gpu-check``'s question.
"""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from parity_tests import parity_mode

PARITY_FLAGS = ["--xla_gpu_deterministic_ops=true", "--xla_gpu_autotune_level=0", "--xla_gpu_enable_triton_gemm=false"]
PARITY_ENV = {"TF_ENABLE_WINOGRAD_NONFUSED": "0", "NVIDIA_TF32_OVERRIDE": "0"}


@pytest.fixture
def clean_env(monkeypatch):
    """No parity variables yet, one XLA flag of the caller's; parity_mode's record restored."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    for k in PARITY_ENV:  # set, then removed: monkeypatch restores the caller's value (or its absence)
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    monkeypatch.setattr(parity_mode, "_late", None)


def parity_settings():
    flags = os.environ.get("XLA_FLAGS", "").split()
    return [f for f in flags if f.startswith("--xla_gpu_")], {k: os.environ.get(k) for k in PARITY_ENV}


def test_parity_mode_adds_exactly_its_flags_and_variables():
    got = parity_mode.env_updates({})
    assert got == {"XLA_FLAGS": " ".join(PARITY_FLAGS), **PARITY_ENV}
    # the caller's flags stay, a flag the user set keeps the user's value, and twice is once
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=3 --xla_gpu_autotune_level=4"}
    env.update(parity_mode.env_updates(env))
    assert env["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=3", "--xla_gpu_autotune_level=4",
                                        "--xla_gpu_deterministic_ops=true", "--xla_gpu_enable_triton_gemm=false"]
    assert parity_mode.env_updates(env)["XLA_FLAGS"] == env["XLA_FLAGS"]


def test_xla_accepts_the_flags(tmp_path):
    """XLA aborts on an unknown XLA_FLAGS entry: jax starts, computes, and reports the flags."""
    env = dict(os.environ, XLA_FLAGS=" ".join(PARITY_FLAGS), JAX_PLATFORMS="cpu")
    code = "import jax.numpy as jnp; print(float((jnp.ones(3) * 2).sum()))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "6.0", proc.stderr[-2000:]


def test_enable_after_jax_started_says_the_flags_are_not_in_effect(clean_env):
    import jax

    jax.devices()  # this process's backend exists (the suite's simulated CPUs)
    assert parity_mode.enable() is False
    assert parity_settings() == (PARITY_FLAGS, PARITY_ENV)
    assert parity_mode.xla_flags_in_effect() is False and parity_mode.summary()["xla_flags_in_effect"] is False


def test_torch_rank_setup_sets_exactly_the_parity_switches():
    names = ("cudnn.deterministic", "cudnn.benchmark", "cudnn.allow_tf32", "cuda.matmul.allow_tf32", "cudnn.enabled")
    before = parity_mode.torch_settings()
    try:
        parity_mode.torch_rank_setup(torch.device("cpu"))
        assert parity_mode.torch_settings() == dict(zip(names, (True, False, False, False, True)))
        parity_mode.torch_rank_setup(torch.device("cpu"), cudnn=False)  # --torch-cudnn off: the reference
        assert parity_mode.torch_settings()["cudnn.enabled"] is False
    finally:
        for name, value in before.items():
            module, attr = name.rsplit(".", 1)
            setattr(torch.backends.cudnn if module == "cudnn" else torch.backends.cuda.matmul, attr, value)
    assert parity_mode.torch_settings() == before


def test_only_parity_enables_parity_mode(clean_env, monkeypatch):
    """jaxdp parity sets the flags before its run; jaxdp train and jaxdp bench leave XLA's autotuner
    and cuDNN's defaults alone."""
    from jaxdp.cli import command as cli
    from parity_tests import runner
    from torch_commands.bench import command as bench_command

    seen = {}

    def capture(name, value=0):
        def f(*args, **kwargs):
            seen[name] = parity_settings()
            if name == "parity":
                raise SystemExit(0)
            return value
        return f

    # the command as the one registry holds it (jaxdp.cli.command.BUILT_IN), its run replaced
    monkeypatch.setitem(cli.BUILT_IN, "train", dataclasses.replace(cli.TRAIN, run=capture("train")))
    assert cli.main(["train", "--devices", "2"]) == 0
    monkeypatch.setattr(bench_command, "run_bench", capture("bench", {}))
    monkeypatch.setattr(bench_command, "write", lambda result, args: None)
    assert cli.main(["bench", "--strategies", "ddp", "--devices", "2"]) == 0
    assert seen["train"] == seen["bench"] == ([], dict.fromkeys(PARITY_ENV))
    monkeypatch.setattr(runner, "run_parity", capture("parity"))
    with pytest.raises(SystemExit):
        cli.main(["parity", "--strategy", "ddp", "--devices", "2", "--backend", "gloo"])
    assert seen["parity"] == (PARITY_FLAGS, PARITY_ENV)
