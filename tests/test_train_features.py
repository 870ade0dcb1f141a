"""What a practitioner expects of a run: --max-steps, --eval-every, --keep, TensorBoard
scalars equal to metrics.jsonl, a profiler trace, MFU and memory in the records, the time to
the first step, and the compilation cache's directory rules. One tiny run serves most checks."""

import glob
import math
import os

import jax
import numpy as np
import pytest

from helpers import jax_compile_log
from jaxdp.config.tree import TrainConfig
from jaxdp.run.train import train
from run_dirs import tensorboard_scalars

TINY = dict(width=4, blocks=(1, 1, 1, 1), synthetic_size=(64, 32), global_batch_size=16, devices=2, lr=0.05,
            progress=False)  # 4 steps per epoch


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """6 updates (an epoch and a half), evaluated every 3, checkpointed every step keeping 2,
    steps 2-3 profiled, MFU against a made-up peak of 1 GFLOP/s."""
    cfg = TrainConfig(out=str(tmp_path_factory.mktemp("features")), epochs=1, max_steps=6, eval_every=3,
                      checkpoint_every=1, keep=2, profile_steps=(2, 4), peak_flops=1e9, **TINY)
    with jax_compile_log(COMPILE_LOG):
        return cfg, train(cfg)


COMPILE_LOG = []  # jax's compile log lines of ``run``


def records(out, kind=None):
    import json

    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if kind is None or r["kind"] == kind]


def test_max_steps_overrides_epochs_and_the_schedule_spans_them(run):
    cfg, summary = run
    train_records = records(cfg.out, "train")
    assert summary["steps"] == 6 and [r["step"] for r in train_records] == [1, 2, 3, 4, 5, 6]
    assert [r["epoch"] for r in train_records] == [1, 1, 1, 1, 2, 2]
    cosine = [0.5 * cfg.lr * (1 + math.cos(math.pi * t / 6)) for t in range(6)]  # over 6 updates, not 4
    np.testing.assert_allclose([r["lr"] for r in train_records], cosine, rtol=1e-6, atol=1e-9)


def test_eval_every_adds_evaluations_between_the_epochs_own(run):
    cfg, _ = run
    evals = records(cfg.out, "eval")
    assert [(r["step"], r["epoch"]) for r in evals] == [(3, 1), (4, 1), (6, 2)]  # 3: --eval-every; 4, 6: ends
    assert all(r["count"] == 32 for r in evals)


def test_keep_bounds_the_checkpoints(run):
    cfg, _ = run
    kept = sorted(int(n) for n in os.listdir(os.path.join(cfg.out, "checkpoints")) if n.isdigit())
    assert kept == [5, 6]  # a checkpoint every step, the newest 2 kept (default 3)


def test_tensorboard_scalars_equal_the_jsonl_records(run):
    cfg, _ = run
    scalars = tensorboard_scalars(os.path.join(cfg.out, "tensorboard"))
    for record in records(cfg.out):
        for name, value in record.items():
            if name in ("kind", "step", "epoch") or value is None:
                continue
            tag = f"{record['kind']}/{name}"
            logged = dict(scalars[tag])[record["step"]]
            assert logged == pytest.approx(value, rel=1e-6), tag  # float32 in the event file
    assert {"train/loss", "train/accuracy", "train/lr", "train/images_per_sec", "train/mfu", "train/memory_mb",
            "train/time_to_first_step_s", "eval/loss", "eval/accuracy"} <= set(scalars)
    assert [step for step, _ in scalars["train/images_per_sec"]] == [2, 3, 4, 5, 6]  # step 1 holds the compile


def test_profile_steps_write_a_trace_that_tensorboard_opens(run):
    cfg, _ = run
    traces = glob.glob(os.path.join(cfg.out, "tensorboard", "plugins", "profile", "*", "*.xplane.pb"))
    assert len(traces) == 1 and os.path.getsize(traces[0]) > 0, traces


def test_mfu_is_model_flops_and_memory_comes_from_the_compiled_step(run):
    """MFU = images/s x the model's FLOPs per trained image / (devices x peak): times the peak
    and the devices, over the images/s, it gives back at every step the hand count of the
    ResNet's conv and dense MACs x 2 x 3 (not the compiled program's cost analysis, which
    counts cuDNN's convolutions as 0 on a GPU); memory is the compiled step's footprint (a
    CPU has no memory_stats)."""
    from test_flops import resnet_cifar_flops

    cfg, summary = run
    strategy_state = summary["state"]
    train_records = records(cfg.out, "train")
    assert train_records[0]["mfu"] is None  # no step time yet
    flops = [r["mfu"] * cfg.peak_flops * cfg.devices / r["images_per_sec"] for r in train_records[1:]]
    np.testing.assert_allclose(flops, resnet_cifar_flops(cfg.width, cfg.blocks), rtol=1e-9)
    from jaxdp.run.setup import build

    setup = build(cfg)
    batch = setup.strategy.engine.shard_batch({"image": np.zeros((16, 32, 32, 3), np.float32),
                                        "label": np.zeros(16, np.int32)})
    compiled = setup.strategy.engine.lower_step(strategy_state, batch).compile()
    mem = compiled.memory_analysis()
    expected_mb = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                   - mem.alias_size_in_bytes) / 2**20
    assert all(r["memory_mb"] == pytest.approx(expected_mb) for r in train_records)
    assert jax.devices()[0].memory_stats() is None


def test_the_step_is_traced_and_compiled_once(run):
    """The loop compiles its first step ahead of time (its memory, MFU) and then runs that
    program: jit tracing and compiling it again at step 1 doubled every run's start-up."""
    for stage in ("tracing local_step", "jaxpr to MLIR module conversion jit(local_step)",
                  "XLA compilation of jit(local_step)"):
        assert sum(line.startswith(f"Finished {stage}") for line in COMPILE_LOG) == 1, (stage, COMPILE_LOG)


def test_time_to_first_step_is_in_the_first_record_only(run):
    cfg, summary = run
    first, *rest = records(cfg.out, "train")
    assert 0 < first["time_to_first_step_s"] < summary["seconds"]
    assert all("time_to_first_step_s" not in r for r in rest)


def test_compile_cache_directory_rules(tmp_path, monkeypatch):
    """On by default in a per-user directory split by job size; a directory the user set is
    kept; --no-compile-cache turns the cache off."""
    from jaxdp.run.perf import enable_compile_cache

    before = (jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir)
    try:
        monkeypatch.setenv("JAXDP_CACHE_DIR", str(tmp_path))
        jax.config.update("jax_compilation_cache_dir", None)
        assert enable_compile_cache(True) == str(tmp_path / "jax-compile" / "1-process")
        assert jax.config.jax_enable_compilation_cache
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))  # as JAX_COMPILATION_CACHE_DIR sets it
        assert enable_compile_cache(True) == str(tmp_path / "mine")
        assert enable_compile_cache(False) is None and not jax.config.jax_enable_compilation_cache
        monkeypatch.delenv("JAXDP_CACHE_DIR")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        jax.config.update("jax_compilation_cache_dir", None)
        assert enable_compile_cache(True) == str(tmp_path / "xdg" / "jaxdp" / "jax-compile" / "1-process")
    finally:
        jax.config.update("jax_enable_compilation_cache", before[0])
        jax.config.update("jax_compilation_cache_dir", before[1])


def test_without_tensorboardx_scalars_are_off_said_once(tmp_path, monkeypatch, capsys):
    import builtins

    from jaxdp.run import scalars

    real_import = builtins.__import__

    def no_tensorboardx(name, *args, **kwargs):
        if name == "tensorboardX":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboardx)
    monkeypatch.setattr(scalars, "_said_off", [False])
    assert scalars.open_scalar_writer(str(tmp_path / "a")) is None
    assert scalars.open_scalar_writer(str(tmp_path / "b")) is None
    assert capsys.readouterr().err.count("TensorBoard scalars are off") == 1


def test_tensorboard_scalars_do_not_load_torch(tmp_path):
    """tensorboardX imports torch whenever it is installed (~3 s of each run's start-up); jaxdp's
    writer loads it without, here where torch is installed, and still writes the event file."""
    import importlib.util
    import subprocess
    import sys

    assert importlib.util.find_spec("torch") is not None
    script = ("import sys; from jaxdp.run.scalars import open_scalar_writer\n"
              f"w = open_scalar_writer({str(tmp_path)!r}); w.write({{'kind': 'train', 'step': 1, 'loss': 0.5}}); w.close()\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"
    assert glob.glob(str(tmp_path / "events.out.tfevents.*"))
