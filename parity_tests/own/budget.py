"""A pair's float32 and bfloat16 bounds, from its own measured error budget: the method of
``parity_tests.error_budget`` (docs/parity.md), measured on the run itself.

Each side also runs the run's own configuration (strategy, N, batches, steps) in float64,
from the low-precision run's weights and batches (exact in float64). Then for every compared
quantity ``q`` (each rank's loss, every gradient, parameter, buffer and optimizer tensor) at
every step, each side's error against its own float64 run is measured, ``e_jax(q)`` and
``e_torch(q)`` (``compare.errors``). The two float64 runs are themselves a float64 parity
check (every quantity within 1e-10, else the run fails there: a semantic difference), so by
the triangle inequality the two low-precision sides can differ by at most about
``e_jax(q) + e_torch(q)``; the bound is ``budgets.MARGIN`` x that, and never below float64's
1e-10. No number is chosen by hand, and no model's budget stands in for another's.

Why on the run itself and not at N = 1 (``error_budget``): the built-in pairs' N = 1 budget
does not bound Adam's params at N > 1 (docs/parity.md), and a scalar such as a rank's loss
has one rounding error per step, which one N = 1 sample does not predict (measured: the
example's bf16 zero3 N = 2 rank-1 loss 2.8e-4 from torch's, against an N = 1 budget of
5e-5). Measured on the run, the triangle inequality holds quantity by quantity; and the
low-precision runs are the comparison's own, so it costs two runs (the float64 ones), not four.

Jax- and torch-free at import.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Mapping, Sequence, Tuple

from parity_tests import compare
from parity_tests.budgets import CATEGORIES, MARGIN

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


@dataclass(frozen=True)
class QuantityBounds(compare.Bounds):
    """``compare.Bounds`` with one bound per compared quantity and step (``per_step[s][key]``); a
    quantity the budget did not see (one side only) gets the floor, so it fails as in float64."""

    per_step: Tuple[Mapping[str, float], ...] = ()

    def key_bound(self, key: str, step: int) -> float:
        if 0 <= step < len(self.per_step):
            return float(self.per_step[step].get(key, FLOOR))
        return FLOOR

    def bound(self, category: str, step: int) -> float:
        """The largest bound in ``category`` at ``step`` (the plot's line)."""
        table = self.per_step[step] if 0 <= step < len(self.per_step) else {}
        values = [b for k, b in table.items() if k.split("/", 1)[0] == category]
        return max(values) if values else float("inf")

    def to_json(self) -> dict:
        return {**super().to_json(), "per_quantity": "each compared quantity's bound is in its entry"}


def quantity_errors(records: Sequence[Mapping], reference: Sequence[Mapping]) -> List[Dict[str, float]]:
    """Per step: every quantity's relative error against the same side's float64 record."""
    out = []
    for rec, ref in zip(records, reference):
        a, b = compare.flatten(rec), compare.flatten(ref)
        floors = compare.scale_floors(b, SCALE_FLOOR)
        out.append({key: compare.errors(a[key], want, floors[key])[1] for key, want in b.items() if key in a})
    return out


def bounds(dtype: str, jax_err: Sequence[Mapping[str, float]], torch_err: Sequence[Mapping[str, float]]) -> QuantityBounds:
    """``MARGIN`` x (e_jax + e_torch) per quantity and step, at least ``FLOOR``."""
    per_step = [{k: max(FLOOR, MARGIN * (j[k] + t[k])) for k in t if k in j} for j, t in zip(jax_err, torch_err)]
    return QuantityBounds(
        f"{dtype}, the pair's measured budget", {}, {}, scale_floor=SCALE_FLOOR, per_step=tuple(per_step),
        why=(f"{dtype}: every quantity at every step within {MARGIN:g} x (jaxdp's + torch's error against its own "
             f"float64 run of the same configuration, weights and batches), never below float64's {FLOOR:g}; "
             "the two float64 runs agree within 1e-10"))


def summary(jax_err: Sequence[Mapping[str, float]], torch_err: Sequence[Mapping[str, float]]) -> dict:
    """Per side, step and category: the largest error against float64 (for the report)."""
    def per_category(step: Mapping[str, float]) -> Dict[str, float]:
        out: Dict[str, float] = {}
        for key, err in step.items():
            cat = key.split("/", 1)[0]
            if cat in CATEGORIES or cat == "loss_per_rank":
                out[cat] = max(out.get(cat, 0.0), err)
        return out

    return {"margin": MARGIN, "floor": FLOOR, "jax": [per_category(s) for s in jax_err],
            "torch": [per_category(s) for s in torch_err]}
