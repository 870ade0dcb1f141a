"""A strategy defined here, in the test, reaches train, inspect, plan and bench by one registry row,
and ``jaxdp parity`` with its torch twin.

The toy is DDP under another name with one option fixed by the name (``allreduce="ring"``):
registering its row (``jaxdp.registry``) is the only step; no file of jaxdp, the bench or
the planner names it. The row is removed after the test, and the CLI then refuses the name.
With a torch twin (``TOY_TWIN``, below, named by the row) it is three pieces: its module, its
row and its twin; the parity harness, its float64 bounds and its injected bugs take it as it is.
"""

import dataclasses
import json
import os

import numpy as np
import pytest

from jaxdp import registry
from jaxdp.cli.command import main
from jaxdp.strategies.ddp import DDP
from torch_ref.strategies import DDP_OPTIONS, Twin, ddp

TINY = ["--width", "4", "--blocks", "1,1,1,1"]


class Toy(DDP):
    facts = dataclasses.replace(DDP.facts, name="toy")
    built = []  # the sync of every Toy built: the fixed option reached the constructor

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        Toy.built.append(self.sync.allreduce)


def toy_twin(model, *, device, **options):
    """The toy's PyTorch twin: torch's DDP, whose gloo all-reduce sums what the toy's ring sums."""
    return ddp(model, device=device, **options)


# The toy's twin, as a new strategy's twin module in torch_ref would define it. Its row names it
# "module:attr": the torch ranks import this module to find it.
TOY_TWIN = Twin(toy_twin, DDP_OPTIONS)


@pytest.fixture
def toy():
    Toy.built.clear()
    with registry.registered(registry.Row("toy", Toy, {"allreduce": "ring"})) as row:
        yield row
    assert "toy" not in registry.names()


def test_a_toy_strategy_reaches_train_inspect_plan_and_bench(toy, tmp_path, capsys):
    # jaxdp train: two steps of the tiny ResNet on two devices.
    run = tmp_path / "run"
    assert main(["train", "--strategy", "toy", *TINY, "--synthetic-size", "64,16", "--global-batch-size", "16",
                 "--devices", "2", "--max-steps", "2", "--no-progress", "--no-tensorboard", "--out", str(run)]) == 0
    with open(run / "metrics.jsonl") as f:
        losses = [r["loss"] for r in map(json.loads, f) if r["kind"] == "train"]
    assert len(losses) == 2 and np.isfinite(losses).all()
    assert json.loads((run / "config.json").read_text())["strategy"] == "toy"
    assert Toy.built == ["ring"]

    # jaxdp inspect: its facts (DDP's all-reduce formula) against the traced program.
    capsys.readouterr()
    assert main(["inspect", "--strategy", "toy", "--devices", "2", *TINY, "--image-size", "16", "--no-compile",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["strategy"] == "toy" and report["devices"] == 2 and report["traffic_formula_bytes"] > 0

    # jaxdp plan: a candidate by default, planned like any other.
    from jaxdp.analysis.plan import candidates

    assert "toy" in candidates()
    assert main(["plan", "--devices", "2", "--global-batch-size", "4", *TINY, "--image-size", "16",
                 "--strategies", "toy", "--no-verify", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["strategy"] == "toy" and row["fits"] and row["traffic_bytes"] > 0

    # jaxdp bench, the jax side (the toy has no torch twin): one timed row.
    out = tmp_path / "bench"
    assert main(["bench", "--strategies", "toy", "--devices", "2", *TINY, "--global-batch-size", "4", "--steps", "1",
                 "--warmup", "0", "--no-torch", "--no-bare", "--pipeline-images", "16", "--out", str(out),
                 "--tag", "toy"]) == 0
    (bench_row,) = json.loads((out / "toy.json").read_text())["rows"]
    assert bench_row["strategy"] == "toy" and len(bench_row["jaxdp"]["step_times_s"]) == 1
    assert Toy.built == ["ring"] * len(Toy.built) and len(Toy.built) >= 4


@pytest.mark.slow
def test_a_toy_strategy_with_a_torch_twin_is_paired_by_jaxdp_parity(tmp_path, capsys):
    """Its module (``Toy``), its row and its twin (``TOY_TWIN``): ``jaxdp parity`` pairs it and it
    passes, float64, N = 2, the tiny ResNet, every tensor at every step within 1e-10; and an injected
    bug (the catalogue names no strategy) reaches its step and is caught."""
    Toy.built.clear()
    twin = f"{__name__}:TOY_TWIN"
    args = ["parity", "--strategy", "toy", "--devices", "2", "--dtype", "float64", *TINY, "--image-size", "16",
            "--steps", "3"]
    with registry.registered(registry.Row("toy", Toy, {"allreduce": "ring"}, torch_twin=twin)):
        assert main([*args, "--out", str(tmp_path / "clean")]) == 0, capsys.readouterr()
        report = json.loads((tmp_path / "clean" / "report.json").read_text())
        assert report["passed"] and report["plan"]["torch"]["strategy"] == twin
        assert len(report["comparison"]["steps"]) == 3 and Toy.built == ["ring"]
        assert main([*args, "--inject-bug", "missing_1_over_n", "--out", str(tmp_path / "bug")]) == 1
        divergence = json.loads((tmp_path / "bug" / "report.json").read_text())["comparison"]["divergence"]
        assert (divergence["step"], divergence["category"]) == (0, "grads")
        assert abs(divergence["rel"] - 1) < 1e-12  # every gradient twice torch's: summed over N = 2, not averaged
    assert "toy" not in registry.names()


def test_an_unregistered_name_is_refused_in_one_line(capsys):
    assert "toy" not in registry.names()
    assert main(["train", "--strategy", "toy", "--out", os.devnull]) == 2
    assert "unknown strategy 'toy'" in capsys.readouterr().err


def test_the_registry_and_the_cli_choices_load_without_jax():
    import subprocess
    import sys

    code = "import sys, jaxdp.config.choices, jaxdp.registry; print(jaxdp.config.choices.STRATEGIES, 'jax' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == f"{registry.names()} False"


def test_bucket_cap_mb_has_one_default_the_cli_library_and_torch_ref_read():
    """torch DDP's own default (None: a 1 MiB first bucket, then 25 MiB) on all three sides."""
    import inspect

    from jaxdp.config.tree import TrainConfig
    from jaxdp.strategies import options_of
    from jaxdp.strategies.sync.buckets import MIB, bucket_limits
    from torch_ref.strategies import ddp as torch_ddp

    assert bucket_limits(registry.BUCKET_CAP_MB) == [1 * MIB, 25 * MIB]
    assert TrainConfig().bucket_cap_mb == registry.BUCKET_CAP_MB
    assert inspect.signature(torch_ddp).parameters["bucket_cap_mb"].default == registry.BUCKET_CAP_MB
    takers = [n for n in registry.names() if "bucket_cap_mb" in options_of(n)]
    assert takers and all(options_of(n)["bucket_cap_mb"] == registry.BUCKET_CAP_MB for n in takers)


def test_the_default_hsdp_mesh_is_one_definition():
    """jaxdp, torch_ref and gpu-check give the mesh object's (replicas, shards) on one host; N = 2 is (2, 1)."""
    from types import SimpleNamespace

    from jaxdp.runtime.mesh import MeshDims
    from jaxdp.strategies.zero import default_hsdp_shape
    from torch_commands.gpu_check.plan import TINY, parity_argv as gpu_check_argv
    from torch_ref.strategies import hsdp_mesh_shape, twin

    assert MeshDims.hsdp_default(2) == (2, 1) and MeshDims.hsdp_default(8) == (2, 4)
    assert MeshDims.hsdp_default(3) == (1, 3) and MeshDims.hsdp_default(8, hosts=4) == (4, 2)
    for n in range(1, 9):
        host = [SimpleNamespace(process_index=0)] * n
        assert default_hsdp_shape(host) == hsdp_mesh_shape(None, n) == MeshDims.hsdp_default(n), n
        argv = gpu_check_argv("hsdp", "float64", n, "gloo", TINY["simulate"], "out")  # gpu-check's hsdp pairs
        assert argv[argv.index("--mesh-shape") + 1] == ",".join(map(str, MeshDims.hsdp_default(n))), n
    assert [registry.mesh_shape(n, 4) for n in registry.names()] == [
        (2, 2) if registry.row(n).replicas else None for n in registry.names()]
    assert all(twin(registry.row(n).torch_twin) for n in registry.names() if registry.row(n).torch_twin)  # each is built
