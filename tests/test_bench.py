"""``jaxdp bench`` end to end with tiny settings: one strategy, N = 2, both frameworks and their bare steps.

Checks the plumbing (table, JSON, Markdown, PNG; a timed row for each framework; the
HLO traffic beside its formula), never the speed. Runs in-process (conftest has
already simulated 8 devices, so the bench's own device flag is a no-op here).
"""

import json
import os

import pytest

from jaxdp.cli.command import main


def test_bench_smoke(tmp_path, capsys):
    out = tmp_path / "bench"
    rc = main(["bench", "--strategies", "ddp", "--devices", "2", "--width", "4", "--blocks", "1,1,1,1",
               "--global-batch", "4", "--steps", "2", "--warmup", "1", "--pipeline-images", "64",
               "--out", str(out), "--tag", "smoke"])
    assert rc == 0
    assert "| ddp | 2 |" in capsys.readouterr().out
    for ext in ("json", "md", "png"):
        assert os.path.getsize(out / f"smoke.{ext}") > 0
    result = json.loads((out / "smoke.json").read_text())
    (row,) = result["rows"]
    assert row["strategy"] == "ddp" and row["n"] == 2
    for fw in ("jaxdp", "torch_ref"):
        assert len(row[fw]["step_times_s"]) == 2, row[fw]
        assert row[fw]["median_step_s"] > 0
    assert row["ratio_jax_over_torch"] > 0
    j = row["jaxdp"]
    assert j["compile_s"] > 0 and j["memory"]["total_bytes"] > 0
    # DDP's all-reduce of the f32 params: measured ring bytes within 5% of 2(N-1)/N·4Ψ (plus BN/metrics).
    assert abs(j["collectives"]["ring_bytes"] / j["traffic_formula_bytes"] - 1) < 0.05
    assert result["environment"]["loadavg"] and result["pipeline"]["images_per_s"] > 0
    # The bare steps at the row's per-device batch (2 images), and each framework's step over its own.
    bare = result["bare"]["2"]
    assert bare["batch_per_device"] == 2
    for fw, base in (("jaxdp", "jax"), ("torch_ref", "torch")):
        assert len(bare[base]["step_times_s"]) == 2 and bare[base]["loss"] > 0, bare[base]
        assert row[f"overhead_{fw}"] == row[fw]["median_step_s"] / bare[base]["median_step_s"]
    assert "| ddp | 2 | 2 |" in (out / "smoke.md").read_text()


def test_bench_gpu_preset_dry_run_lists_its_rows(capsys):
    from torch_commands.bench.gpu_preset import ASSUMED_GPUS, visible_gpus

    assert main(["bench", "--preset", "gpu", "--dry-run", "--strategies", "ddp,zero3"]) == 0
    out = capsys.readouterr().out
    gpus = visible_gpus() or ASSUMED_GPUS
    rows = [line for line in out.splitlines() if line.startswith("  batch/device")]
    # per-device batches 256 and 512, N = 1 and every GPU, two strategies
    assert len(rows) == 2 * len({1, gpus}) * 2 and "bfloat16 compute with fp32 master weights" in out
    assert any(f"N {gpus:>2}  global batch {512 * gpus:>5}  zero3" in line for line in rows)
    assert all("torch.compile" in line and "bare jax" in line for line in rows)


def test_bench_gpu_preset_refuses_without_a_gpu_in_one_line(capsys):
    from torch_commands.bench.gpu_preset import visible_gpus

    if visible_gpus():
        pytest.skip("a GPU is visible: the preset would run")
    assert main(["bench", "--preset", "gpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("jaxdp: error: --preset gpu needs CUDA GPUs and neither nvidia-smi nor torch sees one; --dry-run "
                   "prints the rows it runs")
    assert main(["bench", "--preset", "cpu"]) == 2 and "the one preset is gpu" in capsys.readouterr().err


def test_scaling_efficiency_is_against_n1_at_the_same_batch_per_device():
    from torch_commands.bench.gpu_preset import scaling_efficiency

    rows = [{"strategy": "ddp", "n": 1, "global_batch": 256, "jaxdp": {"images_per_s": 100.0}},
            {"strategy": "ddp", "n": 4, "global_batch": 1024, "jaxdp": {"images_per_s": 360.0},
             "torch_ref": {"images_per_s": 300.0}},
            {"strategy": "ddp", "n": 4, "global_batch": 2048, "jaxdp": {"images_per_s": 390.0}}]
    scaling_efficiency(rows)
    assert rows[1]["scaling_jaxdp"] == 0.9 and "scaling_torch_ref" not in rows[1]  # no torch row at N = 1
    assert "scaling_jaxdp" not in rows[2]  # 512 per device: no N = 1 row at that batch


def test_bench_mesh_layout_row_has_traffic_per_axis(tmp_path):
    """--mesh data=2,model=2: one jaxdp row, its model-axis traffic the Megatron formula, data DDP's."""
    out = tmp_path / "layouts"
    rc = main(["bench", "--mesh", "data=2,model=2", "--strategies", "ddp", "--model", "vit-tiny", "--depth", "1",
               "--dim", "16", "--heads", "4", "--mlp-dim", "32", "--patch", "8", "--global-batch-size", "4",
               "--steps", "1", "--warmup", "0", "--out", str(out), "--tag", "mesh"])
    assert rc == 0
    (row,) = json.loads((out / "mesh.json").read_text())["rows"]
    assert row["mesh"] == {"data": 2, "model": 2} and row["bubble"] is None
    axes = row["jaxdp"]["axes"]
    assert set(axes["traffic"]) == {"data", "model"}
    assert axes["traffic"]["model"]["ring_bytes"] == axes["traffic_formula"]["model"] > 0
    assert abs(axes["traffic"]["data"]["ring_bytes"] / axes["traffic_formula"]["data"] - 1) < 0.01
    assert "| ddp | data=2,model=2 |" in (out / "mesh.md").read_text()


def test_a_stage_row_shows_its_measured_bubble_beside_gpipes():
    """The PPxDP row's bubble: 1 - t(data=4) / t(data=2,stage=2), beside (S-1)/(M+S-1)."""
    from torch_commands.bench.layouts import add_measured_bubbles, layout_line

    def row(mesh, step_s, bubble=None):
        axes = {"traffic": {}, "traffic_formula": {}, "state": {}}
        return {"strategy": "ddp", "mesh": mesh, "n": 4, "bubble": bubble, "bubble_measured": None,
                "jaxdp": {"median_step_s": step_s, "images_per_s": 16 / step_s, "axes": axes}}

    rows = [row({"data": 4}, 0.3), row({"data": 2, "model": 2}, 0.4), row({"data": 2, "stage": 2}, 0.5, 1 / 3)]
    add_measured_bubbles(rows)
    assert [r["bubble_measured"] for r in rows] == [None, None, pytest.approx(1 - 0.3 / 0.5)]
    assert layout_line(rows[2]).endswith("| 0.40 / 0.33 |") and layout_line(rows[0]).endswith("|  |")
