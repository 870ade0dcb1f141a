"""gpu-check's plan and verdict, checked on CPU with a faked GPU count: the plan is final and fits
its budget before anything runs, and the verdict is PASS only when every planned pair ran and
passed (a pair that did not run makes it INCOMPLETE, exit 3). One tiny ``--simulate 2`` pair runs
the check end to end on simulated devices."""

import json
import subprocess
from dataclasses import asdict
from pathlib import Path

import pytest

from helpers import fake_gpus
from torch_commands.gpu_check import plan as planning, report, run
from torch_commands.gpu_check.command import main
from torch_commands.gpu_check.plan import REALISTIC, parity_config

EVERY = ("ddp", "zero1", "zero2", "zero3", "hsdp", "dp")
# The one-GPU plan in its order of value (issue 38): every strategy at the realistic size in
# float32, zero3 in bf16 (FSDP2's BatchNorm policy), ddp and zero3 in float64, the ViT in float32 and bf16.
ONE_GPU = [f"{s}-float32-resnet18-w64-n1" for s in EVERY] + [
    "zero3-bfloat16-resnet18-w64-n1", "ddp-float64-resnet18-w64-n1", "zero3-float64-resnet18-w64-n1",
    "ddp-float32-vit-tiny-n1", "ddp-bfloat16-vit-tiny-n1"]


@pytest.fixture
def gpus(monkeypatch):
    return fake_gpus(monkeypatch)


def test_every_gpu_checked_strategy_is_in_the_plan():
    assert planning.strategies() == EVERY


def test_the_one_gpu_plan_is_every_wanted_pair_within_the_budget_by_its_own_estimate(gpus, tmp_path, capsys):
    gpus(1)
    out = tmp_path / "plan"
    assert main(["--dry-run", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = json.loads((out / "report.json").read_text())
    assert (plan["status"], plan["n"], plan["simulated_n"], plan["bench"], plan["left_out"]) == \
        ("DRY RUN", 1, [2, 3], None, [])
    on_gpu = [p for p in plan["pairs"] if p["where"] == "gpu"]
    simulated = [p for p in plan["pairs"] if p["where"] == "simulated cpu"]
    assert [p["id"] for p in on_gpu] == ONE_GPU and plan["pairs"] == on_gpu + simulated
    assert [p["id"] for p in simulated] == [f"{s}-float64-n{n}-simulated" for n in (2, 3) for s in EVERY]
    # fits: the GPU pairs after start-up, and the simulated child beside them, each within the budget
    gpu_s = planning.STARTUP_S + sum(p["estimate_s"] for p in on_gpu)
    child_s = planning.SIMULATED_STARTUP_S + sum(p["estimate_s"] for p in simulated)
    assert plan["estimate_s"] == max(gpu_s, child_s) <= plan["budget_s"] == 360
    assert plan["deadline_s"] == 540
    for p in on_gpu:
        cfg = parity_config(p["argv"])  # the command is the configuration
        assert (p["n"], cfg.devices, cfg.backend, p["torch_ranks"]) == (1, 1, "nccl", 1)
        assert (cfg.strategy, cfg.dtype, cfg.steps, cfg.batch_per_device, cfg.image_size) == \
            (p["strategy"], p["dtype"], 2, 64, 32)
        if cfg.model == "resnet18":
            assert (cfg.width, cfg.blocks, cfg.optimizer, cfg.nesterov) == (64, (2, 2, 2, 2), "sgd", True)
        else:  # ViT-Tiny at its real size (dim 192, depth 12) with AdamW
            assert (cfg.model, cfg.dim, cfg.optimizer, cfg.lr) == ("vit-tiny", None, "adamw", 1e-3)
    for p in simulated:
        cfg = parity_config(p["argv"])
        assert (cfg.backend, cfg.dtype, p["torch_ranks"]) == ("gloo", "float64", p["n"])
    assert "23 pair(s), estimated 320 s (budget 360 s, deadline 540 s)" in printed
    assert (out / "report.md").read_text().count("| **simulated CPU** |") == len(simulated)


def test_a_smaller_budget_leaves_the_least_valuable_pairs_out_of_the_plan_by_name(gpus, tmp_path):
    gpus(1)
    assert main(["--dry-run", "--budget", "200", "--out", str(tmp_path)]) == 0
    plan = json.loads((tmp_path / "report.json").read_text())
    ran = [p["id"] for p in plan["pairs"] if p["where"] == "gpu"]
    assert ran == ONE_GPU[:len(ran)] and 0 < len(ran) < len(ONE_GPU) and plan["estimate_s"] <= 200
    assert [x.split(" ")[0] for x in plan["left_out"]] == ONE_GPU[len(ran):]
    assert any("--full runs every realistic pair" in n for n in plan["notes"])


def test_the_multi_gpu_plan_runs_the_tiny_pairs_at_n_then_realistic_ones_by_value(gpus, tmp_path, capsys):
    gpus(0)
    assert main(["--out", str(tmp_path / "refused")]) == 2  # no GPU: refused, one line
    err = capsys.readouterr().err
    assert err.startswith("gpu-check: error: gpu-check needs a visible CUDA GPU, torch sees 0")
    assert err.count("\n") == 1 and not (tmp_path / "refused").exists()

    gpus(2)
    out = tmp_path / "plan"
    assert main(["--dry-run", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = json.loads((out / "report.json").read_text())
    assert (plan["status"], plan["n"], plan["backend"], plan["simulated_n"]) == ("DRY RUN", 2, "nccl", [])
    assert "gpu-check found: jax " in printed and " torch " in printed and "flax " in printed
    assert "2 GPU(s): Fake GPU 0, Fake GPU 1, backend nccl, dtypes float32, bfloat16, float64" in printed
    tiny = [p for p in plan["pairs"] if p["size"] == "tiny"]
    assert [p["id"] for p in tiny] == [f"{s}-{d}" for d in ("float32", "float64") for s in EVERY]
    realistic = [p["id"] for p in plan["pairs"] if p["size"] in REALISTIC]
    wanted = [i.replace("-n1", "-n2") for i in ONE_GPU]
    assert realistic == wanted[:len(realistic)] and [x.split(" ")[0] for x in plan["left_out"]] == \
        wanted[len(realistic):]
    assert plan["estimate_s"] <= plan["budget_s"] == 360
    for p in plan["pairs"]:
        cfg = parity_config(p["argv"])
        assert (cfg.strategy, cfg.dtype, cfg.devices, cfg.backend) == (p["strategy"], p["dtype"], 2, "nccl")
        assert p["torch_ranks"] == (1 if p["strategy"] == "dp" else 2)  # nn.DataParallel: one process
    hsdp = next(p for p in tiny if p["strategy"] == "hsdp")
    assert parity_config(hsdp["argv"]).mesh_shape == (2, 1)  # jaxdp's default at N = 2 (and torch_ref's)
    assert plan["bench"]["command"].startswith("JAXDP_TORCH_BACKEND=nccl jaxdp bench --strategies ddp --devices 2 ")
    md = (out / "report.md").read_text()
    assert md.startswith("# gpu-check: DRY RUN") and md.count("**PLANNED**") == len(plan["pairs"]) + 1

    # --full: every realistic pair, no budget; eight GPUs: HSDP on 2 x 4
    gpus(8)
    assert main(["--dry-run", "--full", "--no-bench", "--out", str(out)]) == 0
    plan = json.loads((out / "report.json").read_text())
    realistic = {(p["size"], p["dtype"], p["strategy"]) for p in plan["pairs"] if p["size"] in REALISTIC}
    assert realistic == {(s, d, x) for s in REALISTIC for d in ("float32", "bfloat16", "float64") for x in EVERY}
    assert (plan["n"], plan["budget_s"], plan["deadline_s"], plan["left_out"]) == (8, 0, 0, [])
    assert "--mesh-shape 2,4" in next(p for p in plan["pairs"] if p["strategy"] == "hsdp")["command"]
    assert main(["--dry-run", "--dtypes", "float16", "--out", str(out)]) == 2


def test_the_rehearsal_plans_the_one_gpu_pairs_on_the_cpu(tmp_path):
    assert main(["--rehearse", "--dry-run", "--out", str(tmp_path)]) == 0
    plan = json.loads((tmp_path / "report.json").read_text())
    assert [p["id"] for p in plan["pairs"]] == ONE_GPU and plan["mode"] == "rehearse"
    assert {(p["where"], p["backend"], p["n"]) for p in plan["pairs"]} == {("cpu (rehearsal)", "gloo", 1)}
    assert all(parity_config(p["argv"]).backend == "gloo" for p in plan["pairs"])
    assert (plan["budget_s"], plan["deadline_s"]) == (0, 0)
    assert main(["--rehearse", "--simulate", "2", "--dry-run", "--out", str(tmp_path)]) == 2


def _planned(tmp_path, **kw):
    return planning.make_plan("gpu", 1, "nccl", ["float64"], ["ddp", "zero3"], str(tmp_path), realistic=False, **kw)


def test_the_verdict_passes_only_what_ran_and_passed(tmp_path):
    plan = _planned(tmp_path)
    pairs = plan.pairs
    for p in pairs:
        p.status = "PASS"
    assert report.overall(plan) == "PASS" and report.EXIT["PASS"] == 0
    pairs[1].status, pairs[1].message = "NOT RUN", "deadline: 541 s spent"
    assert report.overall(plan) == "INCOMPLETE" and report.EXIT["INCOMPLETE"] == 3
    line = report.verdict_line(plan)
    assert line.startswith("INCOMPLETE: 1 of 4 planned pair(s)/row(s) did not run") and pairs[1].id in line
    pairs[2].status = "PLANNED"  # never reached at all: not a pass either
    assert report.overall(plan) == "INCOMPLETE"
    pairs[0].status = "FAIL"
    assert report.overall(plan) == "FAIL" and report.verdict_line(plan).endswith("; 2 more did not run")
    assert report.table(plan).splitlines()[-1] == report.verdict_line(plan)


def test_a_pair_the_deadline_stops_makes_the_check_incomplete_with_exit_3(tmp_path, capsys):
    """End to end, no pair reached: the deadline passes before the first one starts."""
    out = tmp_path / "sim"
    assert main(["--simulate", "2", "--strategies", "ddp,zero1", "--deadline", "1e-9", "--no-bench",
                 "--out", str(out)]) == 3
    printed = capsys.readouterr().out
    got = json.loads((out / "report.json").read_text())
    assert got["status"] == "INCOMPLETE" and [p["status"] for p in got["pairs"]] == ["NOT RUN", "NOT RUN"]
    assert all(p["message"].startswith("deadline: ") for p in got["pairs"])
    assert "gpu-check: INCOMPLETE" in printed and "ddp-float64-n2-simulated" in got["verdict"]
    assert (out / "report.md").read_text().startswith("# gpu-check: INCOMPLETE")


def test_gpu_check_simulate_runs_a_pair_on_gloo(tmp_path):
    """The check itself, end to end on 2 simulated devices and 2 gloo ranks (one pair, one step)."""
    out = tmp_path / "sim"
    assert main(["--simulate", "2", "--strategies", "ddp", "--dtypes", "float64", "--steps", "1",
                 "--no-bench", "--out", str(out)]) == 0
    got = json.loads((out / "report.json").read_text())
    assert (got["status"], got["mode"], got["backend"]) == ("PASS", "simulate", "gloo")
    (pair,) = got["pairs"]
    assert pair["status"] == "PASS" and pair["message"].startswith("parity OK: 1 steps")
    dev = pair["details"]["devices"]
    assert dev["torch_backend"] == "gloo" and dev["tf32"]["off_on_both_sides"]
    assert [(r["rank"], r["LOCAL_RANK"], r["device"]) for r in dev["torch_ranks"]] == [(0, "0", "cpu"), (1, "1", "cpu")]
    # parity mode in every torch rank: cuDNN's deterministic heuristic engines (on CUDA)
    assert all((r["cudnn_deterministic"], r["cudnn_benchmark"], r["cudnn_enabled"]) == (True, False, True)
               for r in dev["torch_ranks"])
    pair_dir = out / "pairs" / "ddp-float64-n2-simulated"
    assert json.loads((pair_dir / "report.json").read_text())["passed"] is True
    assert not (pair_dir / "parity.png").exists()  # no PNG inside the budget unless --png
    assert (out / "report.md").read_text().startswith("# gpu-check: PASS")


def test_make_gpu_check_uses_the_python_at_hand_without_installing(tmp_path):
    """A GPU image after ``pip install --no-deps -e .``: jax and torch import, so make runs the check
    with that python and installs nothing (no network there)."""
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "plan"
    proc = subprocess.run(["make", "--no-print-directory", "gpu-check", f"PYTHON={sys.executable}", "VENV=/nonexistent",
                           f"GPU_CHECK_ARGS=--dry-run --devices 1 --no-realistic --out {out}"],
                          cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.startswith(f"gpu-check with {sys.executable}\n") and "pip" not in proc.stdout + proc.stderr
    plan = json.loads((out / "report.json").read_text())
    assert (plan["status"], plan["n"], plan["simulated_n"]) == ("DRY RUN", 1, [2, 3])


class FakeChild:
    """The simulated child: it reports its first pair, then would run past the deadline."""

    def __init__(self, plan, log):
        self.plan, self.log, self.killed = plan, log, False

    def __call__(self, argv, env, **kwargs):
        self.log.append(("child started", argv[1:5], {k: env[k] for k in ("JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES")}))
        first = self.plan.in_child()[0]
        done = dict(asdict(first), status="PASS", message="parity OK", seconds=3.0, details={})
        (Path(self.plan.out) / "simulated" / "report.json").write_text(json.dumps({"pairs": [done]}))
        return self

    def wait(self, timeout=None):
        if timeout is not None and not self.killed:
            raise subprocess.TimeoutExpired("child", timeout)
        return -9

    def poll(self):
        return -9 if self.killed else None

    def kill(self):
        self.killed = True


def test_the_simulated_child_starts_first_and_what_it_did_not_reach_is_not_run(gpus, tmp_path, monkeypatch):
    """The one-GPU plan's simulated pairs run in a child started before the first GPU pair; at the
    deadline the child is stopped, and the pairs it did not report are NOT RUN: INCOMPLETE."""
    gpus(1)
    plan = planning.make_plan("gpu", 1, "nccl", ["float32"], ["ddp", "zero3"], str(tmp_path), deadline_s=30.0)
    log = []
    monkeypatch.setattr(subprocess, "Popen", FakeChild(plan, log))

    def fake_pair(pair, png=False):
        log.append(("pair", pair.id))
        pair.status, pair.message, pair.seconds = "PASS", "parity OK", 1.0
    monkeypatch.setattr(run, "run_pair", fake_pair)
    run.run(plan, log=lambda *_: None)
    assert log[0] == ("child started", ["-m", "torch_commands.gpu_check", "--simulate", "2,3"],
                      {"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""})
    assert [x[1] for x in log[1:]] == [p.id for p in plan.here()]  # then the GPU pairs, in order
    sims = plan.in_child()
    assert [p.status for p in sims] == ["PASS"] + ["NOT RUN"] * (len(sims) - 1)
    assert sims[1].message.startswith("deadline: the simulated child was stopped at 30 s")
    assert report.overall(plan) == "INCOMPLETE" and plan.seconds is not None


def test_refusals_are_one_line(gpus, tmp_path, capsys):
    gpus(1)
    for argv in (["--strategies", "ddp,nope"], ["--simulate", "1"], ["--rehearse", "--backend", "nccl"]):
        assert main([*argv, "--dry-run", "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("gpu-check: error: ") and err.count("\n") == 1, err


def test_an_interrupted_check_leaves_no_simulated_child_behind(gpus, tmp_path, monkeypatch):
    gpus(1)
    plan = planning.make_plan("gpu", 1, "nccl", ["float32"], ["ddp"], str(tmp_path))
    child = FakeChild(plan, [])
    monkeypatch.setattr(subprocess, "Popen", child)

    def interrupted(pair, png=False):
        raise KeyboardInterrupt
    monkeypatch.setattr(run, "run_pair", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run.run(plan, log=lambda *_: None)
    assert child.killed
