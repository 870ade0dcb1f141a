"""The harness must catch real semantic bugs and name them (``parity_tests.bugs``).

Each run injects one deliberate porting mistake into jaxdp and compares two jaxdp steps
against a clean torch run of one of ``test_parity``'s float64 cases (shared in-process
through ``reuse_torch``: the dp and async pairs reuse DDP's, and in a full session every
torch run here is also test_parity's), then checks that the report fails with the first
divergence at the step and in the kind of tensor the bug must show up in first.

Every bug runs on DDP and on ZeRO-3; the strategy-specific patches (where a strategy
divides by N, or picks its BN buffers, in code of its own) run once each on the others.
"""

import pytest

from parity_tests import bugs, runner
from parity_tests.bugs import BUGS
from parity_tests.runner import PAIRS, ParityConfig, ParityError, run_parity
from parity_tests.test_parity import F64, TINY

EVERY_BUG_ON = ("ddp-n2-sgd-nesterov-20steps", "zero3-n2-adam")
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


def clean(case: str) -> ParityConfig:
    return ParityConfig(dtype="float64", **{**TINY, **F64[case]})


@pytest.mark.slow
@pytest.mark.parametrize("name,case", [(b, c) for c in EVERY_BUG_ON for b in BUGS] + STRATEGY_SPECIFIC)
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


def test_every_bug_applies_to_every_pair():
    """A new pair must say where each bug goes (or why it cannot): an injection that
    silently patches nothing would make the harness look broken, or worse, fine."""
    for bug in BUGS.values():
        assert set(bug.patches) == set(PAIRS), bug.name


def test_a_bug_that_cannot_apply_is_refused_before_anything_runs(monkeypatch):
    def no_torch(*args, **kwargs):
        raise AssertionError("torch ran for a refused injection")

    monkeypatch.setattr(runner, "run_torch", no_torch)
    sync_bn = clean("ddp-n2-sync_bn-accum2")
    with pytest.raises(ParityError, match=r"^bug wrong_shard_bn cannot show in this run: with --sync-bn"):
        run_parity(sync_bn, bug="wrong_shard_bn")
    one_device = ParityConfig(dtype="float64", **{**TINY, "strategy": "zero2", "devices": 1})
    with pytest.raises(ParityError, match="needs --devices >= 2"):
        run_parity(one_device, bug="missing_1_over_n")
    with pytest.raises(ParityError, match="^unknown bug 'nope'; choose one of same_padding, "):
        run_parity(clean("zero3-n2-adam"), bug="nope")
    # A strategy with no patch for a bug: the message names those that have one.
    with pytest.raises(ParityError) as e:
        BUGS["missing_1_over_n"].injection(ParityConfig(strategy="pipeline"))
    assert str(e.value) == ("bug missing_1_over_n cannot be injected into strategy 'pipeline': it "
                            "applies to ddp, async, zero1, zero2, zero3, hsdp, dp")


def _site_values():
    return [(owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name))
            for owner, name in bugs.patch_sites()]


def test_bugs_are_undone():
    """Each injection replaces something, and restores exactly what it replaced (no compile
    needed to check)."""
    before = _site_values()
    for bug in BUGS.values():
        for strategy in bug.patches:
            with bug.injection(ParityConfig(strategy=strategy)):
                changed = sum(a is not b for a, b in zip(before, _site_values()))
                assert changed >= 1, (bug.name, strategy)
    assert all(a is b for a, b in zip(before, _site_values()))


def test_an_injected_bug_that_goes_unnoticed_fails_the_command(monkeypatch, capsys, tmp_path):
    """The harness's own failure: a bug was injected and both sides still agree."""
    from jaxdp.cli import main
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
