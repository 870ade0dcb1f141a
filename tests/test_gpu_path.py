"""The GPU path, checked on CPU: which device and backend each torch rank gets, the
``--backend``/``JAXDP_TORCH_BACKEND`` choice in every CLI, and ``gpu_check``'s plan.

Two fake GPUs (``torch.cuda.is_available``/``device_count`` patched) stand in for a GPU
host wherever nothing has to compute on them: the launcher's per-rank environment, the
device each rank would pick, the backend each entry point resolves. NCCL itself is never
started. One real 2-rank gloo launch shows the variables reach the ranks, and one tiny
``gpu_check --simulate 2`` pair runs the check end to end on simulated devices.
"""

import json
import os

import pytest
import torch

from torch_ref import dist as tdist
from torch_ref import launcher

ENV = tdist.BACKEND_ENV


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n)``: pretend torch sees n CUDA GPUs (0: no CUDA); no backend override."""
    monkeypatch.delenv(ENV, raising=False)
    for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)

    def fake(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: f"Fake GPU {i}")
    return fake


# ----------------------------------------------------------------------------- devices per rank

def test_launcher_gives_rank_r_local_rank_r_and_device_cuda_r(gpus, monkeypatch):
    gpus(2)
    backend = tdist.resolve_backend(None, 2)
    assert backend == "nccl"
    devices = []
    for r in range(2):
        env = launcher.rank_env(r, 2, backend)
        assert env == {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2", ENV: "nccl"}
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert tdist.resolve_backend() == "nccl"  # what the rank itself resolves from its variables
        devices.append(tdist.device("nccl"))
    assert devices == [torch.device("cuda", 0), torch.device("cuda", 1)]
    # gloo is the CPU path, GPUs or not
    assert tdist.device("gloo") == torch.device("cpu")


def test_a_local_rank_past_the_visible_gpus_is_refused_in_one_line(gpus, monkeypatch):
    gpus(2)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(tdist.BackendError) as e:
        tdist.device("nccl")
    assert "LOCAL_RANK=2 but only 2 CUDA GPU(s)" in str(e.value) and "\n" not in str(e.value)


def test_run_ranks_hands_every_rank_its_index_and_the_callers_backend(gpus, monkeypatch, tmp_path):
    """The arguments each rank process is started with, without starting any: the resolved
    backend travels with them (a forkserver would not pass the caller's environment on)."""
    gpus(2)
    started = []

    class FakeProcess:
        def __init__(self, target, name, daemon, args):
            assert target is launcher._worker
            started.append(args)

        def start(self):
            pass

        def is_alive(self):
            return False

        def join(self, timeout=None):
            pass

    class FakeContext:
        Process = FakeProcess

    class Stop(Exception):
        pass

    def stop(*_):
        raise Stop

    monkeypatch.setattr(launcher, "_context", lambda: FakeContext())
    monkeypatch.setattr(launcher, "_wait", stop)
    with pytest.raises(Stop):
        launcher.run_ranks(2, launcher.rank_info, [("a",), ("b",)], timeout_s=7)
    assert [(a[0], a[1], a[3], a[4], a[6]) for a in started] == [(0, 2, "nccl", 7, ("a",)), (1, 2, "nccl", 7, ("b",))]
    started.clear()
    monkeypatch.setenv(ENV, "gloo")  # the override, read in the caller
    with pytest.raises(Stop):
        launcher.run_ranks(2, launcher.rank_info)
    assert [a[3] for a in started] == ["gloo", "gloo"]


def test_real_two_rank_gloo_launch_each_rank_sees_its_own_local_rank():
    info = {}
    ranks = launcher.run_ranks(2, launcher.rank_info, backend="gloo", timeout_s=120, info=info)
    assert info["backend"] == "gloo" and info["ranks"] == ranks
    for r, got in enumerate(ranks):
        assert got["rank"] == r and got["world_size"] == 2
        assert {k: got["env"][k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")} == \
            {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2"}
        assert (got["backend"], got["device"], got["tf32_off"]) == ("gloo", "cpu", True)
        # no rank_setup (every launch but parity's): torch's own cuDNN defaults, not parity mode's
        assert (got["cudnn_deterministic"], got["cudnn_benchmark"], got["cudnn_enabled"]) == (False, False, True)


# ----------------------------------------------------------------------------- the backend choice

def test_auto_is_nccl_with_a_gpu_per_rank_and_gloo_otherwise(gpus):
    gpus(2)
    assert tdist.resolve_backend(None, 2) == "nccl"
    assert tdist.resolve_backend("auto", 1) == "nccl"
    assert tdist.resolve_backend("auto", 3) == "gloo"  # fewer GPUs than ranks
    assert tdist.resolve_backend("gloo", 2) == "gloo"
    gpus(0)
    assert tdist.resolve_backend(None, 2) == "gloo"
    assert tdist.resolve_backend("auto", 1) == "gloo"


def test_the_environment_override_beats_auto_and_an_explicit_flag_beats_it(gpus, monkeypatch):
    gpus(2)
    monkeypatch.setenv(ENV, "gloo")
    assert tdist.resolve_backend(None, 2) == "gloo"
    assert tdist.resolve_backend("auto", 2) == "gloo"
    assert tdist.resolve_backend("nccl", 2) == "nccl"  # --backend nccl is explicit
    monkeypatch.setenv(ENV, "NCCL")
    assert tdist.resolve_backend(None, 2) == "nccl"
    monkeypatch.setenv(ENV, "mpi")
    with pytest.raises(tdist.BackendError, match=f"{ENV} must be one of auto, nccl, gloo, got 'mpi'"):
        tdist.resolve_backend(None, 2)
    gpus(0)
    monkeypatch.setenv(ENV, "nccl")
    with pytest.raises(tdist.BackendError, match=f"backend nccl \\({ENV}\\) needs one CUDA GPU per rank"):
        tdist.resolve_backend(None, 1)


def test_explicit_nccl_without_gpus_is_a_one_line_error(gpus):
    gpus(0)
    with pytest.raises(tdist.BackendError) as e:
        tdist.resolve_backend("nccl", 2)
    msg = str(e.value)
    assert msg == ("backend nccl (--backend) needs one CUDA GPU per rank on this host: 2 rank(s), but CUDA "
                   "is not available; use --backend gloo (or auto)")
    gpus(1)
    with pytest.raises(tdist.BackendError, match="2 rank\\(s\\), but only 1 GPU\\(s\\) are visible"):
        tdist.resolve_backend("nccl", 2)


def test_torch_ref_train_backend_flag(gpus, capsys):
    from torch_ref.train import build_parser, main, parse_args

    assert build_parser().parse_args([]).backend == "auto"
    assert build_parser().parse_args(["--backend", "gloo"]).backend == "gloo"
    assert parse_args(["--backend", "gloo", "--width", "4"]).width == 4  # still a TrainConfig
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--backend", "mpi"])
    capsys.readouterr()
    gpus(0)
    assert main(["--backend", "nccl", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("torch_ref: error: backend nccl (--backend) needs one CUDA GPU") and err.count("\n") == 1


def test_parity_backend_flag_reaches_the_torch_launch(gpus, monkeypatch, capsys):
    from jaxdp.cli.command import main
    from parity_tests import runner
    from parity_tests.config import ParityConfig, ParityError
    from parity_tests.plan import plan

    gpus(2)
    p = plan(ParityConfig(strategy="ddp", devices=2))
    assert (p.backend, p.cuda, p.world) == ("nccl", True, 2)
    p = plan(ParityConfig(strategy="dp", devices=2))
    assert (p.backend, p.torch_strategy, p.world, p.torch_config["devices"]) == ("nccl", "dp", 1, 2)
    p = plan(ParityConfig(strategy="ddp", devices=4))  # auto, 4 ranks on 2 GPUs: the CPU
    assert (p.backend, p.cuda, p.world) == ("gloo", False, 4)
    monkeypatch.setenv(ENV, "gloo")
    p = plan(ParityConfig(strategy="dp", devices=2))
    assert (p.backend, p.torch_strategy, p.world) == ("gloo", "ddp", 2)
    assert p.to_json()["torch"]["backend"] == "gloo"
    with pytest.raises(ParityError, match="needs one CUDA GPU per rank on this host: 4 rank"):
        plan(ParityConfig(strategy="ddp", devices=4, backend="nccl"))

    # the CLI: --backend parsed into ParityConfig and handed to run_steps
    seen = {}

    def fake_run_steps(world, config, sd, feed, *, timeout_s, backend, info, rank_setup):
        seen.update(world=world, backend=backend, rank_setup=rank_setup.func.__name__, cudnn=rank_setup.keywords)
        raise SystemExit(0)

    monkeypatch.setattr("torch_ref.launcher.run_steps", fake_run_steps)
    # (not the real one: it would set XLA's matmul precision for the rest of the session)
    monkeypatch.setattr(runner, "configure_precision", lambda cuda: seen.update(cuda=cuda))
    for k in ("XLA_FLAGS", "TF_ENABLE_WINOGRAD_NONFUSED", "NVIDIA_TF32_OVERRIDE"):  # parity mode's, restored after
        monkeypatch.setenv(k, os.environ.get(k, ""))
        if not os.environ[k]:
            monkeypatch.delenv(k)
    with pytest.raises(SystemExit):
        main(["parity", "--strategy", "ddp", "--devices", "2", "--steps", "1", "--backend", "nccl"])
    assert seen == {"world": 2, "backend": "nccl", "cuda": True, "rank_setup": "torch_rank_setup",
                    "cudnn": {"cudnn": True}}
    gpus(0)
    capsys.readouterr()
    assert main(["parity", "--strategy", "ddp", "--devices", "2", "--backend", "nccl"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxdp parity: error: backend nccl (--backend) needs one CUDA GPU") and err.count("\n") == 1


# ----------------------------------------------------------------------------- gpu_check

def test_gpu_check_dry_run_on_two_gpus_writes_the_plan(gpus, tmp_path, capsys):
    from torch_commands import gpu_check
    from torch_commands.gpu_check import REALISTIC, STRATEGIES, main, parity_config

    gpus(0)
    assert main(["--out", str(tmp_path / "refused")]) == 2  # no GPU: refused, one line
    err = capsys.readouterr().err
    assert err.startswith("gpu-check: error: gpu-check needs a visible CUDA GPU, torch sees 0")
    assert err.count("\n") == 1 and not (tmp_path / "refused").exists()

    gpus(2)
    out = tmp_path / "plan"
    assert main(["--dry-run", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "gpu-check found: jax " in printed and " torch " in printed and "flax " in printed
    plan = json.loads((out / "report.json").read_text())
    assert (plan["status"], plan["dry_run"], plan["n"], plan["backend"]) == ("DRY RUN", True, 2, "nccl")
    assert f"2 GPU(s): Fake GPU 0, Fake GPU 1, backend nccl, dtypes float32, bfloat16, float64, {len(plan['pairs'])} " \
           "pair(s) + 1 bench row" in printed
    tiny = [p for p in plan["pairs"] if p["size"] == "tiny"]
    # today's tiny pairs at N = every GPU, as the CPU suite runs them ...
    assert [p["id"] for p in tiny] == [f"{s}-{d}" for d in ("float32", "float64") for s in STRATEGIES]
    assert STRATEGIES == ("ddp", "zero1", "zero2", "zero3", "hsdp", "dp")
    for p in plan["pairs"]:
        assert p["status"] == "PLANNED" and p["command"].startswith("jaxdp parity --strategy ")
        cfg = parity_config(p["argv"])  # the command is the configuration
        assert (cfg.strategy, cfg.dtype, cfg.devices, cfg.backend) == (p["strategy"], p["dtype"], 2, "nccl")
        assert p["where"] == "gpu" and p["torch_ranks"] == (1 if p["strategy"] == "dp" else 2)
        if p["size"] == "tiny":
            assert cfg.steps == 4 and cfg.width == 4 and cfg.blocks == (1, 1, 1, 1)
    # ... plus the realistic sizes, the float32 ResNet-18 of width 64 first, within the budget
    realistic = [p for p in plan["pairs"] if p["size"] in REALISTIC]
    assert realistic[0]["id"] == "ddp-float32-resnet18-w64-n2"
    cfg = parity_config(realistic[0]["argv"])
    assert (cfg.model, cfg.width, cfg.blocks, cfg.image_size, cfg.batch_per_device) == \
        ("resnet18", 64, (2, 2, 2, 2), 32, 64)
    assert {p["size"] for p in realistic} == set(REALISTIC) and plan["estimate_s"] <= plan["budget_s"] == 360
    hsdp = next(p for p in tiny if p["strategy"] == "hsdp")
    assert parity_config(hsdp["argv"]).mesh_shape == (2, 1)  # jaxdp's default at N = 2 (and torch_ref's)
    assert next(p for p in tiny if p["strategy"] == "dp")["torch_twin"] == "dp"  # nn.DataParallel
    assert plan["bench"]["command"].startswith("JAXDP_TORCH_BACKEND=nccl jaxdp bench --strategies ddp --devices 2 ")
    assert plan["bench"]["status"] == "PLANNED"
    md = (out / "report.md").read_text()
    assert md.startswith("# gpu-check: DRY RUN")
    assert "| hsdp | GPU | tiny | float64 | 2 | hsdp (2, nccl) |" in md
    assert md.count("**PLANNED**") == len(plan["pairs"]) + 1
    assert hsdp["command"] in md

    # eight GPUs: N = 8, HSDP on 2 x 4; one dtype, no bench, no budget: every realistic pair
    gpus(8)
    assert main(["--dry-run", "--dtypes", "float64", "--no-bench", "--budget", "0", "--out", str(out)]) == 0
    plan = json.loads((out / "report.json").read_text())
    assert plan["n"] == 8 and plan["bench"] is None and plan["left_out"] == []
    assert len(plan["pairs"]) == 6 + 6 * len(REALISTIC)
    assert gpu_check.hsdp_mesh_shape(8) == (2, 4)
    assert "--mesh-shape 2,4" in next(p for p in plan["pairs"] if p["strategy"] == "hsdp")["command"]
    assert plan["environment"]["torch_gpus"] == [f"Fake GPU {i}" for i in range(8)]
    assert main(["--dry-run", "--dtypes", "float16", "--out", str(out)]) == 2


def test_gpu_check_dry_run_on_one_gpu_plans_n1_gpu_pairs_and_simulated_n2_n3(gpus, tmp_path, capsys):
    """A one-GPU host: every strategy at N = 1 on the GPU at realistic sizes (within the 6-minute
    budget), then, labelled, N = 2 and 3 on simulated CPU devices with torch on gloo."""
    from torch_commands.gpu_check import REALISTIC, STRATEGIES, main, parity_config

    gpus(1)
    out = tmp_path / "plan"
    assert main(["--dry-run", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = json.loads((out / "report.json").read_text())
    assert (plan["n"], plan["simulated_n"], plan["bench"]) == (1, [2, 3], None)
    assert "1 GPU(s): Fake GPU 0; N = 2, 3 on simulated CPU devices" in printed
    on_gpu = [p for p in plan["pairs"] if p["where"] == "gpu"]
    simulated = [p for p in plan["pairs"] if p["where"] == "simulated cpu"]
    assert on_gpu and simulated and plan["pairs"] == on_gpu + simulated  # the GPU first
    for p in on_gpu:
        cfg = parity_config(p["argv"])
        assert (p["n"], cfg.devices, cfg.backend, p["torch_ranks"]) == (1, 1, "nccl", 1) and p["size"] in REALISTIC
        if cfg.model == "resnet18":
            assert (cfg.width, cfg.blocks, cfg.image_size, cfg.batch_per_device) == (64, (2, 2, 2, 2), 32, 64)
        else:  # the ViT at its real size: ViT-Tiny's dim 192, depth 12
            assert cfg.model == "vit-tiny" and cfg.dim is None and cfg.batch_per_device == 64
    # every strategy runs on the GPU at realistic size; both models in every dtype
    assert {p["strategy"] for p in on_gpu} == set(STRATEGIES)
    assert {(p["size"], p["dtype"]) for p in on_gpu} == {(s, d) for s in REALISTIC
                                                        for d in ("float32", "bfloat16", "float64")}
    assert plan["estimate_s"] <= plan["budget_s"] and plan["left_out"]  # the rest named, with --budget 0
    assert any("--budget 0 runs them all" in n for n in plan["notes"])
    assert [(p["strategy"], p["n"]) for p in simulated] == [(s, n) for n in (2, 3) for s in STRATEGIES]
    for p in simulated:
        cfg = parity_config(p["argv"])
        assert (cfg.backend, cfg.dtype, p["backend"]) == ("gloo", "float64", "gloo")
        assert p["torch_ranks"] == p["n"]  # dp's twin on CPU: DDP on N ranks
    assert parity_config(next(p for p in simulated if p["id"] == "hsdp-float64-n2-simulated")["argv"]).mesh_shape == \
        (2, 1)
    md = (out / "report.md").read_text()
    assert md.count("| **simulated CPU** |") == len(simulated)


def test_gpu_check_simulate_runs_a_pair_on_gloo(tmp_path):
    """The check itself, end to end on 2 simulated devices and 2 gloo ranks (one pair, one step)."""
    from torch_commands.gpu_check import main

    out = tmp_path / "sim"
    assert main(["--simulate", "2", "--strategies", "ddp", "--dtypes", "float64", "--steps", "1",
                 "--no-bench", "--no-png", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert (report["status"], report["mode"], report["backend"]) == ("PASS", "simulate", "gloo")
    (pair,) = report["pairs"]
    assert pair["status"] == "PASS" and pair["message"].startswith("parity OK: 1 steps")
    dev = pair["details"]["devices"]
    assert dev["torch_backend"] == "gloo" and dev["tf32"]["off_on_both_sides"]
    assert [(r["rank"], r["LOCAL_RANK"], r["device"]) for r in dev["torch_ranks"]] == [(0, "0", "cpu"), (1, "1", "cpu")]
    # parity mode in every torch rank: cuDNN's deterministic heuristic engines (on CUDA)
    assert all((r["cudnn_deterministic"], r["cudnn_benchmark"], r["cudnn_enabled"]) == (True, False, True)
               for r in dev["torch_ranks"])
    assert json.loads((out / "pairs" / "ddp-float64-n2-simulated" / "report.json").read_text())["passed"] is True
    assert (out / "report.md").read_text().startswith("# gpu-check: PASS")


def test_make_gpu_check_uses_the_python_at_hand_without_installing(tmp_path):
    """A GPU image after ``pip install --no-deps -e .``: jax and torch import, so make runs the check
    with that python and installs nothing (no network there)."""
    import os
    import subprocess
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


def test_gpu_check_simulated_part_is_read_from_the_child_and_stopped_by_the_budget(gpus, tmp_path, monkeypatch):
    """The one-GPU plan's simulated pairs come from the child's report; those it did not reach
    within the budget are SKIPPED (named, not failed), and the check's status follows the rest."""
    import subprocess

    from torch_commands import gpu_check

    gpus(1)
    plan = gpu_check.make_plan("gpu", 1, "nccl", ["float64"], ["ddp", "zero3"], str(tmp_path), realistic=False)
    sims = [p for p in plan.pairs if p.where == "simulated cpu"]
    assert [p.id for p in sims] == ["ddp-float64-n2-simulated", "zero3-float64-n2-simulated",
                                    "ddp-float64-n3-simulated", "zero3-float64-n3-simulated"]
    seen = {}

    def child(argv, env, timeout, **kwargs):  # wrote one pair's result, then ran out of time
        seen.update(argv=argv[1:], env={k: env[k] for k in ("JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES")}, timeout=timeout)
        (tmp_path / "simulated").mkdir()
        done = dict(gpu_check.asdict(sims[0]), status="PASS", message="parity OK", seconds=3.0, details={})
        (tmp_path / "simulated" / "report.json").write_text(json.dumps({"pairs": [done]}))
        raise subprocess.TimeoutExpired(argv, timeout)

    monkeypatch.setattr(subprocess, "run", child)
    gpu_check.run_simulated(plan, log=lambda *_: None, timeout_s=90.0)
    assert seen["argv"][:4] == ["-m", "torch_commands.gpu_check", "--simulate", "2,3"]
    assert seen["env"] == {"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""} and seen["timeout"] == 90.0
    assert [p.status for p in sims] == ["PASS", "SKIPPED", "SKIPPED", "SKIPPED"]
    assert sims[1].message.startswith("time budget: the simulated part was stopped after 90 s")
    assert gpu_check.overall(plan) == "PASS"
