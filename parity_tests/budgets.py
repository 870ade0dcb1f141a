"""The measured error budgets (``MEASURED``: each side's float32/bf16 error against its own
float64 run, per model, from ``python -m parity_tests.error_budget``) and the bounds they give:
``MARGIN`` x (jaxdp's + torch's error) per category. ``runner.bounds_for`` raises a run's
float32/bf16 step-0 bounds to its model's rows where those are larger.

Jax- and torch-free.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence

from parity_tests.compare import errors, flatten, scale_floors

CATEGORIES = ("loss", "grads", "params", "buffers", "optimizer_state")

# The budget's bound is MARGIN x (e_jax + e_torch) at step 0. e_jax + e_torch already bounds
# |jaxdp - torch| for the inputs measured (triangle inequality through the exact result,
# which both float64 runs give to 1e-13); the margin covers the other strategies, N and
# accumulation of the same model. Measured: the tiny ResNet's SGD budget at N = 1 (grads
# 2.4e-6, optimizer state 2.5e-6, loss 1.0e-7, buffers 4.3e-7) against the worst step-0
# cross-framework error over every CPU pair at N = 2..4 (grads 2.5e-6, optimizer state 2.9e-6,
# loss 1.0e-7, buffers 3.7e-7): at most 1.2x, so 4 leaves 3x to spare. Adam's params are the
# exception (compare.py): its first step turns a near-zero gradient's rounding into a full
# lr-sized update, which depends on each rank's batch, so an N = 1 budget does not bound them.
MARGIN = 4.0

# The budget, measured with parity_tests.error_budget (step 0; each side's largest relative error against its
# own float64 run, per category). A run's step-0 bounds are raised to its model's rows where
# larger (``rows_for``, ``runner.bounds_for``). CPU rows: XLA:CPU (jax 0.10.2) against ATen
# (torch 2.13.0), gloo, N = 1; GPU rows are to be added from the same command on a GPU.
TINY_RESNET = "resnet18 width 4 blocks (1, 1, 1, 1)"
TINY_VIT = "vit-tiny depth 2 dim 20 heads 2 mlp_dim 40 patch 8"
MEASURED = [
    {"family": "resnet", "model": TINY_RESNET, "image_size": 16, "where": "CPU", "optimizer": "sgd nesterov lr 0.05",
     "optim": ("sgd", 0.05, "constant"),
     "command": "python -m parity_tests.error_budget --width 4 --blocks 1,1,1,1 --image-size 16 "
                "--batch-per-device 8 --steps 2 --optimizer sgd --lr 0.05 --momentum 0.9 --nesterov "
                "--weight-decay 5e-4",
     "jax": {"float32": {"loss": 5.1e-08, "grads": 1.1e-06, "params": 7.7e-07, "buffers": 2.4e-07,
                         "optimizer_state": 1.1e-06},
             "bfloat16": {"loss": 1.5e-04, "grads": 5.2e-01, "params": 2.2e-01, "buffers": 5.7e-03,
                          "optimizer_state": 5.2e-01}},
     "torch": {"float32": {"loss": 5.1e-08, "grads": 1.3e-06, "params": 6.9e-07, "buffers": 1.8e-07,
                           "optimizer_state": 1.3e-06},
               "bfloat16": {"loss": 9.9e-04, "grads": 4.2e-01, "params": 4.2e-01, "buffers": 4.9e-03,
                            "optimizer_state": 4.2e-01}}},
    {"family": "resnet", "model": TINY_RESNET, "image_size": 16, "where": "CPU", "optimizer": "adam lr 1e-3",
     "optim": ("adam", 1e-3, "constant"),
     "command": "python -m parity_tests.error_budget --width 4 --blocks 1,1,1,1 --image-size 16 "
                "--batch-per-device 8 --steps 1 --optimizer adam --lr 1e-3 --betas 0.9,0.99 --weight-decay 1e-4",
     "jax": {"float32": {"loss": 5.1e-08, "grads": 1.1e-06, "params": 2.6e-06, "buffers": 2.4e-07,
                         "optimizer_state": 2.3e-06},
             "bfloat16": {"loss": 1.5e-04, "grads": 5.2e-01, "params": 2.0e+00, "buffers": 5.7e-03,
                          "optimizer_state": 5.2e-01}},
     "torch": {"float32": {"loss": 5.1e-08, "grads": 1.3e-06, "params": 4.0e-07, "buffers": 1.8e-07,
                           "optimizer_state": 2.6e-06},
               "bfloat16": {"loss": 9.9e-04, "grads": 4.2e-01, "params": 2.0e+00, "buffers": 4.9e-03,
                            "optimizer_state": 1.0e+00}}},
    # ResNet-18 at its real size: each side's float32 gradients are 2-7e-2 from its own float64
    # ones at step 0 (BatchNorm amplifying rounding through 8 blocks), so the first GPU run's
    # 1.9e-2 between the two sides is within rounding, and float32's 5e-3 constant is not.
    {"family": "resnet", "model": "resnet18 width 64 blocks (2, 2, 2, 2)", "image_size": 32, "where": "CPU",
     "optimizer": "sgd nesterov lr 0.05", "optim": ("sgd", 0.05, "constant"),
     "command": "python -m parity_tests.error_budget --width 64 --blocks 2,2,2,2 --image-size 32 "
                "--batch-per-device 64 --steps 1 --optimizer sgd --lr 0.05 --momentum 0.9 --nesterov "
                "--weight-decay 5e-4",
     "jax": {"float32": {"loss": 1.1e-07, "grads": 7.2e-02, "params": 1.2e-02, "buffers": 1.3e-07,
                         "optimizer_state": 7.1e-02},
             "bfloat16": {"loss": 3.9e-05, "grads": 4.6e-01, "params": 4.6e-01, "buffers": 4.6e-03,
                          "optimizer_state": 4.6e-01}},
     "torch": {"float32": {"loss": 1.1e-07, "grads": 2.4e-02, "params": 1.3e-02, "buffers": 1.9e-07,
                           "optimizer_state": 2.3e-02},
               "bfloat16": {"loss": 5.8e-04, "grads": 4.2e-01, "params": 4.0e-01, "buffers": 4.6e-03,
                            "optimizer_state": 4.4e-01}}},
    # AdamW turns a gradient that is zero in exact arithmetic (the key third of the qkv bias)
    # into an lr-sized update of its rounding noise's sign: each side's float32 params are
    # 3-5e-3 from its float64 ones at step 0 (a zero-initialised bias: bf16 flips signs, 2.0).
    {"family": "vit", "model": TINY_VIT, "image_size": 16, "where": "CPU", "optimizer": "adamw lr 2e-3",
     "optim": ("adamw", 2e-3, "constant"),
     "command": "python -m parity_tests.error_budget --model vit-tiny --depth 2 --dim 20 --heads 2 --mlp-dim 40 "
                "--patch 8 --image-size 16 --batch-per-device 4 --steps 1 --optimizer adamw --lr 2e-3 "
                "--weight-decay 0.05",
     "jax": {"float32": {"loss": 1.2e-08, "grads": 6.7e-07, "params": 4.9e-03, "optimizer_state": 9.2e-07},
             "bfloat16": {"loss": 1.8e-03, "grads": 2.2e-02, "params": 2.0e+00, "optimizer_state": 3.1e-02}},
     "torch": {"float32": {"loss": 1.2e-08, "grads": 1.7e-06, "params": 3.2e-03, "optimizer_state": 3.4e-06},
               "bfloat16": {"loss": 4.4e-04, "grads": 2.3e-02, "params": 5.4e-02, "optimizer_state": 3.9e-02}}},
    # ViT-Tiny at its real size (dim 192, depth 12, patch 4 on 32x32), gpu-check's realistic ViT: the same
    # AdamW effect, each side's float32 params 1.6-2.3e-3 from float64 at step 0, within 2x of the 5e-3
    # constant; in bf16 each side's own params are O(1) away (2.0), so there only the loss is bounded.
    {"family": "vit", "model": "vit-tiny", "image_size": 32, "where": "CPU", "optimizer": "adamw lr 1e-3",
     "optim": ("adamw", 1e-3, "constant"),
     "command": "python -m parity_tests.error_budget --model vit-tiny --image-size 32 --batch-per-device 64 "
                "--steps 1 --optimizer adamw --lr 1e-3 --weight-decay 1e-2",
     "jax": {"float32": {"loss": 3.1e-08, "grads": 1.1e-06, "params": 2.3e-03, "optimizer_state": 1.4e-06},
             "bfloat16": {"loss": 4.3e-04, "grads": 2.9e-01, "params": 2.0e+00, "optimizer_state": 4.8e-01}},
     "torch": {"float32": {"loss": 6.6e-08, "grads": 2.9e-06, "params": 1.6e-03, "optimizer_state": 5.8e-06},
               "bfloat16": {"loss": 8.8e-04, "grads": 1.5e-02, "params": 2.0e+00, "optimizer_state": 2.6e-02}}},
]


def side_errors(records: Sequence[Mapping], reference: Sequence[Mapping],
                scale_floor: float = 0.0) -> List[Dict[str, float]]:
    """Per step, per category (each rank's loss as the loss): the largest relative error of
    ``records`` against ``reference``, each tensor's scale at least ``scale_floor`` of its group's
    largest entry (``compare.scale_floors``; 0: its own largest entry alone)."""
    out = []
    for rec, ref in zip(records, reference):
        a, b = flatten(rec), flatten(ref)
        floors = scale_floors(b, scale_floor)
        worst: Dict[str, float] = {}
        for key, want in b.items():
            cat = key.split("/", 1)[0]
            cat = "loss" if cat == "loss_per_rank" else cat
            if cat in CATEGORIES and key in a:
                worst[cat] = max(worst.get(cat, 0.0), errors(a[key], want, floors[key])[1])
        out.append(worst)
    return out


def bounds_from_budget(budget: Mapping, dtype: str, step: int = 0) -> Dict[str, float]:
    """The cross-framework bound per category: ``MARGIN`` x (jaxdp's + torch's error against
    their float64 runs) at ``step``, from a ``measure`` result (or a row of ``MEASURED``)."""
    sides = budget["sides"]
    jax_err, torch_err = sides["jax"][dtype], sides["torch"][dtype]
    if isinstance(jax_err, list):  # a measure() result: per step; a MEASURED row: step 0 only
        jax_err, torch_err = jax_err[step], torch_err[step]
    return {c: budget.get("margin", MARGIN) * (jax_err[c] + torch_err[c])
            for c in CATEGORIES if c in jax_err and c in torch_err}


def rows_for(model: str, image_size: int, optim: Optional[Sequence] = None,
             rows: Optional[Sequence[Mapping]] = None) -> List[Mapping]:
    """The measured rows of this model (``ParityConfig.model_summary``) at this crop size, and with
    ``optim`` = (optimizer, lr, schedule) only those measured with that optimizer."""
    rows = MEASURED if rows is None else rows
    return [r for r in rows if (r["model"], r["image_size"]) == (model, image_size)
            and (optim is None or tuple(r["optim"]) == tuple(optim))]


def step0_bounds(dtype: str, rows: Sequence[Mapping]) -> Dict[str, float]:
    """Per category: ``MARGIN`` x the largest (jaxdp + torch) error among ``rows`` (a row without
    ``dtype`` is skipped), with the record's other names: each rank's loss is bounded as the loss,
    PowerSGD's state as the optimizer state."""
    out: Dict[str, float] = {}
    for row in rows:
        if dtype in row["jax"] and dtype in row["torch"]:
            for c, v in bounds_from_budget({"sides": row, "margin": MARGIN}, dtype).items():
                out[c] = max(out.get(c, 0.0), v)
    if "loss" in out:
        out["loss_per_rank"] = out["loss"]
    if "optimizer_state" in out:
        out["comm_state"] = out["optimizer_state"]
    return out


def measured_table(rows: Optional[Sequence[Mapping]] = None) -> str:
    """``MEASURED`` as the Markdown table docs/parity.md shows (its test keeps the two equal)."""
    rows = MEASURED if rows is None else rows
    lines = ["| model, crop, optimizer (constant lr) | where | side | dtype | " + " | ".join(CATEGORIES) + " |",
             "|---|---|---|---|" + "---|" * len(CATEGORIES)]
    for r in rows:
        for side in ("jax", "torch"):
            for dtype, errs in r[side].items():
                lines.append(f"| {r['model']}, {r['image_size']}x{r['image_size']}, {r['optimizer']} | {r['where']} | "
                             f"{side} | {dtype} | " + " | ".join(f"{errs[c]:.1e}" if c in errs else "-"
                                                                   for c in CATEGORIES) + " |")
    return "\n".join(lines)


