"""The error budget (``parity_tests.error_budget``): each side against its own float64 run, and
the float32/bf16 bounds derived from it (``compare.FLOAT32``, ``runner.bounds_for``)."""

import dataclasses

import numpy as np
import pytest

from parity_tests import compare, error_budget
from parity_tests.config import ParityConfig
from parity_tests.error_budget import MARGIN, MEASURED, bounds_from_budget, rows_for, side_errors, step0_bounds

ROW = {"family": "resnet", "model": "m", "image_size": 8,
       "jax": {"float32": {"loss": 1e-7, "grads": 2e-6}}, "torch": {"float32": {"loss": 3e-7, "grads": 1e-6}}}


def test_side_errors_are_relative_to_the_largest_reference_entry_per_category():
    ref = [{"loss": 2.0, "grads": {"a": np.array([1.0, -4.0]), "b": np.array([0.5])}}]
    low = [{"loss": 2.0 + 2e-7, "grads": {"a": np.array([1.0 + 4e-6, -4.0]), "b": np.array([0.5 + 1e-7])}}]
    (got,) = side_errors(low, ref)
    # per tensor against its largest reference entry (a: 4e-6 / 4, b: 1e-7 / 0.5), the worst of them
    assert got["loss"] == pytest.approx(1e-7) and got["grads"] == pytest.approx(1e-6)


def test_bounds_are_the_margin_times_both_sides_errors():
    assert bounds_from_budget({"sides": ROW, "margin": MARGIN}, "float32") == \
        pytest.approx({"loss": 4 * 4e-7, "grads": 4 * 3e-6})
    other = dict(ROW, model="n", jax={"float32": {"loss": 1e-6, "grads": 1e-7}})
    both = step0_bounds("float32", [ROW, other])  # the envelope; each rank's loss as the loss
    assert both == pytest.approx({"loss": 4 * 1.3e-6, "grads": 4 * 3e-6, "loss_per_rank": 4 * 1.3e-6})
    assert rows_for("resnet", "n", 8, [ROW, other]) == [other]          # its own model and crop
    assert rows_for("resnet", "n", 16, [ROW, other]) == [ROW, other]    # else its family's
    assert rows_for("vit", "v", 8, [ROW]) == [ROW]                      # else every row


def test_the_parity_bounds_come_from_the_measured_budget():
    """FLOAT32's and bf16's step-0 bounds are the budget's, and a run gets its own model's rows."""
    from parity_tests.plan import plan
    from parity_tests.runner import bounds_for

    assert compare.FLOAT32.first == step0_bounds("float32", MEASURED)
    resnet = [r for r in MEASURED if r["family"] == "resnet"]
    assert compare.BFLOAT16_BN.first == {c: v for c, v in step0_bounds("bfloat16", resnet).items()
                                         if c in ("loss", "loss_per_rank")}
    tiny = ParityConfig(dtype="float32", devices=2, width=4, blocks=(1, 1, 1, 1), image_size=16)
    own = step0_bounds("float32", rows_for("resnet", tiny.model_summary(), 16))
    assert bounds_for(plan(tiny)).first == own and own["grads"] < 1e-4  # the tiny ResNet: ~1e-5, not 5e-3
    bf16 = bounds_for(plan(dataclasses.replace(tiny, dtype="bfloat16")))
    assert set(bf16.first) == {"loss", "loss_per_rank"}  # BatchNorm: the loss only


@pytest.mark.slow
def test_measure_runs_each_side_against_its_own_float64():
    """A real budget, tiny: float32 is float32-close to float64 on each side, never equal to it."""
    cfg = ParityConfig(width=4, blocks=(1, 1, 1, 1), image_size=8, batch_per_device=4, steps=1,
                       optimizer="sgd", lr=0.05, momentum=0.9)
    budget = error_budget.measure(cfg, ["float32"], log=lambda *_: None)
    for side in ("jax", "torch"):
        (step0,) = budget["sides"][side]["float32"]
        assert set(step0) == set(error_budget.CATEGORIES)
        assert all(0 < e < 1e-4 for e in step0.values()), (side, step0)
    assert budget["derived_bounds"]["float32"]["grads"] == pytest.approx(
        MARGIN * (budget["sides"]["jax"]["float32"][0]["grads"] + budget["sides"]["torch"]["float32"][0]["grads"]))
