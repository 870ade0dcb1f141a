"""The GPU path, checked on CPU: which device and backend each torch rank gets, the
``--backend``/``JAXDP_TORCH_BACKEND`` choice in every CLI (gpu-check's plan and verdict:
test_gpu_check.py).

Two fake GPUs (``torch.cuda.is_available``/``device_count`` patched) stand in for a GPU
host wherever nothing has to compute on them: the launcher's per-rank environment, the
device each rank would pick, the backend each entry point resolves. NCCL itself is never
started. One real 2-rank gloo launch shows the variables reach the ranks.
"""

import json
import os

import pytest
import torch

from torch_ref import dist as tdist
from helpers import fake_gpus
from torch_ref import launcher

ENV = tdist.BACKEND_ENV


@pytest.fixture
def gpus(monkeypatch):
    return fake_gpus(monkeypatch)


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


