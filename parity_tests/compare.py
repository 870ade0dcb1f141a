"""Tensor-by-tensor comparison of two step records, and the bounds they are held to.

A *record* is one training step as either side reports it (``torch_ref.step_api``'s
format; ``runner.run_jax`` produces the same from jaxdp)::

    {"loss": float, "loss_per_rank": [float, ...],
     "grads": {torch name: array}, "params": {...}, "buffers": {...},
     "optimizer_state": {torch name: {"momentum_buffer" | "exp_avg" | "exp_avg_sq" | "step": array}},
     "comm_state": {torch name: {"error": (ranks, *shape), "q": (m, r)}}}   # PowerSGD only

``flatten`` turns it into ``{key: array}`` with keys such as ``loss``,
``loss_per_rank/1``, ``grads/layer1.0.bn1.weight``, ``buffers/bn1.running_var`` and
``optimizer_state/fc.weight/exp_avg``; the first path component is the *category*.

Relative error
--------------
Per tensor, ``rel = max|a - b| / max|b|`` with ``b`` the torch side (the reference).
Not the elementwise ``max(|a - b| / |b|)``: gradients and momentum buffers have
entries that are zero or nearly so (a ReLU that never fired, a class absent from the
batch), and elementwise ratios there measure nothing but cancellation. Scaling by the
tensor's largest entry asks the question that matters for training: is the error
small compared with the size of the update/step this tensor takes? It is also what
``tests/helpers.max_rel_error`` computes, so the numbers are comparable. A tensor that
is exactly zero on the torch side gets ``rel = 0`` if the other side is zero too, else
``inf``.

Order of divergence
-------------------
Within a step the categories are checked in causal order (``CATEGORIES``): the loss is
computed first, the gradients from it, the params from those; BN running stats and
the optimizer state are side outputs. The *first divergence* is the earliest step with
any tensor over its bound, and in that step the earliest category; within the
category the tensor with the largest error/bound ratio is named (ties: the earliest
in torchvision's state_dict order, i.e. forward order).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np

CATEGORIES = ("loss", "loss_per_rank", "grads", "wire", "params", "buffers", "optimizer_state",
              "comm_state")


# ----------------------------------------------------------------------------- bounds

@dataclass(frozen=True)
class Bounds:
    """Relative-error bounds per category: ``first`` for step 0, ``later`` for steps >= 1.

    ``loss_curve``: after the last step, ``|mean loss_jax - mean loss_torch| / mean
    loss_torch`` over the run's last ``curve_window`` steps must stay below it (the
    "loss curves agree" check for float32, where individual tensors are allowed to
    drift apart chaotically). None: no curve check (every tensor is bounded anyway).
    """

    name: str
    first: Mapping[str, float]
    later: Mapping[str, float]
    loss_curve: Optional[float] = None
    curve_window: int = 5
    why: str = ""
    wire: Optional[str] = None  # "bf16" | "fp16": every averaged gradient must be such a value
    # > 0: a tensor's error is measured against its own largest entry or this fraction of its
    # group's largest (``scale_floors``), whichever is larger (a user's pair: ``parity_tests.own``)
    scale_floor: float = 0.0

    def bound(self, category: str, step: int) -> float:
        table = self.first if step == 0 else self.later
        return float(table.get(category, math.inf))

    def to_json(self) -> dict:
        out = {"name": self.name, "step0": dict(self.first), "later": dict(self.later),
               "loss_curve": self.loss_curve, "curve_window": self.curve_window, "why": self.why,
               "wire": self.wire}
        if self.scale_floor:
            out["scale_floor"] = self.scale_floor
        return out


def _every(value: float) -> Dict[str, float]:
    return {c: value for c in CATEGORIES}


FLOAT64 = Bounds(
    "float64", _every(1e-10), _every(1e-10),
    why=("float64 noise (summation order inside XLA vs ATen kernels, psum vs gloo all-reduce) "
         "is measured at <= 2e-13 per tensor over 20 steps (every pair; sgd lr 0.1: 1.9e-13, "
         "Adam: 9.7e-14), against float32's 1e-7..1e-2. Anything above 1e-10 is a different "
         "computation, not rounding."),
)

# float32 and bfloat16 bounds at step 0 are checked against the error budget
# (``parity_tests.error_budget``): each side's error against its own float64 run of the same
# weights and batches, measured per model (``budgets.MEASURED``). A run's step-0 bound per
# category is the larger of the constant below and 4 x (jaxdp's + torch's measured error) for
# its model, crop size and optimizer (``runner.bounds_for``): no bound sits below what rounding alone
# produces for that model. For the tiny ResNet the budget's bound is ~1e-5 (grads) against the
# 5e-3 below; it does not replace the constants because it does not cover Adam's first step
# at N > 1 (docs/parity.md: the N = 1 budget predicts SGD's worst pair within 1.2x, but
# Adam's params at N = 2..4 reach 2.8e-5, above 4x its N = 1 budget).
#
# Cross-framework float32 errors measured with the tiny ResNet (CPU, XLA:CPU vs ATen + gloo;
# width-4 one-block ResNet-18, 16x16 crops, 8 images per device, 20 steps; every pair of pairs.PAIRS):
#
#   worst over all pairs        loss     loss/rank  grads    params   buffers  opt state
#   step 0                      1.0e-07  1.1e-07    2.5e-06  2.8e-05  3.7e-07  2.9e-06
#   steps 1-19, lr 0.01-0.05    4.6e-07  1.7e-06    6.8e-03  8.5e-04  3.3e-06  5.0e-03
#   steps 1-19, sgd lr 0.1      8.3e-07  1.8e-06    1.2e-02  8.2e-04  5.0e-06  5.9e-03
#   bf16 hook, step 0 / later   0        0          7.2e-04 / 2.1e-01 (a rounding flip is 2^-8)
#
# (Adam's first step moves every weight by ~lr, whatever the gradient's size, so entries
# with gradients near 0 carry their rounding into the params: 2.8e-05 at step 0.)
# After step 0 the error of individual tensors grows by x2-x10 per step with the lr (the
# sgd lr 0.1 run: 2e-06 for 10 steps, then 1e-05, 3e-05, and 1e-02 at step 19), and it
# depends on the model: a ResNet-18 of width 16 with (2, 2, 2, 2) blocks at 16x16 crops
# already has 2.4e-02 in its step-0 gradients and O(1) by step 2 (float64: 1.4e-14), a
# BatchNorm over 2x2 maps amplifying rounding. So float32 bounds only what is stable:
# every tensor at step 0 (bounds ~1000x the tiny model's noise, as docs/design-notes.md
# has it: 5e-4 in a full ResNet-18's first conv), the loss at every step, and the loss
# curves. Whether a float32 difference is a bug is float64's question.
FLOAT32 = Bounds(
    "float32",
    first={"loss": 1e-5, "loss_per_rank": 1e-5, "grads": 5e-3, "params": 5e-3,
           "buffers": 1e-3, "optimizer_state": 5e-3, "comm_state": 5e-3},
    later={"loss": 1e-2, "loss_per_rank": 1e-2},
    loss_curve=1e-2,
    why=("float32: step 0 every tensor (loss 1e-5, grads/params/optimizer state 5e-3, BN "
         "buffers 1e-3, or the model's measured error budget where larger); later steps the loss of every "
         "rank within 1%, tensors reported but not bounded (training amplifies rounding chaotically); loss "
         "curves (mean of the last 5 steps) within 1%."),
)

# bfloat16 mixed precision: float32 params (master weights, optimizer state) and bf16
# compute, against torch's autocast(bf16) (dp, ddp, zero1) or FSDP2's MixedPrecisionPolicy (zero2, zero3, hsdp).
# The sides round at different points (XLA fuses across ops, autocast casts per op), so
# each activation may differ by ~u = 2^-8 (bf16's unit roundoff), and through a network
# of depth L by up to ~L u in the worst direction. Measured (N=2, SGD, 6 steps):
#                                 loss     loss/rank  grads    params   opt state
#   ViT depth 2 dim 20, step 0    5.3e-05  6.0e-04    2.6e-02  2.2e-02  2.6e-02   (<= 7 u)
#   ViT, steps 1-5                7.4e-04  1.5e-03    6.5e-02  4.6e-02  4.6e-02
#   ResNet width 4, step 0        9.1e-05  6.0e-04    5.2e-01  3.9e-01  5.2e-01
#   ResNet, steps 1-5             2.8e-03  5.2e-03    1.5e+00  ...
# (A BatchNorm over 2x2 maps amplifies a rounding difference into O(1) gradients, as in
# float32 at full depth: each side's own bf16 gradients are 0.4-0.5 from its float64 ones.)
# So: the loss of every rank at every step within 2 u (every model); the step-0 gradients,
# params and optimizer state within 16 u = 2L u for a model without BatchNorm (the ViT: L ~ 8
# matmul/norm stages); the loss curves within 2 u.
BF16_U = 2.0 ** -8
BFLOAT16 = Bounds(
    "bfloat16",
    first={"loss": 2 * BF16_U, "loss_per_rank": 2 * BF16_U, "grads": 16 * BF16_U,
           "params": 16 * BF16_U, "optimizer_state": 16 * BF16_U},
    later={"loss": 2 * BF16_U, "loss_per_rank": 2 * BF16_U},
    loss_curve=2 * BF16_U,
    why=("bfloat16 compute, float32 params: the loss of every rank within 2u (u = 2^-8, bf16's "
         "unit roundoff) at every step; step 0 grads/params/optimizer state within 16u (or the model's measured "
         "error budget where larger); loss curves within 2u. BatchNorm models: see compare.BFLOAT16_BN."),
)
# With BatchNorm the step-0 tensors are not bounded (measured 0.5 at width 4; each side's own bf16
# gradients are 0.4-0.5 from its float64 ones): the loss only.
BFLOAT16_BN = dataclasses.replace(BFLOAT16, first={"loss": 2 * BF16_U, "loss_per_rank": 2 * BF16_U},
                                  why="bfloat16 with BatchNorm: the loss of every rank within 2u at every step, "
                                      "the loss curves within 2u (tensors reported, not bounded).")

DEFAULT_BOUNDS = {"float64": FLOAT64, "float32": FLOAT32, "bfloat16": BFLOAT16}

# bf16/fp16 compression hooks (``ddp --compress bf16|fp16``) on N ranks.
#
# Both sides cast each gradient to the wire format, divide by N there and SUM all-reduce
# in it, so the terms p_i = fl(fl(g_i) / N) are the same on both sides. What differs is
# how the SUM rounds: XLA:CPU promotes a bf16 all-reduce to f32 and rounds once (f16: adds
# in f16, device order), gloo rounds at each of the N - 1 hops of its ring, in its own
# order. Each hop errs by <= u |partial sum| <= u sum_i |p_i|, and the other side rounds
# once more, so per element |jaxdp - torch| <= N u sum_i |p_i|, with u the unit roundoff
# (2^-8 bf16, 2^-11 fp16). Relative to the tensor's largest entry (our rel err) that is
# N u kappa, kappa = max sum_i |p_i| / max |sum_i p_i|: how much the ranks' gradients
# cancel. We allow kappa up to CANCELLATION = 4; measured at step 0 (float64, tiny
# ResNet, 8 images per rank) rel err / (N u) = 0.98 (fp16, N=3), 0.66 (bf16, N=3), 0.51
# (fp16, N=4), 0.47 (bf16, N=4), 0.38 (bf16, N=8). Per category, at step 0:
#   grads            4 N u: the bound above;
#   params           4 N u: the first update is linear in the gradient (SGD: lr (1 + mu) g
#                    with nesterov; for a zero-initialised BN bias the new value *is* that
#                    update, so its relative error is the gradient's: measured equal), and
#                    Adam's first step g / (|g| + eps) is scale-free, so no larger;
#   optimizer_state  8 N u: the momentum buffer and exp_avg are linear in g, exp_avg_sq is
#                    quadratic, which doubles the relative error (measured 2.0x the grads');
#   loss, loss_per_rank, buffers: the base's: the forward and its BN statistics come before
#                    any rounding (measured 1e-15 in float64).
# From step 1 on the params differ by lr x that, and BatchNorm amplifies it chaotically as
# in float32 (bf16, N=3, SGD lr 0.05: grads 3e-2 at step 1, 0.6 at step 3), so only the
# loss is bounded, as float32 bounds it: 1% per rank and step, and the loss curves. Measured
# 3.8e-4 per rank at step 3; 9e-3 at step 7 and 8e-2 at step 18: the two trajectories are
# then different runs, so compare compressed pairs over a few steps (the tests use 4).
#
# No bound separates what is within rounding of the right numbers, yet computed the wrong
# way, e.g. a skipped cast (the exact average) or the division by N done after the cast
# back (fl(sum) / 3 is not a bf16 value). Hence an exact check beside the bounds: every
# averaged gradient on both sides must be a value of the wire format (category ``wire``,
# bound 0), as the hook's last step, the cast back from the wire, makes it.
#
# N <= 2: one addition, rounded once on both sides, so the base bounds stay (float64 agrees
# bit for bit), plus the wire check.
UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
CANCELLATION = 4.0


def low_precision_wire(base: Bounds, wire: str, n: int) -> Bounds:
    """``base`` for a pair whose gradients cross the wire in ``wire`` on ``n`` ranks (see above)."""
    first, later = {**base.first, "wire": 0.0}, {**base.later, "wire": 0.0}
    if n <= 2:
        return Bounds(f"{base.name}, {wire} wire", first, later, base.loss_curve, base.curve_window,
                      base.why + f" Every averaged gradient is a {wire} value.", wire)
    rounding = CANCELLATION * n * UNIT_ROUNDOFF[wire]
    for category, factor in (("grads", 1), ("params", 1), ("optimizer_state", 2)):
        first[category] = max(first[category], factor * rounding)
    later = {"loss": FLOAT32.later["loss"], "loss_per_rank": FLOAT32.later["loss_per_rank"], "wire": 0.0}
    return Bounds(
        f"{base.name}, {wire} wire on {n} ranks", first, later, FLOAT32.loss_curve, base.curve_window,
        why=(f"{wire} all-reduce on {n} ranks, rounded at each hop by torch and once by XLA: step 0 "
             f"grads/params {first['grads']:.1e} and optimizer state {first['optimizer_state']:.1e} "
             f"(4 N u, 8 N u with u = {UNIT_ROUNDOFF[wire]:.1e}), loss and BN buffers as {base.name}; "
             "later steps the loss of every rank within 1% and the loss curves; every averaged "
             f"gradient a {wire} value at every step."),
        wire=wire)


def off_wire(x: np.ndarray, wire: str):
    """(max abs, rel) distance of ``x`` from its rounding to ``wire``: 0 when every entry is a wire value."""
    import ml_dtypes

    dtype = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16}[wire]
    x = np.asarray(x, np.float64)
    with np.errstate(over="ignore"):  # beyond fp16's range: inf, reported as such
        return errors(x, x.astype(dtype).astype(np.float64))


# ----------------------------------------------------------------------------- records

def flatten(record: Mapping) -> Dict[str, np.ndarray]:
    """``{category/name[/key]: float64 array}`` for every compared quantity in a record."""
    out: Dict[str, np.ndarray] = {}
    if record.get("loss") is not None:
        out["loss"] = np.asarray(record["loss"], np.float64)
    for r, v in enumerate(record.get("loss_per_rank") or ()):
        out[f"loss_per_rank/{r}"] = np.asarray(v, np.float64)
    for cat in ("grads", "params", "buffers"):
        for name, v in (record.get(cat) or {}).items():
            out[f"{cat}/{name}"] = np.asarray(v, np.float64)
    for cat in ("optimizer_state", "comm_state"):
        for name, state in (record.get(cat) or {}).items():
            for key, v in state.items():
                out[f"{cat}/{name}/{key}"] = np.asarray(v, np.float64)
    return out


def errors(a: np.ndarray, b: np.ndarray, floor: float = 0.0):
    """(max abs error, relative error ``max|a-b| / max|b|``) of ``a`` against reference ``b``;
    the scale ``max|b|`` is raised to ``floor`` where it is smaller (``scale_floors``)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return math.inf, math.inf
    if a.size == 0:
        return 0.0, 0.0
    diff = np.abs(a - b)
    abs_err = float(diff.max())
    if not np.isfinite(abs_err):
        return math.inf, math.inf
    scale = max(float(np.abs(b).max()), floor)
    if scale == 0.0:
        return abs_err, (0.0 if abs_err == 0.0 else math.inf)
    return abs_err, abs_err / scale


# ----------------------------------------------------------------------------- comparison

@dataclass
class Entry:
    key: str
    abs_err: float
    rel_err: float
    bound: float
    note: str = ""

    @property
    def category(self) -> str:
        return self.key.split("/", 1)[0]

    @property
    def ok(self) -> bool:
        return self.rel_err <= self.bound

    @property
    def ratio(self) -> float:
        if self.bound == 0:
            return math.inf if self.rel_err > 0 else 0.0
        return self.rel_err / self.bound

    def to_json(self) -> dict:
        d = {"abs": _finite(self.abs_err), "rel": _finite(self.rel_err), "bound": _finite(self.bound)}
        if self.note:
            d["note"] = self.note
        return d


@dataclass
class StepComparison:
    step: int
    entries: List[Entry]
    loss_jax: float
    loss_torch: float

    def failures(self) -> List[Entry]:
        return [e for e in self.entries if not e.ok]

    def first_failure(self) -> Optional[Entry]:
        """The earliest category with a failure, its worst tensor (ties: first in order)."""
        bad = self.failures()
        for cat in CATEGORIES:
            in_cat = [e for e in bad if e.category == cat]
            if in_cat:
                return max(in_cat, key=lambda e: (e.ratio, -in_cat.index(e)))
        return None

    def worst(self) -> Optional[Entry]:
        """The quantity with the largest relative error (bounded or not); for the table."""
        if not self.entries:
            return None
        return max(self.entries, key=lambda e: (e.rel_err, e.ratio))

    def tightest(self) -> Optional[Entry]:
        """The quantity closest to (or furthest over) its bound."""
        bounded = [e for e in self.entries if math.isfinite(e.bound)]
        return max(bounded, key=lambda e: (e.ratio, e.rel_err)) if bounded else None

    def max_rel(self, category: Optional[str] = None) -> float:
        vals = [e.rel_err for e in self.entries if category is None or e.category == category]
        return max(vals, default=0.0)

    def max_abs(self) -> float:
        return max((e.abs_err for e in self.entries), default=0.0)

    def to_json(self) -> dict:
        worst = self.worst()
        return {
            "step": self.step, "loss_jax": self.loss_jax, "loss_torch": self.loss_torch,
            "max_rel": _finite(self.max_rel()), "max_abs": _finite(self.max_abs()),
            "max_rel_by_category": {c: _finite(self.max_rel(c)) for c in CATEGORIES
                                    if any(e.category == c for e in self.entries)},
            "worst": worst.key if worst else None,
            "tightest": self.tightest().key if self.tightest() else None,
            "failures": [e.key for e in self.failures()],
            "tensors": {e.key: e.to_json() for e in self.entries},
        }


@dataclass
class Divergence:
    step: int
    key: str
    rel_err: float
    bound: float
    abs_err: float
    count: int  # tensors over their bound in that step
    total: int
    detail: str = ""  # a failure that is not one tensor's error (e.g. the step counts differ)

    @property
    def category(self) -> str:
        return self.key.split("/", 1)[0]

    def message(self) -> str:
        if self.detail:
            return f"diverged: {self.detail}"
        if self.step < 0:
            return f"diverged: {self.key}: {self.note_text()}"
        return (f"diverged at step {self.step}: {self.key} rel err {self.rel_err:.1e} > "
                f"{self.bound:.0e} (max abs {self.abs_err:.1e}; {self.count} of {self.total} "
                f"compared quantities over their bound at that step)")

    def note_text(self) -> str:
        return f"rel err {self.rel_err:.1e} > {self.bound:.0e}"

    def to_json(self) -> dict:
        return {"step": self.step, "key": self.key, "category": self.category,
                "rel": _finite(self.rel_err), "abs": _finite(self.abs_err),
                "bound": _finite(self.bound), "count": self.count, "total": self.total,
                "message": self.message()}


@dataclass
class Comparison:
    steps: List[StepComparison]
    bounds: Bounds
    curve: Optional[Entry] = None
    divergence: Optional[Divergence] = None

    @property
    def passed(self) -> bool:
        return self.divergence is None

    def to_json(self) -> dict:
        return {"passed": self.passed, "bounds": self.bounds.to_json(),
                "divergence": self.divergence.to_json() if self.divergence else None,
                "loss_curve": (dict(self.curve.to_json(), window=self.bounds.curve_window)
                               if self.curve else None),
                "steps": [s.to_json() for s in self.steps]}


def scale_floors(flat: Mapping[str, np.ndarray], fraction: float) -> Dict[str, float]:
    """Per quantity: ``fraction`` of the largest entry in its group (its category; the optimizer
    and comm state by kind too, ``exp_avg_sq`` apart from ``exp_avg``), 0 for ``fraction`` 0.

    Why: a tensor that is zero in exact arithmetic (the gradient of a bias followed by a
    BatchNorm, which removes any shift) holds only rounding noise on each side, and noise
    against noise is O(1) relative to itself. Measured against a fraction of its group's
    scale, float64 noise (~1e-16 of that scale) is again far below 1e-10, while a real
    difference there (a gradient where the other side has none) is not."""
    if not fraction:
        return {key: 0.0 for key in flat}

    def group(key: str) -> str:
        parts = key.split("/")
        return parts[0] + ("/" + parts[-1] if parts[0] in ("optimizer_state", "comm_state") else "")

    largest: Dict[str, float] = {}
    for key, x in flat.items():
        if np.size(x):
            largest[group(key)] = max(largest.get(group(key), 0.0), float(np.nanmax(np.abs(x))))
    return {key: fraction * largest.get(group(key), 0.0) for key in flat}


def compare_step(step: int, jax_rec: Mapping, torch_rec: Mapping, bounds: Bounds,
                 skip: Sequence[str] = ()) -> StepComparison:
    """Every quantity torch reported, against jaxdp's. ``skip``: categories not comparable
    for this pair (e.g. ``loss_per_rank`` when torch ran one process on the full batch).
    A quantity on one side only is an error (rel = inf) with a note saying which side."""
    a, b = flatten(jax_rec), flatten(torch_rec)
    floors = scale_floors(b, bounds.scale_floor)
    entries = []
    for key in list(b) + [k for k in a if k not in b]:
        cat = key.split("/", 1)[0]
        if cat in skip:
            continue
        bound = bounds.bound(cat, step)
        if key not in a:
            entries.append(Entry(key, math.inf, math.inf, bound, "missing on the jaxdp side"))
        elif key not in b:
            entries.append(Entry(key, math.inf, math.inf, bound, "missing on the torch side"))
        else:
            abs_err, rel = errors(a[key], b[key], floors[key])
            note = "" if a[key].shape == b[key].shape else f"shape {a[key].shape} vs {b[key].shape}"
            entries.append(Entry(key, abs_err, rel, bound, note))
    if bounds.wire:
        entries += wire_entries(step, {"jaxdp": jax_rec, "torch": torch_rec}, bounds)
    order = {c: i for i, c in enumerate(CATEGORIES)}
    entries.sort(key=lambda e: order.get(e.category, len(order)))  # stable: keeps torch's order within
    return StepComparison(step, entries, float(jax_rec.get("loss", math.nan)),
                          float(torch_rec.get("loss", math.nan)))


def wire_entries(step: int, records: Mapping[str, Mapping], bounds: Bounds) -> List[Entry]:
    """``wire/<side>/<name>``: how far each side's averaged gradient is from the wire format."""
    entries = []
    for side, record in records.items():
        for name, grad in (record.get("grads") or {}).items():
            abs_err, rel = off_wire(grad, bounds.wire)
            note = f"not a {bounds.wire} value" if rel else ""
            entries.append(Entry(f"wire/{side}/{name}", abs_err, rel, bounds.bound("wire", step), note))
    return entries


def compare_runs(jax_steps: Sequence[Mapping], torch_steps: Sequence[Mapping], bounds: Bounds,
                 skip: Sequence[str] = ()) -> Comparison:
    """Compare step by step, then the loss curves. Both sides must have the same number of
    steps: the steps they share are compared (for the report), and a side that stopped
    early is a divergence at the first step it lacks, naming both lengths."""
    n = min(len(jax_steps), len(torch_steps))
    steps = [compare_step(i, jax_steps[i], torch_steps[i], bounds, skip) for i in range(n)]
    result = Comparison(steps, bounds)
    for s in steps:
        bad = s.first_failure()
        if bad is not None:
            result.divergence = Divergence(s.step, bad.key, bad.rel_err, bad.bound, bad.abs_err,
                                           len(s.failures()), len(s.entries))
            break
    if result.divergence is None and len(jax_steps) != len(torch_steps):
        result.divergence = Divergence(
            n, "steps", math.inf, 0.0, math.inf, 1, 1,
            detail=(f"jaxdp has {len(jax_steps)} steps and torch {len(torch_steps)}: one side "
                    f"stopped early, so steps {n} and later were never compared"))
    if bounds.loss_curve is not None and n:
        w = min(bounds.curve_window, n)
        lj = float(np.mean([s.loss_jax for s in steps[-w:]]))
        lt = float(np.mean([s.loss_torch for s in steps[-w:]]))
        abs_err, rel = errors(lj, lt)
        result.curve = Entry(f"loss curve (mean of the last {w} steps)", abs_err, rel, bounds.loss_curve)
        if not result.curve.ok and result.divergence is None:
            result.divergence = Divergence(-1, result.curve.key, rel, bounds.loss_curve, abs_err, 1, 1)
    return result


def _finite(x: float):
    """JSON has no inf/nan: write them as strings."""
    x = float(x)
    return x if math.isfinite(x) else str(x)
