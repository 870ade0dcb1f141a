"""float32, bfloat16 and low-precision wires against torch_ref: each within the bounds measured
for its rounding (``compare.FLOAT32``, ``compare.BFLOAT16_BN``, ``compare.low_precision_wire``)."""

import pytest

from parity_tests.cases import ADAM, ADAMW, F64, SGD, SHORT, assert_parity, config
from parity_tests.runner import run_parity

F32_STEPS = 8  # float32 bounds every tensor at step 0 only, then the loss: fewer steps say as much
# float32: each strategy's float32 program once (float64 above holds every pair to 1e-10; a
# float32 run adds the float32 code path, x64 off, and its measured-noise bounds).
F32 = {
    "ddp-n2-sgd-nesterov": dict(strategy="ddp", devices=2, steps=F32_STEPS, **SGD),
    "ddp-n4-adam": dict(strategy="ddp", devices=4, steps=SHORT, **ADAM),
    "ddp-n2-accum2-adamw": dict(strategy="ddp", devices=2, accum_steps=2, steps=SHORT, **ADAMW),
    "ddp-n2-sync_bn-accum2": dict(strategy="ddp", devices=2, sync_bn=True, accum_steps=2, steps=SHORT, **SGD),
    "zero1-n2-adamw": dict(F64["zero1-n2-adamw"], steps=F32_STEPS),
    "zero2-n3-adamw": dict(F64["zero2-n3-adamw"], steps=F32_STEPS),  # padded shards
    "zero3-n3-accum4-adam": dict(F64["zero3-n3-accum4-adam"], steps=F32_STEPS),  # reduce-scatter per micro-batch
    "hsdp-2x2-sgd": dict(F64["hsdp-2x2-sgd"], steps=F32_STEPS),
}

# bf16/fp16 hooks on N > 2 ranks, in float64. The hook's terms fl(fl(g)/N) are the same on
# both sides, but gloo rounds the SUM at each of its N-1 hops and XLA:CPU once (bf16) or at
# each hop in another order (fp16), so the averaged gradients differ by up to N u sum|g_i/N|
# per element (u = 2^-8 bf16, 2^-11 fp16). Hence, at step 0: grads and params within
# 4 N u (a cancellation allowance of 4: measured rel err / (N u) <= 0.98), optimizer state
# 8 N u (exp_avg_sq is quadratic in g), loss and BN buffers still 1e-10 (the forward comes
# before any rounding); later steps only the loss (1%: the rounded gradients move the
# trajectories apart chaotically, as float32 does); at every step every gradient on both
# sides an exact bf16/fp16 value, which the bounds alone cannot check. (N = 2: one addition,
# rounded once by both, so "ddp-bf16-hook" above is held to 1e-10.) compare.py has the numbers.
LOW_PRECISION = {
    "ddp-bf16-hook-n4": dict(strategy="ddp", devices=4, compress="bf16", steps=SHORT, **SGD),
    "ddp-fp16-hook-n3": dict(strategy="ddp", devices=3, compress="fp16", steps=SHORT, **SGD),
}

# bfloat16 mixed precision with BatchNorm against the FSDP2 twins, whose policies keep every norm
# layer's params float32 around bf16 blocks (torch_ref.strategies.mixed_precision_policies), as
# jaxdp's BatchNorm computes on bf16 activations. compare.BFLOAT16_BN: every rank's loss within
# 2u (u = 2^-8) at every step, the loss curves within 2u. (The ViT's bf16 pairs: test_vit_parity.py.)
BF16_BN = {
    "zero2-n2-adam": dict(strategy="zero2", devices=2, steps=SHORT, **ADAM),
    "zero3-n2-adam": dict(strategy="zero3", devices=2, steps=SHORT, **ADAM),
    "hsdp-2x2-adam": dict(strategy="hsdp", devices=4, mesh_shape=(2, 2), steps=SHORT, **ADAM),
    # Gradients reduce-scattered in bfloat16 on both sides (FSDP2's MixedPrecisionPolicy(reduce_dtype=bf16)).
    "zero3-n2-reduce_bf16-adam": dict(strategy="zero3", devices=2, reduce_dtype="bfloat16", steps=SHORT, **ADAM),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(F32))
def test_float32_within_measured_noise(name):
    assert_parity(run_parity(config("float32", **F32[name]), reuse_torch=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LOW_PRECISION))
def test_low_precision_hook_on_more_than_two_ranks(name):
    cfg = config("float64", **LOW_PRECISION[name])
    result = run_parity(cfg, reuse_torch=True)
    assert_parity(result)
    assert result.comparison.bounds.wire == cfg.compress
    first = result.comparison.steps[0]
    # The forward is the wire's business in no way: float64 agreement.
    assert first.max_rel("loss") <= 1e-10 and first.max_rel("buffers") <= 1e-10
    # Every averaged gradient was checked to be a wire value, on both sides, every step.
    for step in result.comparison.steps:
        grads = [e.key for e in step.entries if e.category == "grads"]
        wire = {e.key for e in step.entries if e.category == "wire"}
        assert wire == {f"wire/{side}/{k[len('grads/'):]}" for side in ("jaxdp", "torch") for k in grads}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BF16_BN))
def test_bfloat16_with_batchnorm_against_fsdp2_mixed_precision(name):
    result = run_parity(config("bfloat16", **BF16_BN[name]), reuse_torch=True)
    assert_parity(result)
    assert result.comparison.bounds.name == "bfloat16"
    first = result.comparison.steps[0]
    assert {e.category for e in first.entries} >= {"loss", "grads", "params", "buffers", "optimizer_state"}
    # bf16 rounding is really there (float32 runs differ by ~1e-6 here): both sides computed in bf16 ...
    assert first.max_rel("grads") > 1e-4
    # ... around float32 master weights and BatchNorm statistics, on both sides.
    for records in (result.jax_records, result.torch_records):
        for kind in ("params", "buffers"):
            assert {str(v.dtype) for v in records[-1][kind].values()} == {"float32"}, kind
