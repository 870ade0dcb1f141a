"""The trainer and CLI: bit-exact resume, and clear one-line errors for bad input."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from jaxdp.cli import main
from jaxdp.config import TrainConfig
from jaxdp.train import train

TINY = dict(width=4, blocks=(1, 1, 1, 1), synthetic_size=(256, 64), global_batch_size=32, devices=2,
            epochs=2, lr=0.05, progress=False)


def read_records(out, kind="train"):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def test_interrupted_and_resumed_run_is_bit_exact(tmp_path):
    whole = TrainConfig(out=str(tmp_path / "whole"), **TINY)
    expected = train(whole)

    split = dataclasses.replace(whole, out=str(tmp_path / "split"))
    first = train(split, stop_after_steps=5)  # mid-epoch: 8 steps per epoch
    assert first["interrupted"]
    resumed = train(dataclasses.replace(split, resume=True))

    losses = [r["loss"] for r in read_records(whole.out)]
    assert len(losses) == 16
    assert [r["loss"] for r in read_records(split.out)] == losses  # exact, float32 included
    assert read_records(split.out, "eval") == read_records(whole.out, "eval")
    for a, b in zip(jax.tree_util.tree_leaves(resumed["state"]), jax.tree_util.tree_leaves(expected["state"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_resume_refuses_a_different_config(tmp_path, capsys):
    cfg = TrainConfig(out=str(tmp_path), **dict(TINY, epochs=1))
    train(cfg, stop_after_steps=2)
    code = main(["train", "--out", str(tmp_path), "--resume", "--width", "8", "--blocks", "1,1,1,1",
                 "--synthetic-size", "256,64", "--global-batch-size", "32", "--devices", "2", "--lr", "0.05",
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "width: checkpoint 4 vs now 8" in err


def test_loss_falls_on_the_synthetic_set(tmp_path):
    result = train(TrainConfig(out=str(tmp_path), **dict(TINY, synthetic_size=(1024, 256), epochs=3, lr=0.1)))
    losses = [r["loss"] for r in read_records(str(tmp_path))]
    assert np.mean(losses[-8:]) < np.mean(losses[:8]) - 0.1
    assert result["eval"]["count"] == 256


@pytest.mark.parametrize("args, message", [
    (["--global-batch-size", "30", "--devices", "4"], "not divisible by devices x accumulation steps = 4 x 1"),
    (["--strategy", "zero9"], "unknown strategy 'zero9'; choose one of ddp, zero1, zero2, zero3, hsdp, dp, async"),
    (["--model", "resnet9"], "unknown model 'resnet9'; choose one of resnet18, resnet34, resnet50"),
    (["--optimizer", "lamb"], "lamb"),
    (["--schedule", "poly"], "poly"),
    (["--dataset", "mnist"], "mnist"),
    (["--devices", "64"], "xla_force_host_platform_device_count"),
    (["--dataset", "cifar10", "--data-dir", "/nonexistent/cifar"], "cifar-10"),
])
def test_bad_input_is_one_clear_line(tmp_path, capsys, args, message):
    code = main(["train", "--out", str(tmp_path), "--no-progress", *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("jaxdp: error: ") and err.count("\n") == 1
    assert message.lower() in err.lower()
    assert not os.path.exists(os.path.join(tmp_path, "checkpoints", "0"))


def quickstart_args():
    """The exact arguments `make train` (the README's quickstart) passes to `jaxdp train`."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "Makefile")) as f:
        text = f.read().replace("\\\n", " ")
    line = next(l for l in text.splitlines() if l.startswith("QUICKSTART_ARGS"))
    return line.split(":=", 1)[1].split()


@pytest.mark.slow
def test_quickstart_learns_far_better_than_chance(tmp_path):
    args = quickstart_args()
    out = args.index("--out")
    args[out + 1] = str(tmp_path)
    assert main(["train", *args, "--no-progress"]) == 0
    final = read_records(str(tmp_path), "eval")[-1]
    assert final["accuracy"] > 0.5  # chance is 0.1
