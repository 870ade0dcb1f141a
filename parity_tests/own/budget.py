"""A pair's float32 and bfloat16 bounds, from its own measured error budget: the method of
``parity_tests.error_budget`` and docs/parity.md, applied to the pair and to every step.

The budget is the run's own configuration at N = 1 (its strategy, ``batch_per_device`` rows a
step, its steps and optimizer), run on each side from the same weights and batches, once in
float64 and once in the low dtype. Per step and category, each side's error is the largest
relative error of a quantity against its own float64 run (``compare.errors``, with the scale
floors below; ``budgets.side_errors``). The two float64 runs agree within 1e-10 (checked: else the pair differs in
its math and no budget is taken), so by the triangle inequality the two sides can differ by
about ``e_jax + e_torch``; a run's bound per step and category is ``budgets.MARGIN`` x that,
never below float64's 1e-10. No number is chosen by hand.

One exception, measured: the loss is one number per step (each rank's too), so one step of
the budget is one sample of its rounding, which a run at N > 1 with other rows may exceed many
times over (the example's bf16 run at N = 2: a rank's loss 44x the same step's budget). Its
budget is the largest over the budget run's steps: over the 126 runs of the broad matrix
(``parity_tests.own.matrix``) the worst loss was then 1.25x of it, and the worst tensor 2.4x
of its own step's (BatchNorm's float32 gradients), both under MARGIN = 4.

The budget serves every N of a strategy and dtype (cached in this process). Jax- and torch-free
at import.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Tuple

from parity_tests import compare
from parity_tests.budgets import CATEGORIES, MARGIN, side_errors

FLOOR = compare.FLOAT64.bound("grads", 0)  # nothing is held tighter than float64 is
# A tensor is measured against its own largest entry, or a thousandth of its group's largest
# (``compare.scale_floors``), whichever is larger: a user's model may hold tensors that are zero
# in exact arithmetic (a bias before a BatchNorm has a gradient of rounding noise, ~1e-17 on
# each side in float64: O(1) apart relative to itself, 1e-13 of the floor). The built-in
# models have none (their convolutions before BatchNorm carry no bias) and keep 0.
SCALE_FLOOR = 1e-3
FLOAT64 = dataclasses.replace(
    compare.FLOAT64, scale_floor=SCALE_FLOOR,
    why=compare.FLOAT64.why + f" Each tensor's scale is at least {SCALE_FLOOR:g} of its group's largest entry "
                              "(compare.scale_floors: a tensor that is zero in exact arithmetic holds rounding noise).")
SCALARS = ("loss",)  # one number per step: bounded by the largest over the budget's steps

_MEASURED: Dict[Any, dict] = {}


@dataclass(frozen=True)
class StepBounds(compare.Bounds):
    """``compare.Bounds`` with one table per step (``per_step[s]``: category -> bound)."""

    per_step: Tuple[Mapping[str, float], ...] = ()

    def bound(self, category: str, step: int) -> float:
        if 0 <= step < len(self.per_step):
            return float(self.per_step[step].get(category, float("inf")))
        return float("inf")

    def to_json(self) -> dict:
        return {**super().to_json(), "per_step": [dict(b) for b in self.per_step]}


def budget_key(fac, run) -> tuple:
    """What a budget depends on: the factory itself (its label is one for every ``functools.partial``
    of a function, whatever its arguments), not the device count, nor where torch runs."""
    skip = {"devices", "mesh_shape", "backend", "timeout_s", "torch_cudnn"}
    return (fac.ref,) + tuple((f.name, repr(getattr(run, f.name))) for f in dataclasses.fields(run)
                                if f.name not in skip)


def measure(fac, run) -> dict:
    """The budget of ``run`` (its dtype, its strategy at N = 1; the clean pair: a bound must not depend
    on an injected bug): ``{"jax": [per step {category: error}], "torch": [...], "float64": the N = 1
    float64 comparison, ...}``."""
    import time

    from parity_tests.own.sides import float64_reference, planned, sides
    from parity_tests.own.setup import prepare

    key = budget_key(fac, run)
    if key not in _MEASURED:
        t0 = time.perf_counter()
        one = dataclasses.replace(run, devices=1, mesh_shape=None)
        setup = prepare(fac, one)
        low = sides(planned(one), fac, None, setup)
        reference = float64_reference(fac, one, None, setup)
        check = compare.compare_runs(reference["jax"], reference["torch"], FLOAT64)
        _MEASURED[key] = {"dtype": run.dtype, "strategy": run.strategy, "devices": 1, "rows": run.batch_per_device,
                          "margin": MARGIN, "floor": FLOOR, "float64": check,
                          "jax": side_errors(low["jax"], reference["jax"], SCALE_FLOOR),
                          "torch": side_errors(low["torch"], reference["torch"], SCALE_FLOOR),
                          "seconds": time.perf_counter() - t0}
    return _MEASURED[key]


def bounds(budget: Mapping) -> StepBounds:
    """``MARGIN`` x (jaxdp's + torch's error) per step and category (the loss: the largest over the
    steps), at least ``FLOOR``; each rank's loss is bounded as the loss."""
    jax_err, torch_err = budget["jax"], budget["torch"]
    scalars = {c: max(j.get(c, 0.0) + t.get(c, 0.0) for j, t in zip(jax_err, torch_err)) for c in SCALARS}
    per_step = []
    for j, t in zip(jax_err, torch_err):
        step = {c: max(FLOOR, MARGIN * scalars.get(c, j[c] + t[c])) for c in CATEGORIES if c in j and c in t}
        step["loss_per_rank"] = step["loss"]
        per_step.append(step)
    dtype = budget["dtype"]
    return StepBounds(
        f"{dtype}, the pair's measured budget", per_step[0], per_step[-1], scale_floor=SCALE_FLOOR,
        per_step=tuple(per_step),
        why=(f"{dtype}: per step and category within {MARGIN:g} x (jaxdp's + torch's error against its own float64 "
             f"run), measured on this pair with {budget['strategy']} at N = 1 ({budget['rows']} rows a step; the "
             f"loss: the largest over the steps), never below float64's {FLOOR:g}"))


def summary(budget: Mapping) -> dict:
    """The budget as report.json keeps it."""
    return {k: v for k, v in budget.items() if k != "float64"} | {
        "float64_max_rel": max((s.max_rel() for s in budget["float64"].steps), default=0.0)}
