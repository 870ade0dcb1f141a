"""``jaxdp bench --preset gpu --quick`` (``make gpu-bench``) without a GPU: the dry run's plan
(with a faked GPU count), the one-line refusal, the train run's command against the real
parser, the summary read from train's records and a bench result, and the exit status that
cannot pass a failed or skipped component (torch.compile's above all)."""

import json

import pytest

from jaxdp.cli.command import main
from torch_commands.bench import gpu_preset


def test_quick_dry_run_prints_the_plan_with_a_faked_gpu(monkeypatch, capsys):
    monkeypatch.setattr(gpu_preset, "visible_gpus", lambda: 1)
    assert main(["bench", "--preset", "gpu", "--quick", "--dry-run", "--out", "runs/gpu-bench"]) == 0
    out = capsys.readouterr().out
    assert "one GPU, batch 512; 1 GPU(s) visible" in out
    (train,) = [line for line in out.splitlines() if "jaxdp train end to end" in line]
    assert "--global-batch-size 512 --synthetic-size 30720,512 --max-steps 60" in train
    assert "--out runs/gpu-bench/train" in train
    (row,) = [line for line in out.splitlines() if "bench row" in line]
    assert "ddp" in row and "torch.compile (inductor)" in row and "tuned eager" in row
    assert "host input pipeline" in out and "deadline 300 s: what it leaves no time to start is NOT RUN" in out


def test_quick_refuses_without_a_gpu_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(gpu_preset, "visible_gpus", lambda: 0)
    assert main(["bench", "--preset", "gpu", "--quick"]) == 2
    assert capsys.readouterr().err.strip() == ("jaxdp: error: --preset gpu needs CUDA GPUs and neither nvidia-smi nor "
                                               "torch sees one; --dry-run prints the rows it runs")


def test_the_train_run_is_a_command_train_accepts(tmp_path):
    from jaxdp.cli.command import build_parser, config_from_args

    cfg = config_from_args(build_parser().parse_args(gpu_preset.train_argv(str(tmp_path))))
    assert (cfg.global_batch_size, cfg.max_steps, cfg.dtype, cfg.width, cfg.devices) == (512, 60, "bfloat16", 64, 1)
    assert cfg.synthetic_size == (30720, 512) and cfg.out == str(tmp_path)


def test_quick_summary_reads_train_records_after_the_warm_up(tmp_path):
    records = [{"kind": "train", "step": s, "images_per_sec": 1000.0 * s, "mfu": 0.001 * s} for s in range(1, 16)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records + [{"kind": "eval", "step": 15}]))
    train = gpu_preset._train_rate(str(tmp_path))
    assert train == {"images_per_s": 13000.0, "mfu": pytest.approx(0.013), "records": 5}  # steps 11..15
    row = {"strategy": "ddp", "jaxdp": {"images_per_s": 20000.0}, "torch_ref": {"images_per_s": 10000.0},
           "torch_compile": {"images_per_s": 16000.0}, "mfu_jaxdp": 0.2, "ratio_jax_over_best_torch": 0.8,
           "best_torch": "torch.compile"}
    md = gpu_preset.quick_markdown({"train": train, "rows": [row], "environment": {"device_kind": "NVIDIA H100"},
                                    "pipeline": {"images_per_s": 25000.0}})
    assert "| jaxdp train end to end | 13,000 | 65% of the step; MFU in its records 1.3% |" in md
    assert "| torch_ref + torch.compile | 16,000 |" in md and "| jaxdp / best torch (step time) | 0.80 |" in md


def test_the_shipped_gpu_recipe_is_goyals_linear_scaling_with_warmup():
    """configs/resnet18-cifar10-gpu.toml, read as `jaxdp train --config` reads it: lr = 0.1 x
    batch / 256 and a linear warmup over 2 epochs of CIFAR-10's 50,000 images at that batch."""
    import os

    from jaxdp.cli.command import build_parser, config_from_args, with_file_options
    from jaxdp.config.tree import check_config
    from jaxdp.data.loader import steps_per_epoch

    path = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "resnet18-cifar10-gpu.toml")
    argv = ["train", "--config", path]
    parser = build_parser("train")
    cfg = config_from_args(with_file_options(parser, argv, parser.parse_args(argv)))
    check_config(cfg)
    assert (cfg.model, cfg.width, cfg.dataset, cfg.dtype) == ("resnet18", 64, "cifar10", "bfloat16")
    assert cfg.lr == pytest.approx(0.1 * cfg.global_batch_size / 256)
    assert cfg.schedule == "warmup_cosine" and cfg.warmup_steps == 2 * steps_per_epoch(50000, 1, cfg.global_batch_size)


def test_the_quick_bench_config_is_the_presets_with_the_command_lines_say():
    import argparse

    from torch_commands.bench.command import add_bench_args

    p = argparse.ArgumentParser()
    add_bench_args(p)
    args = p.parse_args(["--preset", "gpu", "--quick", "--levers", "default,autotune-0"])
    cfg = gpu_preset.preset_config(args, global_batch=gpu_preset.QUICK_BATCH, n=(1,), bare=False)
    assert (cfg["global_batch"], cfg["n"], cfg["bare"], cfg["width"], cfg["dtype"]) == (512, (1,), False, 64, "bfloat16")
    assert cfg["torch_compile"] == "inductor" and cfg["levers"] == ["default", "autotune-0"]
    args = p.parse_args(["--preset", "gpu", "--torch-compile", "aot_eager", "--no-bare"])
    assert gpu_preset.preset_config(args)["torch_compile"] == "aot_eager" and not gpu_preset.preset_config(args)["bare"]


def test_without_nvidia_smi_the_gpu_count_is_torchs(monkeypatch):
    import shutil

    import torch

    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert gpu_preset.visible_gpus() == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_preset.visible_gpus() == 0


def test_the_preset_turns_jax_preallocation_off_itself(monkeypatch):
    import sys

    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    monkeypatch.delitem(sys.modules, "jax")  # as before jax starts (restored after the test)
    gpu_preset.jax_off_preallocation()
    import os

    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"


def test_the_compile_preflight_names_what_inductor_lacks(monkeypatch, tmp_path):
    import importlib.util
    import shutil
    import sysconfig

    from torch_commands.bench.torch_side import compile_preflight

    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    why = compile_preflight("inductor", cuda=True)
    assert why.startswith("torch.compile preflight: inductor needs a C compiler (none of cc, gcc, clang on PATH); ")
    assert f"Python's headers ({tmp_path}/Python.h is missing" in why and "triton (pip install triton)" in why
    assert "C++ compiler (none of c++, g++, clang++" in compile_preflight("inductor", cuda=False)
    assert compile_preflight("aot_eager", cuda=True) is None and compile_preflight(None, cuda=True) is None
    (tmp_path / "Python.h").write_text("")
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert compile_preflight("inductor", cuda=True) is None


def _fake_sides(monkeypatch, compile_error=None):
    """Both sides of a bench row timed without running anything; torch.compile fails with
    ``compile_error`` (raised, as a crash in inductor would be)."""
    from torch_commands.bench import runner

    def fake_jax(name, n, cfg, images, labels, options=None, mesh=None, lever=None):
        return {"step_times_s": [0.5, 0.5]}

    def fake_torch(name, n, cfg, images, labels, timeout_s, options=None, compile_backend=None):
        if compile_backend and compile_error:
            raise RuntimeError(compile_error)
        return {"step_times_s": [1.0, 1.0]}
    monkeypatch.setattr(runner, "bench_jax", fake_jax)
    monkeypatch.setattr(runner, "bench_torch", fake_torch)
    monkeypatch.setattr(runner, "compile_preflight", lambda backend, cuda: None)
    return runner


BENCH_ARGV = ["bench", "--strategies", "ddp", "--devices", "1", "--width", "4", "--blocks", "1,1,1,1", "--global-batch",
              "2", "--steps", "2", "--warmup", "0", "--pipeline-images", "8", "--no-bare", "--torch-compile", "inductor"]


def test_a_torch_compile_that_fails_is_shown_and_the_bench_exits_1(monkeypatch, tmp_path, capsys):
    _fake_sides(monkeypatch, compile_error="InductorError: CppCompileError: C++ compile error")
    assert main([*BENCH_ARGV, "--out", str(tmp_path), "--tag", "b"]) == 1
    (row,) = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert row["torch_compile"]["error"].startswith("RuntimeError: InductorError: CppCompileError")
    assert row["ratio_jax_over_best_torch"] == 0.5 and row["best_torch"] == "eager"  # said, not hidden
    md = (tmp_path / "b.md").read_text()
    assert "**1 component(s) failed, 0 not run** (exit 1)" in md
    assert "- ERROR ddp N=1 torch_compile: RuntimeError: InductorError: CppCompileError: C++ compile error" in md
    assert "ERROR ddp N=1 torch_compile" in capsys.readouterr().out


def test_a_compile_preflight_failure_is_an_error_too(monkeypatch, tmp_path):
    runner = _fake_sides(monkeypatch)
    monkeypatch.setattr(runner, "compile_preflight",
                        lambda backend, cuda: backend and "torch.compile preflight: inductor needs X")
    assert main([*BENCH_ARGV, "--out", str(tmp_path), "--tag", "b"]) == 1
    (row,) = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert row["torch_compile"] == {"error": "torch.compile preflight: inductor needs X"} and row["torch_ref"]["images_per_s"]


def test_every_component_ran_exits_0_and_the_quick_deadline_leaves_the_rest_not_run(monkeypatch, tmp_path):
    _fake_sides(monkeypatch)
    assert main([*BENCH_ARGV, "--out", str(tmp_path), "--tag", "ok"]) == 0
    assert "component(s) failed" not in (tmp_path / "ok.md").read_text()

    monkeypatch.setattr(gpu_preset, "visible_gpus", lambda: 1)
    monkeypatch.setattr(gpu_preset, "run_train", lambda out, timeout_s: {"command": "jaxdp train ...",
                                                                          "images_per_s": 1.0, "timeout_s": timeout_s})
    out = tmp_path / "quick"
    assert main(["bench", "--preset", "gpu", "--quick", "--deadline", "1e-9", "--out", str(out), "--tag", "q"]) == 3
    result = json.loads((out / "q.json").read_text())
    (row,) = result["rows"]
    assert result["train"]["timeout_s"] == 1.0  # the time left, not train's own 240 s
    assert all(row[k]["not_run"].startswith("deadline: ") for k in ("jaxdp", "torch_ref", "torch_compile"))
    assert result["pipeline"]["not_run"].startswith("deadline: ")


def test_a_jax_that_cannot_mock_eight_gpus_says_so_without_failing_the_bench(monkeypatch, tmp_path):
    """Here (one CPU device once the suite's device flag is gone) no 8-device program runs: the
    component reports that in one line, which is not an error of the bench."""
    from torch_commands.bench.report import exit_status, problems

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    rec = gpu_preset.run_mock_topology(8, str(tmp_path), timeout_s=300)
    assert "error" not in rec and rec["command"].startswith("python -m jaxdp.analysis.mock_topology --devices 8")
    assert rec["report"]["unsupported"].startswith("no 8-device program runs here (MeshError: asked for 8 devices")
    result = {"rows": [], "extra": {"mock 8-GPU topology": rec}}
    assert problems(result) == {"errors": [], "not_run": []} and exit_status(result) == 0
    result["extra"]["mock 8-GPU topology"] = {"error": "zero3: XlaRuntimeError: ..."}
    assert exit_status(result) == 1
