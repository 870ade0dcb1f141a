"""The harness must catch real semantic bugs and name them (``parity_tests.bugs``).

Each test runs jaxdp with one deliberate porting mistake against the clean torch run of
``test_parity``'s "ddp-n2-sgd-nesterov-20steps" case (float64, shared in-process through
``reuse_torch``), for two jaxdp steps, and checks that the report fails with the first
divergence at the step and in the kind of tensor the bug must show up in first.
"""

import pytest

from parity_tests.bugs import BUGS
from parity_tests.runner import ParityConfig, run_parity
from parity_tests.test_parity import F64, TINY

pytestmark = pytest.mark.slow

CLEAN = ParityConfig(dtype="float64", **{**TINY, **F64["ddp-n2-sgd-nesterov-20steps"]})


@pytest.mark.parametrize("name", list(BUGS))
def test_bug_is_caught_and_named(name):
    bug = BUGS[name]
    result = run_parity(CLEAN, reuse_torch=True, jax_steps=2, bug=name)
    d = result.divergence
    assert not result.passed and d is not None, f"{name}: the harness did not notice"
    msg = d.message()
    assert (d.step, d.category) == (bug.step, bug.category), msg
    assert d.key.endswith(bug.leaf), msg
    assert msg.startswith(f"diverged at step {bug.step}: {d.key} rel err ") and "> 1e-10" in msg
    # float64 noise is ~1e-14: a real bug is orders of magnitude above the bound.
    assert d.rel_err > 1e-6, msg
    if name == "missing_1_over_n":
        # ... and the numbers say how: every gradient is exactly N = 2 times torch's.
        grads = [e for e in result.comparison.steps[0].entries if e.category == "grads"]
        assert grads and all(abs(e.rel_err - 1.0) < 1e-12 for e in grads), msg


def test_bugs_are_undone():
    """Each injection restores exactly what it replaced (no compile needed to check)."""
    from jaxdp.models import resnet
    from jaxdp.strategies import ddp
    from jaxdp.strategies.ddp import DDP

    before = (resnet._Layers.__dict__["conv"], resnet.BatchNorm, DDP.__dict__["reduce_bucket"],
              ddp.ddp_buffers)
    for bug in BUGS.values():
        with bug.inject():
            during = (resnet._Layers.__dict__["conv"], resnet.BatchNorm,
                      DDP.__dict__["reduce_bucket"], ddp.ddp_buffers)
            assert sum(a is not b for a, b in zip(before, during)) == 1, bug.name
    after = (resnet._Layers.__dict__["conv"], resnet.BatchNorm, DDP.__dict__["reduce_bucket"],
             ddp.ddp_buffers)
    assert all(a is b for a, b in zip(before, after))
