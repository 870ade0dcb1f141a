"""The error budget (``parity_tests.error_budget``): each side against its own float64 run; the
measured rows (``parity_tests.budgets``) and the float32/bf16 bounds they raise (``runner.bounds_for``)."""

import dataclasses

import numpy as np
import pytest

from parity_tests import budgets, compare, error_budget
from parity_tests.budgets import MARGIN, MEASURED, bounds_from_budget, rows_for, side_errors, step0_bounds
from parity_tests.config import ParityConfig

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
    assert rows_for("n", 8, rows=[ROW, other]) == [other]  # its own model and crop, or nothing
    assert rows_for("n", 16, rows=[ROW, other]) == []
    sgd = dict(other, optim=("sgd", 0.05, "constant"))
    assert rows_for("n", 8, ("sgd", 0.05, "constant"), [sgd]) == [sgd]  # and its optimizer, if asked
    assert rows_for("n", 8, ("sgd", 0.1, "constant"), [sgd]) == []


def test_a_bound_is_never_below_the_models_measured_budget(monkeypatch):
    """The tiny ResNet's constants cover its budget with room; a model whose budget is larger
    gets the budget's bound in that category, and only there."""
    from parity_tests.plan import plan
    from parity_tests.runner import bounds_for

    tiny = ParityConfig(dtype="float32", devices=2, width=4, blocks=(1, 1, 1, 1), image_size=16, optimizer="sgd",
                        lr=0.05)
    budget = step0_bounds("float32", rows_for(tiny.model_summary(), 16, ("sgd", 0.05, "constant")))
    assert budget and all(budget[c] < v for c, v in compare.FLOAT32.first.items() if c in budget)
    assert bounds_for(plan(tiny)) is compare.FLOAT32

    wide = dataclasses.replace(tiny, width=8)
    noisy = {"float32": {"loss": 1e-7, "grads": 2e-3, "params": 1e-6}}
    monkeypatch.setattr(budgets, "MEASURED", MEASURED + [
        {"family": "resnet", "model": wide.model_summary(), "image_size": 16, "optim": ("sgd", 0.05, "constant"),
         "jax": noisy, "torch": noisy}])
    raised = bounds_for(plan(wide))
    assert raised.first == {**compare.FLOAT32.first, "grads": 4 * 4e-3}
    assert raised.name == "float32, raised to the measured budget" and raised.later == compare.FLOAT32.later
    assert bounds_for(plan(tiny)) is compare.FLOAT32  # another model's row changes nothing here


@pytest.mark.slow
def test_measure_runs_each_side_against_its_own_float64():
    """A real budget, tiny: float32 is float32-close to float64 on each side, never equal to it."""
    # a one-block ViT (no BatchNorm buffers): four small compiles instead of four ResNets'
    cfg = ParityConfig(model="vit-tiny", depth=1, dim=8, heads=2, mlp_dim=16, patch=4, image_size=8,
                       batch_per_device=4, steps=1, optimizer="sgd", lr=0.05, momentum=0.9)
    budget = error_budget.measure(cfg, ["float32"], log=lambda *_: None)
    for side in ("jax", "torch"):
        (step0,) = budget["sides"][side]["float32"]
        assert set(step0) == set(budgets.CATEGORIES) - {"buffers"}
        assert all(0 < e < 1e-4 for e in step0.values()), (side, step0)
    assert budget["derived_bounds"]["float32"]["grads"] == pytest.approx(
        MARGIN * (budget["sides"]["jax"]["float32"][0]["grads"] + budget["sides"]["torch"]["float32"][0]["grads"]))


def test_the_docs_show_the_measured_budget():
    import os

    docs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "parity.md")
    with open(docs) as f:
        assert budgets.measured_table() in f.read()
