"""The broad check of a pair of your own: every strategy with a torch twin, N = 1, 2, 3, in float64,
float32 and bfloat16 (the latter two within the run's own measured budget), one report each and a
table over all of them. The suite runs a representative few (parity_tests/test_own_pairs.py).

    python -m parity_tests.own.matrix --out runs/own-matrix              # both pairs below, ~45 min on 2 cores
    python -m parity_tests.own.matrix --pairs examples.parity_own_model:make_pair --dtypes float64

Writes ``matrix.json`` and ``matrix.md`` (and each run's report.json and parity.png in its own
folder) to ``--out``; exit status 1 if any run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

PAIRS = ("examples.parity_own_model:make_pair", "parity_tests.own.toy_pairs:batchnorm_pair")
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "hsdp", "dp", "async")
DTYPES = ("float64", "float32", "bfloat16")


def row(result) -> dict:
    c = result.plan.cfg
    entries = [e for s in result.comparison.steps for e in s.entries]
    bounded = [e for e in entries if e.bound > 0]
    worst = max(entries, key=lambda e: e.rel_err, default=None)
    tightest = max(bounded, key=lambda e: e.rel_err / e.bound, default=None)
    return {"pair": c.pair, "strategy": c.strategy, "devices": c.devices, "dtype": c.dtype, "steps": c.steps,
            "torch": f"{result.plan.torch_strategy} x{result.plan.world}", "passed": result.passed,
            "max_rel": worst.rel_err if worst else 0.0, "worst": worst.key if worst else None,
            "max_ratio": tightest.rel_err / tightest.bound if tightest else 0.0,
            "tightest": tightest.key if tightest else None, "seconds": round(sum(result.seconds.values()), 1),
            "message": result.message()}


def _print(result) -> None:
    r = row(result)
    print(f"{r['pair']} {r['strategy']} N={r['devices']} {r['dtype']}: {'PASS' if r['passed'] else 'FAIL'} max rel "
          f"{r['max_rel']:.1e}, max rel/bound {r['max_ratio']:.2f} ({r['seconds']:.0f}s)", flush=True)


def markdown(rows) -> str:
    lines = ["| pair | strategy | N | dtype | torch twin | verdict | max rel err | max (rel err / bound) | seconds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['pair'].split(':')[-1]} | {r['strategy']} | {r['devices']} | {r['dtype']} | {r['torch']} | "
                     f"{'PASS' if r['passed'] else 'FAIL'} | {r['max_rel']:.1e} | {r['max_ratio']:.2f} | "
                     f"{r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m parity_tests.own.matrix", description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", default=",".join(PAIRS), help="module:function, comma-separated")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--devices", default="1,2,3")
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-per-device", type=int, default=8)
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--out", default="runs/own-matrix")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    devices = [int(n) for n in args.devices.split(",")]

    from jaxdp.runtime.startup import simulate_cpu_devices

    simulate_cpu_devices(max(devices))  # before jax starts
    from parity_tests.own import check_pair

    rows, t_all = [], time.perf_counter()
    for pair in args.pairs.split(","):
        done = check_pair(pair, args.strategies.split(","), devices, args.dtypes.split(","),
                          out=os.path.join(args.out, pair.split(":")[-1]), log=_print, steps=args.steps,
                          batch_per_device=args.batch_per_device, optimizer=args.optimizer, lr=args.lr,
                          momentum=0.9, nesterov=args.optimizer == "sgd")
        rows += [row(r) for r in done.results]
    total = time.perf_counter() - t_all
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "matrix.json"), "w") as f:
        json.dump({"rows": rows, "seconds": total, "argv": sys.argv[1:]}, f, indent=1)
    with open(os.path.join(args.out, "matrix.md"), "w") as f:
        f.write(markdown(rows) + f"\n{len(rows)} runs, {sum(r['passed'] for r in rows)} passed, {total / 60:.1f} min\n")
    print(f"{len(rows)} runs, {sum(r['passed'] for r in rows)} passed in {total / 60:.1f} min; wrote {args.out}/matrix.md")
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":  # the guard matters: the torch ranks re-import the main module
    sys.exit(main())
