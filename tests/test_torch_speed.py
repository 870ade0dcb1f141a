"""torch_ref's bench-only speed settings (step_api's ``tuned`` and ``compile``) and the bench's
torch.compile rows and levers.

The compile switch is tested with ``backend="aot_eager"``: dynamo's graph capture and
AOTAutograd's joint forward/backward graph, as inductor gets them, without inductor's C++
code generation. Inductor itself compiles on this CPU (gcc; ~14 s for a width-4 ResNet's
first step, too slow for the suite), but under DDP in a forkserver rank on CPU it crashed
the process ("double free or corruption", torch 2.13): the GPU bench uses inductor on CUDA.
"""

import json

import numpy as np
import pytest
import torch

TINY = dict(model="resnet18", width=4, blocks=(1, 1, 1, 1), strategy="ddp", lr=0.1, total_steps=4)


@pytest.fixture
def group_of_one(tmp_path):
    from torch_ref import dist as tdist

    tdist.init(60.0, init_method="file://" + str(tmp_path / "store"), rank=0, world_size=1, backend="gloo")
    yield
    tdist.shutdown()


def test_torch_compile_switch_steps_as_eager_does(group_of_one):
    from torch_ref.step_api import build

    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(4, 16, 16, 3)).astype(np.float32), rng.integers(0, 10, size=4)) for _ in range(2)]
    eager, compiled = build(TINY), build(dict(TINY, compile="aot_eager"))
    assert isinstance(compiled.parallel.model, torch._dynamo.eval_frame.OptimizedModule)
    assert not isinstance(eager.parallel.model, torch._dynamo.eval_frame.OptimizedModule)
    for x, y in batches:
        want, got = eager.step(x, y), compiled.step(x, y)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
        for name, p in want["params"].items():
            np.testing.assert_allclose(got["params"][name], p, rtol=1e-5, atol=1e-7, err_msg=name)


def test_tuned_is_channels_last_on_cuda_only_and_off_by_default():
    from torch_ref.step_api import DEFAULTS, memory_format, strategy_options

    assert DEFAULTS["tuned"] is False and DEFAULTS["compile"] is None  # parity never sets them
    assert memory_format({"tuned": True}, torch.device("cuda", 0)) == torch.channels_last
    assert memory_format({"tuned": True}, torch.device("cpu")) == torch.contiguous_format
    assert memory_format({"tuned": False}, torch.device("cuda", 0)) == torch.contiguous_format
    # speed settings are no strategy options: a strategy never refuses them
    assert "tuned" not in strategy_options(dict(DEFAULTS, strategy="zero3", tuned=True, compile="eager"))


def test_bench_times_torch_compile_and_each_lever(tmp_path):
    """One ddp row per lever; torch (eager and compiled) on the first lever's row only; the
    headline ratio against the faster torch; each lever's compile options in its record."""
    from jaxdp.cli.command import main

    out = tmp_path / "bench"
    rc = main(["bench", "--strategies", "ddp", "--devices", "1", "--width", "4", "--blocks", "1,1,1,1",
               "--global-batch-size", "2", "--steps", "1", "--warmup", "0", "--no-bare", "--pipeline-images", "16",
               "--torch-compile", "aot_eager", "--levers", "default,no-donation",
               "--out", str(out), "--tag", "t"])
    assert rc == 0
    rows = json.loads((out / "t.json").read_text())["rows"]
    assert [r["lever"] for r in rows] == ["default", "no-donation"]
    first, no_donation = rows
    assert first["torch_compile"]["warmup"] == 1 and first["torch_compile"]["config"]["compile"] == "aot_eager"
    assert first["torch_ref"]["config"]["tuned"] is True and first["torch_ref"]["config"]["compile"] is None
    best = min(first["torch_ref"]["median_step_s"], first["torch_compile"]["median_step_s"])
    assert first["ratio_jax_over_best_torch"] == first["jaxdp"]["median_step_s"] / best
    assert "torch_ref" not in no_donation and "torch_compile" not in no_donation
    assert first["jaxdp"]["donate"] and not no_donation["jaxdp"]["donate"]
    assert "| ddp [no-donation] | 1 |" in (out / "t.md").read_text()


def test_gpu_levers_are_compile_options_xla_accepts(monkeypatch):
    """XLA:CPU knows every GPU option's name (one DebugOptions), so a misspelt lever fails here."""
    import jax
    import jax.numpy as jnp

    from torch_commands.bench.levers import LEVERS, compiler_options

    monkeypatch.delenv("JAXDP_COMPILER_OPTIONS", raising=False)  # a GPU's defaults, not conftest's
    for name in LEVERS:
        options = compiler_options(name, "gpu")
        assert options == (LEVERS[name].get("compile_options") or None), name
        jax.jit(lambda x: x @ x, compiler_options=options).lower(jnp.ones((2, 2))).compile()


def test_torch_ref_train_hands_the_compile_switch_to_the_step(tmp_path, monkeypatch):
    """``torch_ref.train --compile aot_eager`` reaches ``step_api.build`` (the switch itself is
    tested above); ``build`` is replaced, so no model is built."""
    from jaxdp.cli.command import config_from_args
    from torch_ref import train as torch_train

    args = torch_train.build_parser().parse_args(
        ["--width", "4", "--synthetic-size", "16,8", "--global-batch-size", "8", "--out", str(tmp_path),
         "--compile", "aot_eager", "--tuned"])
    built = []
    monkeypatch.setattr(torch_train, "build", built.append)
    torch_train._setup(config_from_args(args), {"compile": args.compile, "tuned": args.tuned})
    assert built[0]["compile"] == "aot_eager" and built[0]["tuned"] is True and built[0]["width"] == 4
