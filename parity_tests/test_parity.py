"""Every jaxdp strategy against its PyTorch twin, step by step (``parity_tests.runner``), and the
harness itself (plan, report, GPU runs).

CPU: jaxdp on simulated devices (root conftest: 8 devices, x64), torch_ref on gloo ranks. The
model, optimizers and float64 cases are ``parity_tests.cases``; this module runs the DDP family
(ddp, dp, async, ring, compression hooks), which share torch runs (``reuse_torch``), every other
registered pair's default case (``cases.F64``: a strategy added to ``jaxdp.registry`` with a torch
twin is paired here), and one ResNet-18 of width 16 with the full (2, 2, 2, 2) depth. The other
pairs: test_parity_zero.py, test_parity_float32.py, test_parity_clip.py; the ViT family:
test_vit_parity.py.
"""

import numpy as np
import pytest

from jaxdp import registry
from parity_tests.cases import F64, SGD, SHORT, ZERO_FAMILY, assert_parity, check_float64, config, f64_names
from parity_tests.config import ParityConfig, ParityError
from parity_tests.inputs import full_batch_order
from parity_tests.plan import plan
from parity_tests.runner import run_parity


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in F64 if name not in f64_names(*ZERO_FAMILY)])
def test_float64_every_tensor_every_step(name):
    check_float64(name)


@pytest.mark.slow
def test_resnet18_width16_full_depth_float64():
    """ResNet-18's real depth (2, 2, 2, 2) at width 16: every block type and shortcut."""
    cfg = config("float64", strategy="ddp", devices=2, steps=3, width=16, blocks=(2, 2, 2, 2), **SGD)
    result = run_parity(cfg)
    assert_parity(result)
    names = {e.key for e in result.comparison.steps[0].entries}
    assert "grads/layer4.1.conv2.weight" in names and "buffers/layer2.0.downsample.1.running_var" in names


# ----------------------------------------------------------------------------- the plan

def test_sync_bn_twin_on_cpu_is_one_full_batch_process_and_says_why():
    p = plan(config("float64", strategy="ddp", devices=2, sync_bn=True))
    if p.cuda:
        pytest.skip("on CUDA the twin is SyncBatchNorm on N ranks")
    assert (p.world, p.full_batch, p.torch_config["sync_bn"]) == (1, True, False)
    assert any("SyncBatchNorm raises on CPU" in n for n in p.notes)


def test_pairs_without_a_twin_are_refused():
    with pytest.raises(ParityError, match="has no PyTorch twin"):
        plan(config("float64", strategy="async", staleness=2))
    for strategy in ("zero2", "zero3", "hsdp"):  # they reduce-scatter: no all-reduce for a hook to wrap
        with pytest.raises(ParityError, match="does not apply"):
            plan(config("float64", strategy=strategy, compress="bf16"))
    with pytest.raises(ParityError, match="no torch twin registered"):
        plan(config("float64", strategy="nope"))


def test_every_strategy_is_paired_from_its_facts():
    from jaxdp.strategies import STRATEGIES, facts
    from parity_tests.pairs import PAIRS, pair_for

    assert set(PAIRS) == set(STRATEGIES)  # runner names them itself: it must not import jax
    assert pair_for("hsdp").twin == facts("hsdp").twin
    assert pair_for("hsdp").options == ("mesh_shape", "remat", "reduce_dtype", "accum_reduce")
    # FSDP2 keeps activations and accumulates unsharded gradients: remat's and accum_reduce's values, one twin;
    # reduce_dtype is MixedPrecisionPolicy(reduce_dtype=...) on the torch side.
    assert pair_for("zero3").options == ("remat", "reduce_dtype", "accum_reduce")
    assert pair_for("zero2").options == ()  # jaxdp's buckets take bucket_cap_mb, FSDP2 has no such knob


def test_zero1_takes_ddps_comm_hooks_on_both_sides():
    """jaxdp's zero1 composes DDP's AllReduce, so it has DDP's hooks; its twin is
    ZeroRedundancyOptimizer over a DDP model with the same hook."""
    p = plan(config("float64", strategy="zero1", devices=2, compress="bf16", allreduce="ring"))
    assert p.jax_options == {"compress": "bf16", "allreduce": "ring"}
    assert (p.torch_strategy, p.torch_config["compress"]) == ("zero1", "bf16")
    assert "allreduce" not in p.torch_config  # gloo/nccl sum as they do
    p = plan(config("float64", strategy="zero1", devices=2, compress="powersgd", powersgd_rank=2))
    assert p.jax_options["powersgd_rank"] == 2 and p.torch_config["powersgd_rank"] == 2
    # The same initial Q on both sides, keyed by torch name there and by jaxdp leaf name here.
    assert set(p.jax_options["powersgd_options"]["initial_q"]) == {
        n.replace(".weight", ".kernel") for n in p.torch_config["powersgd_q"]}


def test_full_batch_order_puts_each_devices_kth_micro_batch_together():
    n, b, k = 2, 4, 2
    labels = np.arange(n * b).reshape(n, b)          # device d holds d*b .. d*b+b-1
    images = labels[:, :, None, None, None].astype(float)
    img, lab = full_batch_order(images, labels, k)
    assert img.shape == (1, n * b, 1, 1, 1)
    # micro-batch 0 = device 0's first half + device 1's first half, then the second halves
    assert lab.tolist() == [[0, 1, 4, 5, 2, 3, 6, 7]]
    assert (img[0, :, 0, 0, 0] == lab[0]).all()


# ----------------------------------------------------------------------------- GPU

def _cuda_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_gpu_parity_every_strategy_on_every_gpu(dtype, tmp_path):
    """ddp, zero1, zero2, zero3, hsdp and dp against their torch twins at N = every visible
    GPU (>= 2): ``torch_commands.gpu_check`` (what ``make gpu-check`` runs) in a subprocess,
    because this process's JAX is pinned to the CPU by the root conftest. There JAX computes
    on the GPUs at the highest matmul precision and torch on nccl, rank r on cuda:r, TF32
    off in every rank; each pair must pass and say so."""
    import json
    import os
    import subprocess
    import sys

    from torch_ref.strategies import twin

    gpus = _cuda_gpus()
    if gpus < 2:
        pytest.skip(f"needs >= 2 CUDA GPUs (torch sees {gpus}); on a GPU host run: make gpu-check")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "JAXDP_TORCH_BACKEND")}
    out = tmp_path / "gpu-check"
    proc = subprocess.run([sys.executable, "-m", "torch_commands.gpu_check", "--dtypes", dtype, "--backend", "nccl",
                           "--no-realistic", "--no-bench", "--deadline", "0", "--out", str(out)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode == 2 and "does not compute it" in proc.stderr:
        pytest.skip(proc.stderr.strip())
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert (report["status"], report["mode"], report["n"], report["backend"]) == ("PASS", "gpu", gpus, "nccl")
    assert [p["strategy"] for p in report["pairs"]] == list(registry.names(gpu_checked=True))
    for p in report["pairs"]:
        assert p["status"] == "PASS", (p["id"], p["message"])
        dev = p["details"]["devices"]
        assert dev["jax_platform"] == "gpu" and dev["jax_matmul_precision"] == "highest"
        assert dev["tf32"]["off_on_both_sides"], dev["tf32"]
        ranks = dev["torch_ranks"]  # dp: one process driving every GPU (nn.DataParallel)
        want = ["cuda:0"] if twin(registry.row(p["strategy"]).torch_twin).one_process else \
            [f"cuda:{r}" for r in range(gpus)]
        assert [r["device"] for r in ranks] == want
        assert [r["LOCAL_RANK"] for r in ranks] == [str(r) for r in range(len(want))]
        assert all(r["NVIDIA_TF32_OVERRIDE"] == "0" and not r["cudnn_allow_tf32"] for r in ranks)


@pytest.mark.gpu
@pytest.mark.slow
def test_dp_against_real_nn_data_parallel():
    """jaxdp's dp against torch's own ``nn.DataParallel`` (one process splitting each batch
    over the GPUs), float64. JAX stays on this process's simulated CPU devices."""
    gpus = _cuda_gpus()
    if gpus < 2:
        pytest.skip(f"nn.DataParallel splits a batch over CUDA devices only and torch sees {gpus}: "
                    "without 2 GPUs dp's twin is DDP on N ranks, the same math "
                    "(test_float64_every_tensor_every_step[dp-n2], [dp-n3])")
    result = run_parity(config("float64", strategy="dp", devices=2, steps=SHORT, backend="nccl", **SGD))
    assert (result.plan.torch_strategy, result.plan.world) == ("dp", 1)
    assert_parity(result)


def test_torch_ranks_turn_tf32_off_themselves_on_cuda(monkeypatch):
    """Each rank, not the parent, sets the TF32 flags: a forkserver started earlier hands
    its ranks its own environment and flags. (No GPU needed: the flags exist on CPU builds.)"""
    import os

    import torch

    from torch_ref.launcher import no_tf32

    flags = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = [f.allow_tf32 for f in flags]  # torch's flag objects defeat monkeypatch.setattr
    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE", raising=False)
    try:
        for f in flags:
            f.allow_tf32 = True
        assert not no_tf32(torch.device("cpu"))
        assert all(f.allow_tf32 for f in flags) and "NVIDIA_TF32_OVERRIDE" not in os.environ
        assert no_tf32(torch.device("cuda", 1))
        assert not any(f.allow_tf32 for f in flags) and os.environ["NVIDIA_TF32_OVERRIDE"] == "0"
    finally:
        for f, value in zip(flags, saved):
            f.allow_tf32 = value


# ----------------------------------------------------------------------------- the report itself
# (no jaxdp or torch run: records made up to exercise the comparison, table, JSON, PNG, exit status)

def _record(scale=1.0, bn_var=1.0, loss=2.3):
    return {"loss": loss, "loss_per_rank": [loss - 0.1, loss + 0.1],
            "grads": {"conv1.weight": np.full((4, 3, 3, 3), 0.5 * scale), "fc.bias": np.array([1.0, -2.0])},
            "params": {"conv1.weight": np.ones((4, 3, 3, 3)), "fc.bias": np.array([0.1, 0.2])},
            "buffers": {"bn1.running_mean": np.zeros(4), "bn1.running_var": np.full(4, bn_var)},
            "optimizer_state": {"fc.bias": {"momentum_buffer": np.array([1.0, -2.0])}}}


def _fake_result(jax_steps, torch_steps, dtype="float64"):
    from parity_tests import compare
    from parity_tests.pairs import Pair
    from parity_tests.plan import Plan
    from parity_tests.runner import ParityResult

    cfg = ParityConfig(dtype=dtype, steps=len(torch_steps))
    p = Plan(cfg, Pair("DDP", "ddp"), "ddp", 2, False, {}, {}, False)
    comp = compare.compare_runs(jax_steps, torch_steps, compare.DEFAULT_BOUNDS[dtype])
    return ParityResult(p, comp, jax_steps, torch_steps, {})


def test_relative_error_is_scaled_by_the_largest_reference_entry():
    from parity_tests.compare import errors

    # elementwise relative error would be 1.0 (the 1e-9 entry); per tensor it is 1e-9 / 2
    assert errors(np.array([2.0, 2e-9]), np.array([2.0, 1e-9])) == pytest.approx((1e-9, 5e-10))
    assert errors(np.zeros(3), np.zeros(3)) == (0.0, 0.0)
    assert errors(np.ones(3), np.zeros(3))[1] == float("inf")
    assert errors(np.ones(3), np.ones(4))[1] == float("inf")  # shape mismatch


def test_first_divergence_is_the_earliest_step_then_the_earliest_category():
    torch = [_record(), _record(), _record()]
    jax = [_record(), _record(bn_var=1.01), _record(scale=2.0, bn_var=1.01)]
    result = _fake_result(jax, torch)
    d = result.divergence
    assert (d.step, d.key) == (1, "buffers/bn1.running_var")
    assert d.message().startswith("diverged at step 1: buffers/bn1.running_var rel err 1.0e-02 > 1e-10")
    # at step 2 the gradients come first (causal order), worst tensor named
    assert result.comparison.steps[2].first_failure().key == "grads/conv1.weight"


def test_a_tensor_on_one_side_only_is_a_divergence():
    jax_rec = _record()
    del jax_rec["grads"]["fc.bias"]
    d = _fake_result([jax_rec], [_record()]).divergence
    assert d.key == "grads/fc.bias" and d.rel_err == float("inf")


def test_a_side_with_fewer_steps_is_a_divergence_naming_both_lengths():
    for jax_n, torch_n in ((2, 3), (3, 2)):
        result = _fake_result([_record()] * jax_n, [_record()] * torch_n)
        assert not result.passed
        assert result.message() == (f"diverged: jaxdp has {jax_n} steps and torch {torch_n}: one side "
                                    "stopped early, so steps 2 and later were never compared")


def test_low_precision_bounds_follow_the_wire_rounding():
    from parity_tests.compare import FLOAT32, FLOAT64, low_precision_wire
    from parity_tests.runner import bounds_for

    two = low_precision_wire(FLOAT64, "bf16", 2)  # one addition: rounded alike on both sides
    assert all(two.bound(c, s) == 1e-10 for c in ("grads", "params", "optimizer_state") for s in (0, 3))
    four = bounds_for(plan(config("float64", strategy="ddp", devices=4, compress="fp16")))
    u = 2.0 ** -11
    assert [four.bound(c, 0) for c in ("loss", "buffers", "grads", "params", "optimizer_state")] == \
        [1e-10, 1e-10, 16 * u, 16 * u, 32 * u]
    assert four.bound("loss_per_rank", 1) == 1e-2 and four.bound("grads", 1) == float("inf")
    assert four.bound("wire", 0) == four.bound("wire", 1) == 0.0 and four.wire == "fp16"
    # float32: the larger of float32's own step-0 bound and the wire's; N = 2 keeps float32's
    assert low_precision_wire(FLOAT32, "fp16", 4).bound("grads", 0) == max(FLOAT32.bound("grads", 0), 16 * u)
    assert low_precision_wire(FLOAT32, "bf16", 2).first == {**FLOAT32.first, "wire": 0.0}


def test_a_gradient_that_is_not_a_wire_value_is_a_divergence():
    """A skipped cast, or a division after the cast back, gives numbers within rounding
    of the right ones: only the exact wire check sees them."""
    import ml_dtypes

    from parity_tests import compare

    def on_wire(record):
        record["grads"] = {k: v.astype(ml_dtypes.bfloat16).astype(np.float64)
                           for k, v in record["grads"].items()}
        return record

    bounds = compare.low_precision_wire(compare.FLOAT64, "bf16", 4)
    torch = [on_wire(_record(scale=1 / 3))]
    assert compare.compare_runs([on_wire(_record(scale=1 / 3))], torch, bounds).passed
    off = compare.compare_runs([_record(scale=1 / 3)], torch, bounds)  # 1/6: not a bf16 value
    assert off.divergence.key == "wire/jaxdp/conv1.weight"
    assert off.steps[0].max_rel("grads") <= bounds.bound("grads", 0)  # the bounds alone would pass it


def test_table_json_png_and_exit_status(tmp_path, monkeypatch, capsys):
    import json

    from jaxdp.cli.command import main
    from parity_tests import runner

    bad = _fake_result([_record(), _record(scale=1.5)], [_record(), _record()])
    good = _fake_result([_record(), _record()], [_record(), _record()])
    for result, code in ((good, 0), (bad, 1)):
        monkeypatch.setattr(runner, "run_parity", lambda cfg, bug=None, r=result: r)
        out = tmp_path / str(code)
        assert main(["parity", "--steps", "2", "--out", str(out)]) == code
        printed = capsys.readouterr().out
        assert "worst tensor" in printed and printed.count("\n") >= 6
        data = json.loads((out / "report.json").read_text())
        assert data["passed"] is (code == 0) and len(data["comparison"]["steps"]) == 2
        assert (out / "parity.png").stat().st_size > 10_000
    assert "FAIL: diverged at step 1: grads/conv1.weight rel err 5.0e-01 > 1e-10" in printed
    assert data["comparison"]["divergence"]["key"] == "grads/conv1.weight"


def test_unknown_options_exit_2_with_one_line(capsys):
    from jaxdp.cli.command import main

    assert main(["parity", "--strategy", "zero3", "--compress", "bf16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxdp parity: error: option --compress does not apply") and err.count("\n") == 1
