"""``jaxdp export --torch RUN_DIR out.pt``: the newest checkpoint as a torch state_dict that
torch_ref's model loads strictly and that computes what jaxdp's model computes."""

import os

import jax
import numpy as np
import torch

from jaxdp.cli.command import main
from jaxdp.config.tree import TrainConfig
from jaxdp.models import create_model
from jaxdp.run.train import train
from torch_ref.models import create_model as torch_model

TINY = dict(width=4, blocks=(1, 1, 1, 1), synthetic_size=(64, 32), global_batch_size=16, devices=2, epochs=1,
            lr=0.05, progress=False)


def test_export_is_loaded_strictly_by_torch_ref_and_gives_jaxdps_logits(tmp_path, capsys):
    cfg = TrainConfig(out=str(tmp_path / "run"), strategy="zero3", **TINY)  # sharded state on disk
    final = train(cfg)
    assert main(["export", "--torch", cfg.out, str(tmp_path / "model.pt")]) == 0
    assert f"from {cfg.out} step 4" in capsys.readouterr().out

    net = torch_model("resnet18", width=4, blocks=(1, 1, 1, 1)).eval()
    net.load_state_dict(torch.load(tmp_path / "model.pt"), strict=True)
    x = np.random.default_rng(0).normal(size=(4, 32, 32, 3)).astype(np.float32)
    with torch.no_grad():
        got = net(torch.from_numpy(x.transpose(0, 3, 1, 2))).numpy()

    state = jax.device_get(final["state"])  # the trained state the last checkpoint holds
    model = create_model("resnet18", width=4, blocks=(1, 1, 1, 1))
    want = np.asarray(model.apply({"params": state.params, **state.model_state}, x, train=False))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert net.bn1.num_batches_tracked.item() == 4


def test_export_of_a_directory_without_a_run_is_one_line(tmp_path, capsys):
    assert main(["export", "--torch", str(tmp_path), str(tmp_path / "model.pt")]) == 2
    assert capsys.readouterr().err == f"jaxdp: error: {tmp_path} is not a jaxdp run directory (it has no config.json)\n"
    assert not os.path.exists(tmp_path / "model.pt")
