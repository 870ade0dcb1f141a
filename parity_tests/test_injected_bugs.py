"""The harness must catch real semantic bugs and name them (``parity_tests.bugs``).

Each run injects one deliberate porting mistake into jaxdp and compares two jaxdp steps
against a clean torch run of one of ``test_parity``'s float64 cases (shared in-process
through ``reuse_torch``: the dp and async pairs reuse DDP's, and in a full session every
torch run here but the two ``LATE`` ones is also test_parity's), then checks that the report fails with the first
divergence at the step and in the kind of tensor the bug must show up in first.

Every step-0, order-1 bug runs on DDP and on ZeRO-3; the strategy-specific patches (where a
strategy divides by N, or picks its BN buffers, in code of its own) run once each on the others.

Four bugs a weak harness would miss (``HARD_TO_SEE``) run on two or three pairs each, with
the exact step and tensor the harness must name: a warmup that ends one step late (nothing
differs before step 11, so it needs a 12-step run with a schedule that changes the lr every
step: ``LATE``), Adam's bias correction off by one step (loss, gradients and the moments are
right; only the update is not), and a 1e-6 relative error in one device's share of one
gradient (only float64's 1e-10 bound sees it), and PowerSGD error feedback that forgets the
old error (right gradients that step; only its error-feedback state, compared by name, shows it).
"""

import re

import pytest

from parity_tests import bugs, runner, torch_side
from parity_tests.bugs import BUGS
from parity_tests.config import ParityConfig, ParityError
from parity_tests.pairs import PAIRS
from parity_tests.runner import run_parity
from parity_tests.cases import ADAM, F64, SGD, TINY

EVERY_BUG_ON = ("ddp-n2-sgd-nesterov-20steps", "zero3-n2-adam")
# The bugs that show at step 0, at order 1, in both of those (the others need configs of their own).
ORDER_ONE = ("same_padding", "biased_var", "missing_1_over_n", "wrong_shard_bn")
# One run per patch site not already exercised above (~7 s of CPU each, mostly compiling).
STRATEGY_SPECIFIC = [
    ("missing_1_over_n", "zero2-n2-accum2-sgd"),   # ZeRO.reduce_scatter
    ("missing_1_over_n", "hsdp-2x2-sgd"),          # ZeRO.average_chunks with the replica psum, N = 4
    ("missing_1_over_n", "zero1-n2-adamw"),        # AllReduce.reduce_bucket, composed by ZeRO-1
    ("missing_1_over_n", "dp-n2"),                 # the sum on device 0
    ("wrong_shard_bn", "dp-n2"),                   # chunk 0's stats, broadcast from device 0
    ("wrong_shard_bn", "async-k0-n2"),             # async's own step (k = 0 too), through async_ps's name
    ("wrong_shard_bn", "hsdp-2x2-sgd"),            # BN buffers from global device 0 of the 2-D mesh
]


# Clean configs of our own: a 10-step linear warmup, then a cosine over the last 2 steps, so
# the lr changes at every step (0, 0.1, ..., 0.9, 1, then 0.5 of the peak at step 11).
LATE = dict(schedule="warmup_cosine", warmup_steps=10, steps=12)
CASES = {
    **F64,
    "ddp-n2-sgd-warmup10-12steps": dict(strategy="ddp", devices=2, **SGD, **LATE),
    "zero3-n2-adam-warmup10-12steps": dict(strategy="zero3", devices=2, **ADAM, **LATE),
}

# (bug, case, jaxdp steps, the quantity the harness must name). Measured, and explained:
# - late_lr_schedule: lr(10) = warmup(10) = peak = cosine(0) either way, so update 10 is still
#   right; update 11 takes the peak instead of half of it. The loss and grads of step 11 come
#   from the params of update 10 (equal); the momentum buffer and Adam's moments are lr-free;
#   so step 11's params, and of them a zero-initialised BN bias (an update's size compared
#   with a tensor that is nothing but updates). bn2.bias and downsample.1.bias of a block
#   with a shortcut get the same gradient (the residual sum's), hence the same error to the
#   last bit; the harness names the earlier in state_dict order.
# - adam_bias_correction: step 0's update is sqrt(1 + b2) / (1 + b1) of the right one
#   (m_hat = g / (1 + b1), v_hat = g^2 / (1 + b2)), moments untouched: the params of step 0,
#   largest relative error in a zero-initialised BN bias, 1 - sqrt(1 + b2) / (1 + b1) up to
#   terms in eps / max|g|, which pick the bias whose largest gradient is smallest,
#   layer4.0.bn1.bias (ahead of the next by 5e-6 of its error; float64 noise is 1e-13).
# - shard_grad_perturbation: the tensor perturbed, in step 0's grads (the params of an Adam
#   step are scale-free; under SGD they move by lr times it: later in the order anyway).
HARD_TO_SEE = [
    ("late_lr_schedule", "ddp-n2-sgd-warmup10-12steps", 12, "params/layer4.0.bn2.bias"),
    ("late_lr_schedule", "zero3-n2-adam-warmup10-12steps", 12, "params/layer2.0.bn2.bias"),
    ("adam_bias_correction", "zero3-n2-adam", 1, "params/layer4.0.bn1.bias"),
    ("adam_bias_correction", "ddp-n2-accum2-adamw", 1, "params/layer4.0.bn1.bias"),   # optax.adamw's chain
    ("shard_grad_perturbation", "ddp-n2-sgd-nesterov-20steps", 1, f"grads/{bugs.SHARD_TENSOR}"),  # rank 0's share
    ("shard_grad_perturbation", "zero2-n2-accum2-sgd", 1, f"grads/{bugs.SHARD_TENSOR}"),  # reduce-scattered chunk
    ("shard_grad_perturbation", "zero3-n2-adam", 1, f"grads/{bugs.SHARD_TENSOR}"),  # chunk before the 1/N
    # PowerSGD from step 2: step 3 is the first whose old error is not zero
    ("error_feedback_dropped", "zero1-powersgd-hook", 4, "comm_state/layer4.0.bn2.bias/error"),
]


def clean(case: str) -> ParityConfig:
    return ParityConfig(dtype="float64", **{**TINY, **CASES[case]})


@pytest.mark.slow
@pytest.mark.parametrize("name,case", [(b, c) for c in EVERY_BUG_ON for b in ORDER_ONE] + STRATEGY_SPECIFIC)
def test_bug_is_caught_and_named(name, case):
    bug, cfg = BUGS[name], clean(case)
    result = run_parity(cfg, reuse_torch=True, jax_steps=2, bug=name)
    d = result.divergence
    assert not result.passed and d is not None, f"{name} on {case}: the harness did not notice"
    assert not result.ok and not result.missed_bug
    msg = d.message()
    assert (d.step, d.category) == (bug.step, bug.category), msg
    assert d.key.endswith(bug.leaf), msg
    assert msg.startswith(f"diverged at step {bug.step}: {d.key} rel err ") and "> 1e-10" in msg
    # float64 noise is ~1e-14: a real bug is orders of magnitude above the bound.
    assert d.rel_err > 1e-6, msg
    if name == "missing_1_over_n":
        # ... and the numbers say how: every gradient is exactly N times torch's.
        grads = [e for e in result.comparison.steps[0].entries if e.category == "grads"]
        assert grads and all(abs(e.rel_err - (cfg.devices - 1)) < 1e-12 for e in grads), msg


@pytest.mark.slow
@pytest.mark.parametrize("name,case,steps,key", HARD_TO_SEE)
def test_a_bug_a_weak_harness_misses_is_caught_and_named(name, case, steps, key):
    bug, cfg = BUGS[name], clean(case)
    result = run_parity(cfg, reuse_torch=True, jax_steps=steps, bug=name)
    d = result.divergence
    assert not result.passed and d is not None, f"{name} on {case}: the harness did not notice"
    assert not result.ok and not result.missed_bug
    msg = d.message()
    step = bug.first_step(cfg)
    assert (d.step, d.category, d.key) == (step, bug.category, key), msg
    assert d.key.endswith(bug.leaf), msg
    assert msg.startswith(f"diverged at step {step}: {key} rel err ") and "> 1e-10" in msg
    assert d.rel_err > 1e-10 and d.bound == 1e-10, msg
    compared = result.comparison.steps
    assert not any(s.failures() for s in compared[:step]), msg  # every step before it within float64 noise
    if name == "late_lr_schedule":
        assert step == 11, msg  # past the first 10 steps a weak harness would compare
    if name in ("late_lr_schedule", "adam_bias_correction"):
        # Only the update is wrong: loss, grads, BN buffers and the (lr- and count-free)
        # momentum buffer or Adam moments of that step all agree.
        assert {e.category for e in compared[step].failures()} == {"params"}, msg
    if name == "error_feedback_dropped":
        # Step 3's gradients used step 2's (right) error: only the error it leaves is wrong,
        # which a harness comparing gradients alone would see one step later.
        assert {e.category for e in compared[step].failures()} == {"comm_state"}, msg
    if name == "adam_bias_correction":
        # ... by the factor the off-by-one predicts, up to eps / |g| terms.
        b1, b2 = cfg.betas
        assert abs(d.rel_err - (1 - (1 + b2) ** 0.5 / (1 + b1))) < 1e-4, msg
    if name == "shard_grad_perturbation":
        # One tensor, by at most the 1e-6 it was scaled by: float32's bounds (~1e-5) would pass it.
        assert [e.key for e in compared[0].failures() if e.category == "grads"] == [key], msg
        assert d.rel_err <= 1.001e-6, msg


def test_a_late_bug_needs_a_run_long_enough_to_show():
    """The first step a late bug shows at depends on the config, and one that cannot reach it is refused."""
    cfg = clean("ddp-n2-sgd-warmup10-12steps")
    assert BUGS["late_lr_schedule"].first_step(cfg) == 11
    assert BUGS["same_padding"].first_step(cfg) == 0
    short = ParityConfig(dtype="float64", **{**TINY, **CASES["ddp-n2-sgd-warmup10-12steps"], "steps": 11})
    with pytest.raises(ParityError, match=re.escape("needs --steps >= warmup_steps + 2 = 12: the first wrong lr "
                                                    "is that of step 11")):
        BUGS["late_lr_schedule"].injection(short)


# The bugs each strategy makes in code of its own (where it reduces the gradient, which BN buffers it keeps).
OWN_CODE = ("missing_1_over_n", "wrong_shard_bn", "shard_grad_perturbation")


def _counting(patch, bug: str, calls: dict):
    """``patch`` whose replacement counts its calls under ``bug``."""
    def make(original):
        replaced = patch.make(original)

        def counted(*args, **kwargs):
            calls[bug] += 1
            return replaced(*args, **kwargs)
        return counted
    return bugs.Patch(patch.owners, patch.name, make)


def test_every_pair_runs_a_site_of_every_bug_it_makes_in_its_own_code():
    """The catalogue names no strategy (its sites are patched all at once), so every registered
    pair must reach one of each bug's sites: an injection that patches nothing its step runs
    would make the harness look broken, or worse, fine. Each pair's step is traced (lowered,
    not compiled) with every site counting its calls."""
    import contextlib

    import numpy as np

    from jaxdp.interop import variables_from_state_dict
    from parity_tests.inputs import init_state_dict
    from parity_tests.jax_side import jax_strategy
    from parity_tests.plan import plan

    assert set(PAIRS) >= {"ddp", "zero1", "zero2", "zero3", "hsdp", "dp", "async"}
    rng = np.random.default_rng(0)
    for name in PAIRS:
        cfg = ParityConfig(dtype="float32", strategy=name, devices=2, **TINY)
        strategy = jax_strategy(plan(cfg))
        state = strategy.engine.init_state(variables_from_state_dict(init_state_dict(cfg), dtype="float32"))
        batch = strategy.engine.shard_batch({"image": rng.normal(size=(16, 16, 16, 3)).astype(np.float32),
                                      "label": rng.integers(0, 10, 16)})
        calls = dict.fromkeys(OWN_CODE, 0)
        with contextlib.ExitStack() as stack:
            for bug in OWN_CODE:
                for patch in BUGS[bug].patches:
                    stack.enter_context(_counting(patch, bug, calls).applied())
            strategy.engine.lower_step(state, batch)
        assert all(calls.values()), (name, calls)


def test_a_bug_that_cannot_apply_is_refused_before_anything_runs(monkeypatch):
    def no_torch(*args, **kwargs):
        raise AssertionError("torch ran for a refused injection")

    monkeypatch.setattr(torch_side, "run_torch", no_torch)
    sync_bn = clean("ddp-n2-sync_bn-accum2")
    with pytest.raises(ParityError, match=r"^bug wrong_shard_bn cannot show in this run: with --sync-bn"):
        run_parity(sync_bn, bug="wrong_shard_bn")
    one_device = ParityConfig(dtype="float64", **{**TINY, "strategy": "zero2", "devices": 1})
    with pytest.raises(ParityError, match="needs --devices >= 2"):
        run_parity(one_device, bug="missing_1_over_n")
    with pytest.raises(ParityError, match="^unknown bug 'nope'; choose one of same_padding, "):
        run_parity(clean("zero3-n2-adam"), bug="nope")
    # The bugs that need a config able to show them: an lr schedule, Adam, a ResNet's tensor.
    with pytest.raises(ParityError, match="^bug late_lr_schedule cannot show in this run: it needs "
                                          "--schedule warmup_cosine"):
        run_parity(clean("zero3-n2-adam"), bug="late_lr_schedule")
    with pytest.raises(ParityError, match=r"^bug adam_bias_correction cannot show in this run: it needs "
                                          r"--optimizer adam or adamw \(sgd has no bias correction\)$"):
        run_parity(clean("ddp-n2-sgd-nesterov-20steps"), bug="adam_bias_correction")
    vit = ParityConfig(dtype="float64", model="vit-tiny", depth=1, dim=16, heads=2, mlp_dim=32, patch=4,
                       image_size=16)
    with pytest.raises(ParityError, match="it perturbs layer3.0.conv2.weight, a ResNet tensor; vit-tiny has none"):
        run_parity(vit, bug="shard_grad_perturbation")
    # A strategy that is no pair: the message names the pairs (jaxdp.registry's order).
    with pytest.raises(ParityError) as e:
        BUGS["missing_1_over_n"].injection(ParityConfig(strategy="pipeline"))
    assert str(e.value) == ("bug missing_1_over_n cannot be injected into strategy 'pipeline': it "
                            "applies to ddp, zero1, zero2, zero3, hsdp, dp, async")


def _site_values():
    return [(owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name))
            for owner, name in bugs.patch_sites()]


def test_bugs_are_undone():
    """Each injection replaces something, and restores exactly what it replaced (no compile
    needed to check)."""
    before = _site_values()
    for bug in BUGS.values():
        for patch in bug.patches:
            with patch.applied():  # the patch itself: no config needs to show the bug
                changed = sum(a is not b for a, b in zip(before, _site_values()))
                assert changed >= len(patch.targets()), (bug.name, patch.name)
        with bug.applied():
            assert sum(a is not b for a, b in zip(before, _site_values())) >= len(bug.patches), bug.name
    assert all(a is b for a, b in zip(before, _site_values()))


def test_an_injected_bug_that_goes_unnoticed_fails_the_command(monkeypatch, capsys, tmp_path):
    """The harness's own failure: a bug was injected and both sides still agree."""
    from jaxdp.cli.command import main
    from parity_tests.test_parity import _fake_result, _record

    missed = _fake_result([_record(), _record()], [_record(), _record()])
    missed.bug = "wrong_shard_bn"
    monkeypatch.setattr(runner, "run_parity", lambda cfg, bug=None: missed)
    code = main(["parity", "--inject-bug", "wrong_shard_bn", "--steps", "2", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 3
    assert err == ("jaxdp parity: error: bug wrong_shard_bn was injected but no divergence was "
                   "found: the harness or the injection is broken\n")
    assert "FAIL: bug wrong_shard_bn was injected" in out and "PASS" not in out
