"""The parity suite's cases: one model, three optimizers and the float64 pairs, shared by the
test modules that run them (test_parity.py: the DDP family and the harness itself;
test_parity_zero.py: ZeRO and HSDP; test_parity_float32.py: float32, bf16 and low-precision
wires; test_parity_clip.py: gradient clipping), so that pytest-xdist spreads them over workers.

Model: ResNet-18 layout with width 4 and one block per stage (every code path, a fraction of
the cost), 16x16 crops, 8 images per device. float64 cases must agree to rel err <= 1e-10 in
every tensor at every step (measured: <= 2e-13).

Cost: each torch launch is a few seconds and each jaxdp strategy compiles once, so pairs whose
twin is the same torch computation (dp, async k=0 and ddp against DDP; ring against DDP) sit
in one module and reuse one torch run (``reuse_torch``).
"""

import io

import numpy as np

from parity_tests import pairs, report
from parity_tests.config import ParityConfig
from parity_tests.runner import run_parity

TINY = dict(model="resnet18", width=4, blocks=(1, 1, 1, 1), image_size=16, batch_per_device=8)
SGD = dict(optimizer="sgd", lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
ADAM = dict(optimizer="adam", lr=1e-3, betas=(0.9, 0.99), weight_decay=1e-4)
ADAMW = dict(optimizer="adamw", lr=1e-3, weight_decay=1e-2)
LONG = 20   # steps of the long cases
SHORT = 4   # steps of the others

F64_ZERO3_N3_ACCUM4 = dict(strategy="zero3", devices=3, accum_steps=4, steps=LONG, **ADAM)
# name -> config. "ddp-n2-sgd" is also the torch run the dp/async pairs and the injected
# bugs reuse; "ddp-n4-adam" the one the ring all-reduce reuses.
F64 = {
    "ddp-n2-sgd-nesterov-20steps": dict(strategy="ddp", devices=2, steps=LONG, **SGD),
    "ddp-n4-adam": dict(strategy="ddp", devices=4, steps=SHORT, **ADAM),
    "ddp-n2-accum2-adamw": dict(strategy="ddp", devices=2, accum_steps=2, steps=SHORT, **ADAMW),
    "ddp-n2-sync_bn-accum2": dict(strategy="ddp", devices=2, sync_bn=True, accum_steps=2, steps=SHORT, **SGD),
    "dp-n2": dict(strategy="dp", devices=2, steps=LONG, **SGD),
    "async-k0-n2": dict(strategy="async", devices=2, steps=LONG, **SGD),
    "ddp-ring-n4": dict(strategy="ddp", devices=4, allreduce="ring", steps=SHORT, **ADAM),
    # Every ZeRO pair over LONG steps; N = 3 pads every sharded tensor (jaxdp pads a tensor's
    # largest dimension, FSDP2 dim 0: the harness compares the unpadded values).
    "zero1-n2-adamw": dict(strategy="zero1", devices=2, steps=LONG, **ADAMW),
    "zero2-n2-accum2-sgd": dict(strategy="zero2", devices=2, accum_steps=2, steps=LONG, **SGD),
    "zero3-n2-adam": dict(strategy="zero3", devices=2, steps=LONG, **ADAM),
    "hsdp-2x2-sgd": dict(strategy="hsdp", devices=4, mesh_shape=(2, 2), steps=LONG, **SGD),
    "ddp-n3-adam": dict(strategy="ddp", devices=3, steps=SHORT, **ADAM),
    "dp-n3": dict(strategy="dp", devices=3, steps=SHORT, **ADAM),            # torch: ddp-n3-adam's run
    "async-k0-n3": dict(strategy="async", devices=3, steps=SHORT, **ADAM),   # torch: ddp-n3-adam's run
    "zero1-n3-sgd": dict(strategy="zero1", devices=3, steps=LONG, **SGD),
    "zero2-n3-adamw": dict(strategy="zero2", devices=3, steps=LONG, **ADAMW),
    # K = 4 micro-batches of 2 images: zero3/hsdp reduce-scatter each, FSDP2 accumulates
    # unsharded grads under set_requires_gradient_sync(False); the sums must agree.
    "zero3-n3-accum4-adam": F64_ZERO3_N3_ACCUM4,
    "hsdp-2x2-accum4-adamw": dict(strategy="hsdp", devices=4, mesh_shape=(2, 2), accum_steps=4, steps=LONG, **ADAMW),
    "hsdp-1x3-sgd": dict(strategy="hsdp", devices=3, mesh_shape=(1, 3), steps=SHORT, **SGD),
    # Keeping each unit's activations (FSDP2's own default) instead of recomputing the unit: the
    # same twin, whose run the two cases above reuse. N = 3 pads, K = 4 reduce-scatters per micro-batch.
    "zero3-n3-accum4-remat_none-adam": dict(F64_ZERO3_N3_ACCUM4, remat="none"),
    "hsdp-2x2-remat_none-sgd": dict(strategy="hsdp", devices=4, mesh_shape=(2, 2), remat="none", steps=LONG, **SGD),
    # Reduce-scattering once per update, the unsharded gradients summed over the micro-batches: what
    # FSDP2 does under set_requires_gradient_sync(False), the twin the two accum4 cases run against.
    "zero3-n3-accum4-once-adam": dict(F64_ZERO3_N3_ACCUM4, accum_reduce="once"),
    "hsdp-2x2-accum4-once-adamw": dict(strategy="hsdp", devices=4, mesh_shape=(2, 2), accum_steps=4,
                                       accum_reduce="once", steps=LONG, **ADAMW),
    "ddp-fp16-hook": dict(strategy="ddp", devices=2, compress="fp16", steps=SHORT, **SGD),
    "ddp-bf16-hook": dict(strategy="ddp", devices=2, compress="bf16", steps=SHORT, **SGD),
    # 20 steps of rank-1 PowerSGD: its error feedback and warm-started Q carry every step's
    # compression error into the next step's gradients, which are compared at every step.
    "ddp-powersgd-hook-20steps": dict(strategy="ddp", devices=2, compress="powersgd", powersgd_start_iter=2,
                                      steps=LONG, **SGD),
    # ZeRO-1 composes DDP's all-reduce, hooks included; torch: ZeroRedundancyOptimizer over a hooked DDP.
    "zero1-bf16-hook": dict(strategy="zero1", devices=2, compress="bf16", steps=SHORT, **ADAMW),
    "zero1-powersgd-hook": dict(strategy="zero1", devices=2, compress="powersgd", powersgd_start_iter=2,
                                steps=SHORT, **ADAMW),
}
# Every registered pair (jaxdp.registry) runs in float64: the cases above, and this default one for a
# pair that has none, so that a new strategy with a torch twin is tested without a line here.
F64.update({f"{name}-n2-sgd": dict(strategy=name, devices=2, steps=SHORT, **SGD)
            for name in pairs.PAIRS if not any(case["strategy"] == name for case in F64.values())})


DRIFT = {"powersgd": 1e-11}  # a long case's largest float64 error over its steps, where it is not 1e-12


def config(dtype, **kw):
    return ParityConfig(dtype=dtype, **{**TINY, **kw})


def assert_parity(result):
    out = io.StringIO()
    report.print_report(result, file=out)
    print(out.getvalue())
    assert result.passed, out.getvalue()


def check_float64(name):
    """One F64 pair: every tensor at every step to 1e-10, and no drift over the long cases."""
    result = run_parity(config("float64", **F64[name]), reuse_torch=True)
    assert_parity(result)
    steps = result.comparison.steps
    assert len(steps) == F64[name]["steps"]
    # What was compared: loss, grads, params, BN buffers and optimizer state, every step.
    cats = {e.category for e in steps[-1].entries}
    assert {"loss", "grads", "params", "buffers", "optimizer_state"} <= cats
    if F64[name].get("compress") == "powersgd":
        # PowerSGD's own state too: every rank's error feedback and the warm-start Qs, by name.
        keys = [e.key for e in steps[-1].entries if e.category == "comm_state"]
        assert any(k.endswith("/error") for k in keys) and any(k.endswith("/q") for k in keys), keys
        torch_errors = result.torch_records[-1]["comm_state"]
        assert max(np.abs(s["error"]).max() for s in torch_errors.values()) > 0  # compression ran
    if len(steps) >= 20:
        # The long cases: after 20 steps the error is still step 0's rounding, two orders
        # below the bound: nothing drifts. (SGD: ~1e-13 throughout. Adam's first update moves
        # every weight by ~lr whatever its gradient, so an entry with a near-zero gradient
        # carries its rounding into the params at step 0: 1.2e-12 for zero3-n2-adam, the
        # same 1.2e-12 at step 19.)
        # PowerSGD is the exception, measured: its rank-1 projection, recomputed every step from the
        # warm-started Q and fed back through the error, grows the sides' rounding ~100x over 20
        # steps (5.7e-15 at step 0 to 6.2e-13 at step 18 with XLA's default CPU passes, 1.05e-12
        # under the suite's unoptimised ones, on an AMD EPYC; the worst tensor is always an early
        # conv's gradient): one order below the bound instead of two, still a float64 rounding.
        per_step = [s.max_rel() for s in steps]
        assert max(per_step) <= max(DRIFT.get(result.plan.cfg.compress, 1e-12), 2 * per_step[0]), per_step


def f64_names(*prefixes):
    return [name for name in F64 if name.startswith(prefixes)]


ZERO_FAMILY = ("zero", "hsdp")  # test_parity_zero.py's cases; test_parity.py runs all the others
