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
parity run can differ by at most about ``e_jax + e_torch``: the budget's bound is ``MARGIN``
times that sum (``parity_tests.budgets``, where the measured rows are kept). On a GPU it runs in parity mode (``parity_mode``),
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

from parity_tests.budgets import CATEGORIES, MARGIN, bounds_from_budget, side_errors
from parity_tests.inputs import cast

LOW_DTYPES = ("float32", "bfloat16")


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
