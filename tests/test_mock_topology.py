"""``python -m jaxdp.analysis.mock_topology`` on CPU: each strategy's step compiled once for 8
devices and read (its schedule's asynchronous collectives, its memory beside the ZeRO formula,
its step time beside N = 1). On a GPU the same code runs under JAX's mock 8-GPU topology; here on
the suite's 8 simulated CPU devices, where XLA runs every collective synchronously."""

import json

import jax
import jax.numpy as jnp


from jaxdp.analysis import mock_topology as mock
from jaxdp.models import create_model

TINY = dict(width=4, blocks=(1, 1, 1, 1), batch_per_device=2, image_size=8, dtype="float32", steps=2)


def test_each_strategy_at_8_devices_is_read_from_its_compiled_step(capsys):
    report = mock.run(8, ("ddp", "zero3"), **TINY)
    assert "unsupported" not in report and report["backend"] == "cpu"
    ddp, zero3 = report["rows"]
    psi = ddp["psi"]
    for row in (ddp, zero3):
        assert row["n"] == 8 and "error" not in row and "step_error" not in row and row["step_s"] > 0
        assert (row["async_pairs"], row["overlapped_pairs"]) == (0, 0)  # XLA:CPU: synchronous collectives
    assert "all-reduce" in ddp["collectives"] and {"all-gather", "reduce-scatter"} <= set(zero3["collectives"])
    # SGD with momentum: DDP keeps 4 + 4 bytes per parameter on every device, ZeRO-3 an eighth (padded)
    assert ddp["formula_state_bytes"] == 8 * psi
    assert 8 * psi / 8 <= zero3["formula_state_bytes"] < 8 * psi / 8 * 1.05
    # the compiled step's arguments are that state, the batch, the BatchNorm statistics (replicated
    # under both) and the step counter: nothing else
    batch = TINY["batch_per_device"] * (8 * 8 * 3 * 4 + 4)
    net = create_model("resnet18", width=4, blocks=(1, 1, 1, 1), dtype="float32")
    shapes = jax.eval_shape(net.init, jax.random.key(0), jnp.zeros((2, 8, 8, 3)))["batch_stats"]
    stats = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(shapes))
    for row in (ddp, zero3):
        assert row["memory"]["argument_bytes"] - row["formula_state_bytes"] - batch - stats == 4, row["strategy"]
    assert report["n1_step_s"] > 0
    md = mock.markdown(report)
    assert "| ddp | 0 | 0 |" in md and "no overlap can show on a CPU" in md
    assert "ddp: 0 async collectives, 0 overlapped" in capsys.readouterr().out


def test_a_topology_that_cannot_run_is_one_line(tmp_path):
    report = mock.run(16, ("ddp",), **TINY)  # the suite has 8 devices
    assert report["rows"] == [] and report["unsupported"].startswith("no 16-device program runs here (MeshError: ")
    assert "\n" not in report["unsupported"]
    assert mock.markdown(report).endswith(report["unsupported"])
    assert mock.main(["--cpu", "--devices", "16", "--strategies", "ddp", "--width", "4", "--dtype", "float32",
                      "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "mock.json").read_text())["unsupported"] == report["unsupported"]
