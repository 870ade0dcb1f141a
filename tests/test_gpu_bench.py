"""``jaxdp bench --preset gpu --quick`` (``make gpu-bench``) without a GPU: the dry run's plan
(with a faked GPU count), the one-line refusal, the train run's command against the real
parser, and the summary read from train's records and a bench result."""

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
    assert "host input pipeline" in out


def test_quick_refuses_without_a_gpu_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(gpu_preset, "visible_gpus", lambda: 0)
    assert main(["bench", "--preset", "gpu", "--quick"]) == 2
    assert capsys.readouterr().err.strip() == ("jaxdp: error: --preset gpu needs CUDA GPUs and nvidia-smi lists none; "
                                               "--dry-run prints the rows it runs")


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
