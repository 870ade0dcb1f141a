"""The estimated step time beside every GPU step rate the project has measured.

    .venv/bin/python benchmarks/estimate_vs_measured.py [--out benchmarks/results]

For each row of ``jaxdp/analysis/gpu_measurements.json`` (one H200, issue 26) it compiles jaxdp's
step in the measured configuration for the compile-only target (``jaxdp inspect --target``; no GPU,
about 1 min a row on 2 cores) and prints the estimate (``jaxdp.analysis.estimate``: each kernel's
roofline, the collectives hidden only by the kernels in their own window) over the measurement.
Writes the table and the rows to ``--out`` (``estimate_vs_measured.md``, ``.json``).
"""

import argparse
import json
import os
import time

from jaxdp.analysis.measure import inspect_strategy
from jaxdp.analysis.measured import measurements
from jaxdp.runtime.target import Target


def estimated(m: dict) -> dict:
    """The estimate of measured row ``m``, compiled in its configuration."""
    start = time.perf_counter()
    r = inspect_strategy(m["strategy"], m["devices"], model=m["model"], width=m["width"], dtype=m["dtype"],
                         batch_per_device=m["batch_per_device"], target=Target.parse(m["target"], m["devices"]))
    return {**m, "compile_s": time.perf_counter() - start,
            **{k: r[k] for k in ("estimated_step_s", "kernels_s", "compute_s", "memory_s", "communication_s",
                                 "exposed_communication_s", "flops", "bytes_accessed")},
            "estimate_over_measured": r["estimated_step_s"] / m["step_s"]}


def markdown(rows) -> str:
    lines = ["| GPU | strategy | devices | batch per device | measured ms (img/s) | estimated ms | kernels ms | "
             "exposed comm. ms | estimate / measured |", "|" + "---|" * 9]
    for r in rows:
        lines.append(f"| {r['target'].upper()} | {r['strategy']} | {r['devices']} | {r['batch_per_device']} | "
                     f"{r['step_s'] * 1e3:.2f} ({r['images_per_s'] / 1e3:.1f}k) | {r['estimated_step_s'] * 1e3:.2f} | "
                     f"{r['kernels_s'] * 1e3:.2f} | {r['exposed_communication_s'] * 1e3:.3f} | "
                     f"{r['estimate_over_measured']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    rows = []
    for m in measurements():
        rows.append(estimated(m))
        print(f"{m['strategy']} batch {m['batch_per_device']}: compiled in {rows[-1]['compile_s']:.0f} s", flush=True)
    table = markdown(rows)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "estimate_vs_measured.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out, "estimate_vs_measured.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
