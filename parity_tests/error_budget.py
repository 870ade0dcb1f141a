"""How far each framework's float32 and bf16 runs are from its own float64 run: the error
budget that the cross-framework bounds are derived from (``bounds_from_budget``).

    python -m parity_tests.error_budget --width 64 --blocks 2,2,2,2 --image-size 32 \\
        --batch-per-device 64 --steps 1 --dtypes float32,bfloat16 --out runs/error-budget

One parity configuration at N = 1 (``ddp``; the parity CLI's options), run on EACH side from
the same weights and the same batches, once in float64 (the reference) and once per low
dtype (inputs and weights rounded to float32; bfloat16 is bf16 compute on float32 master
weights, as in ``jaxdp parity --dtype bfloat16``). Per side, dtype, step and category
(loss, grads, params, buffers, optimizer_state) it reports the largest relative error
``max|x - x64| / max|x64|`` (``compare.errors``, per tensor) against that side's own float64
run. The two float64 runs agree to ~1e-13, so by the triangle inequality the two sides of a
parity run can differ by at most about ``e_jax + e_torch``: the derived bound is ``MARGIN``
times that sum (``bounds_from_budget``). On a GPU it runs in parity mode (``parity_mode``),
as ``jaxdp parity`` does.

Writes ``budget.json`` and ``budget.md`` to ``--out``. Jax- and torch-free at import.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np

CATEGORIES = ("loss", "grads", "params", "buffers", "optimizer_state")
LOW_DTYPES = ("float32", "bfloat16")
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

# The budget, measured with this module (step 0; each side's largest relative error against its
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
]


def cast(tree, dtype):
    """Floating arrays of ``{name: array}`` (or batches) to ``dtype``; integers stay."""
    if isinstance(tree, dict):
        return {k: cast(v, dtype) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(cast(v, dtype) for v in tree)
    a = np.asarray(tree)
    return a.astype(dtype) if np.issubdtype(a.dtype, np.floating) else a


def side_errors(records: Sequence[Mapping], reference: Sequence[Mapping]) -> List[Dict[str, float]]:
    """Per step, per category: the largest relative error of ``records`` against ``reference``."""
    from parity_tests.compare import errors, flatten

    out = []
    for rec, ref in zip(records, reference):
        a, b = flatten(rec), flatten(ref)
        worst: Dict[str, float] = {}
        for key, want in b.items():
            cat = key.split("/", 1)[0]
            if cat in CATEGORIES and key in a:
                worst[cat] = max(worst.get(cat, 0.0), errors(a[key], want)[1])
        out.append(worst)
    return out


def run_side(side: str, cfg, state_dict, batches) -> List[dict]:
    """``cfg``'s steps on one side (``jax`` or ``torch``) from these weights and batches."""
    from parity_tests.jax_side import configure_precision, run_jax
    from parity_tests.plan import plan
    from parity_tests.torch_side import run_torch

    p = plan(cfg)
    if side == "jax":
        configure_precision(p.cuda)
        return run_jax(p, state_dict, batches)
    return run_torch(p, state_dict, batches)


def measure(cfg, dtypes: Sequence[str] = LOW_DTYPES, log=print) -> dict:
    """The budget of ``cfg`` (its dtype ignored; N = 1): per side and dtype, per step and category,
    the relative error against that side's float64 run of the same weights and batches."""
    from parity_tests.inputs import init_state_dict, make_batches

    ref_cfg = dataclasses.replace(cfg, dtype="float64", devices=1, strategy="ddp")
    sd64, batches64 = init_state_dict(ref_cfg), make_batches(ref_cfg)
    result: Dict = {"config": ref_cfg.to_json(), "model": ref_cfg.model_summary(), "margin": MARGIN,
                    "sides": {}, "seconds": {}}
    for side in ("jax", "torch"):
        t0 = time.perf_counter()
        reference = run_side(side, ref_cfg, sd64, batches64)
        result["seconds"][f"{side}/float64"] = time.perf_counter() - t0
        result["sides"][side] = {}
        for dtype in dtypes:
            t0 = time.perf_counter()
            low = dataclasses.replace(ref_cfg, dtype=dtype)
            records = run_side(side, low, cast(sd64, np.float32), cast(batches64, np.float32))
            result["seconds"][f"{side}/{dtype}"] = time.perf_counter() - t0
            result["sides"][side][dtype] = side_errors(records, reference)
            log(f"{side} {dtype} vs {side} float64, step 0: " +
                ", ".join(f"{c} {e:.1e}" for c, e in result["sides"][side][dtype][0].items()))
    result["derived_bounds"] = {d: bounds_from_budget(result, d) for d in dtypes}
    return result


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


def markdown(budget: Mapping) -> str:
    lines = [f"# Error budget: {budget['model']}, {budget['config']['image_size']}x{budget['config']['image_size']}, "
             f"batch {budget['config']['batch_per_device']}, {budget['config']['optimizer']}", "",
             f"Relative error against the same side's float64 run (max over tensors); environment: "
             f"{budget.get('environment', {})}", "",
             "| side | dtype | step | " + " | ".join(CATEGORIES) + " |", "|---|---|---|" + "---|" * len(CATEGORIES)]
    for side, by_dtype in budget["sides"].items():
        for dtype, steps in by_dtype.items():
            for i, errs in enumerate(steps):
                lines.append(f"| {side} | {dtype} | {i} | " +
                             " | ".join(f"{errs[c]:.1e}" if c in errs else "-" for c in CATEGORIES) + " |")
    lines += ["", f"Derived cross-framework bounds at step 0 ({budget['margin']:g} x (jax + torch)):", ""]
    for dtype, b in budget["derived_bounds"].items():
        lines.append(f"- {dtype}: " + ", ".join(f"{c} {v:.1e}" for c, v in b.items()))
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The parity CLI's options (the run's model, data and optimizer) plus ``--dtypes``."""
    from parity_tests.command import add_parity_args

    parser = argparse.ArgumentParser(prog="python -m parity_tests.error_budget", description=__doc__.splitlines()[0])
    add_parity_args(parser)
    parser.add_argument("--dtypes", default=",".join(LOW_DTYPES),
                        help="low dtypes measured against float64 (default %(default)s); --dtype is not used")
    parser.set_defaults(out="runs/error-budget", devices=1)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    from parity_tests import parity_mode
    from parity_tests.command import config_from_args

    args = build_parser().parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in LOW_DTYPES for d in dtypes):
        print(f"error_budget: error: --dtypes must be a comma list of {', '.join(LOW_DTYPES)}", file=sys.stderr)
        return 2
    parity_mode.enable()  # before jax starts: comparable cuDNN engines on a GPU, as in jaxdp parity
    from parity_tests.report import environment

    budget = measure(config_from_args(args), dtypes)
    budget["environment"] = {k: v for k, v in environment().items() if k in ("jax", "jax_backend", "torch", "machine")}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "budget.json"), "w") as f:
        json.dump(budget, f, indent=1)
    md = markdown(budget)
    with open(os.path.join(args.out, "budget.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":  # the guard matters: torch_ref's ranks re-import the main module
    sys.exit(main())
