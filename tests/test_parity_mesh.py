"""``jaxdp parity --mesh``: each layout reaches its runner, and the rest is one line
(parity_tests.layouts). The comparisons themselves are parity_tests/test_model_parallel.py's and
test_pipeline_parallel.py's."""

import json

import pytest

from jaxdp.cli.command import main
from parity_tests import model_parallel as mp
from parity_tests import mp_families
from parity_tests import pipeline_parallel as pp


class Passed:
    passed, divergence = True, None

    def to_json(self):
        return {"steps": []}


def test_a_model_axis_runs_the_tensor_parallel_parity_of_the_named_vit(monkeypatch, tmp_path, capsys):
    seen = {}
    monkeypatch.setattr(mp, "run", lambda cfg, bug=None: seen.update(cfg=cfg, bug=bug) or Passed())
    argv = ["parity", "--strategy", "zero3", "--mesh", "data=2,model=2", "--model", "vit-tiny", "--depth", "2",
            "--dim", "16", "--image-size", "16", "--steps", "3", "--batch-per-device", "4", "--optimizer", "adamw",
            "--out", str(tmp_path)]
    assert main(argv) == 0
    cfg = seen["cfg"]
    assert (cfg.strategy, cfg.data, cfg.model, cfg.steps, cfg.batch_per_rank, cfg.optimizer) == \
        ("zero3", 2, 2, 3, 4, "adamw")
    assert cfg.weight_decay == 0.01  # torch.optim.AdamW's default, on both sides (torch_config, jax_optimizer)
    assert cfg.torch_config["weight_decay"] == 0.01
    # vit-tiny's heads, mlp_dim and patch; the sizes given on the command line
    assert cfg.vit == dict(dim=16, depth=2, heads=3, mlp_dim=768, patch=4, num_classes=10, image_size=16)
    assert "tensor-parallel parity (zero3 data=2 x model=2" in capsys.readouterr().out
    assert json.loads((tmp_path / "report.json").read_text())["mesh"] == {"data": 2, "model": 2}


def test_a_model_axis_with_a_resnet_runs_the_channel_parallel_parity(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(mp, "run", lambda cfg, bug=None: seen.update(cfg=cfg) or Passed())
    assert main(["parity", "--mesh", "data=2,model=2", "--width", "4", "--blocks", "1,1,1,1",
                 "--optimizer", "sgd", "--out", str(tmp_path)]) == 0
    cfg = seen["cfg"]
    assert (cfg.family, cfg.data, cfg.model) == ("resnet", 2, 2)
    assert cfg.resnet == dict(name="resnet18", num_classes=10, width=4, blocks=(1, 1, 1, 1))


def test_a_stage_axis_runs_the_pipeline_parity_of_the_named_vit(monkeypatch, tmp_path, capsys):
    seen = {}
    monkeypatch.setattr(pp, "run", lambda cfg, bug=None: seen.update(cfg=cfg, bug=bug) or Passed())
    argv = ["parity", "--mesh", "data=2,stage=2", "--microbatches", "4", "--model", "vit-tiny", "--depth", "2",
            "--dim", "16", "--image-size", "16", "--steps", "3", "--batch-per-device", "8", "--optimizer", "sgd",
            "--inject-bug", "stage_order", "--out", str(tmp_path)]
    assert main(argv) == 3  # the mock "passes" with a bug injected: a bug the harness missed
    cfg = seen["cfg"]
    assert (cfg.data, cfg.stage, cfg.microbatches, cfg.steps, cfg.batch_per_rank, seen["bug"]) == \
        (2, 2, 4, 3, 8, "stage_order")
    assert cfg.weight_decay == 0.0  # SGD's: none
    assert cfg.vit == dict(dim=16, depth=2, heads=3, mlp_dim=768, patch=4, num_classes=10, image_size=16)
    assert "pipeline parity (ddp data=2 x stage=2, 4 micro-batches, vit-tiny" in capsys.readouterr().out
    assert json.loads((tmp_path / "report.json").read_text())["mesh"] == {"data": 2, "stage": 2}


def test_a_model_family_the_harness_does_not_know_is_one_line():
    with pytest.raises(ValueError, match=r"^the model-parallel parity runs the families vit, resnet, toy, not 'lstm'$"):
        mp.TPConfig(family="lstm")
    assert mp.TPConfig(family="resnet").family_row is mp_families.FAMILIES["resnet"]


@pytest.mark.parametrize("argv,message", [
    (["--mesh", "data=2,model=2", "--model", "resnet18", "--strategy", "zero1"], "runs ddp or zero3"),
    (["--mesh", "data=2,model=2", "--devices", "8"], "holds 4 devices but --devices is 8"),
    (["--mesh", "replica=2,data=2"], "HSDP's replica axis"),
    (["--mesh", "data=2,model=2", "--model", "vit-tiny", "--strategy", "zero1"], "runs ddp or zero3"),
    (["--mesh", "data=2,model=2", "--model", "vit-tiny", "--dtype", "float32"], "runs in float64"),
    (["--mesh", "data=2,stage=2", "--width", "4", "--blocks", "1,1,1,1"], "parity on a stage axis runs a ViT"),
    (["--mesh", "data=2,stage=2", "--model", "vit-tiny", "--strategy", "zero3"], "pipeline parity runs ddp"),
    (["--mesh", "data=2,stage=2", "--model", "vit-tiny", "--inject-bug", "missing_row_all_reduce"],
     "on a stage axis the injectable bugs are loss_scale, stage_order"),
    (["--mesh", "data=4", "--microbatches", "2"], "--microbatches are pipeline micro-batches: give --mesh a stage"),
], ids=["resnet", "devices", "replica", "strategy", "dtype", "stage-resnet", "stage-strategy", "stage-bug",
        "microbatches"])
def test_a_mesh_parity_cannot_run_is_one_line(argv, message, capsys):
    assert main(["parity", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxdp parity: error: ") and message in err and "\n" not in err, err
