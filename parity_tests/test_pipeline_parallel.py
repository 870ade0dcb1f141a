"""Data x pipeline parallelism against its torch twin, in float64 (``parity_tests.pipeline_parallel``).

Measured (10 steps, ViT depth 2, dim 16, 4 heads, PP 2 x DP 2, M = 4, SGD momentum): worst
relative error 2.5e-15 (a LayerNorm weight's gradient), against the bound 1e-10. The DDP
tutorial's ToyMpModel on the same mesh, M = 1: 4.1e-16.
"""

import dataclasses

import pytest

from parity_tests import pipeline_parallel as pp

pytestmark = [pytest.mark.slow, pytest.mark.float64]

VIT = pp.PPConfig(family="vit", data=2, stage=2, microbatches=4, steps=10)


def worst(comparison):
    return max((e for s in comparison.steps for e in s.entries), key=lambda e: e.rel_err)


@pytest.fixture(scope="module")
def torch_records():
    """The torch twin's 10 steps, once for the module (the bug runs compare with their first 2)."""
    return pp.run_torch(VIT, pp.init_state_dict(VIT), pp.make_batches(VIT))


def assert_matches_every_step(comparison, steps):
    assert comparison.passed, comparison.divergence.message()
    assert len(comparison.steps) == steps
    categories = {e.category for s in comparison.steps for e in s.entries}
    assert categories == {"loss", "loss_per_rank", "grads", "params"}, categories
    assert worst(comparison).rel_err < 1e-12, worst(comparison).key


def test_pp2_x_data2_matches_torch_pipeline_schedule_gpipe_every_step(torch_records):
    assert_matches_every_step(pp.run(VIT, want=torch_records), 10)


def test_the_tutorial_model_on_two_stages_matches_torch():
    assert_matches_every_step(pp.run(pp.PPConfig(family="toy", data=2, stage=2, microbatches=1, steps=3)), 3)


@pytest.mark.parametrize("bug", sorted(pp.BUGS))
def test_an_injected_pipeline_bug_is_caught_against_torch_at_step_0(bug, torch_records):
    cfg = dataclasses.replace(VIT, steps=2)  # the same start and first two batches as the clean run
    comparison = pp.run(cfg, bug=bug, want=torch_records[:2])
    assert not comparison.passed
    assert comparison.divergence.step == 0 and comparison.divergence.key == "loss", comparison.divergence.message()
    assert comparison.divergence.rel_err > 1e-3
