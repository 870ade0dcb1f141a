"""Every strategy's real step compiled for GPUs that are not there, side by side: overlap, memory,
traffic by link, an estimated step time, and how long each compile took.

    .venv/bin/python benchmarks/gpu_targets.py                          # 8 H100s, ResNet-18 w64 bf16
    .venv/bin/python benchmarks/gpu_targets.py --hosts 4 --strategies ddp,zero3,hsdp
    .venv/bin/python benchmarks/gpu_targets.py --target h200 --devices 1 --strategies ddp --batch-per-device 512

Needs the compile-only GPU target (``make install-gpu-target``); no GPU. About 15-40 s per strategy on
2 cores (more with 16 hosts). Prints a markdown table and writes it, with the raw reports, to
``--out`` (``gpu_targets.md``, ``gpu_targets.json``). The step times are ESTIMATES (a roofline from the
target's published peaks: ``jaxdp.analysis.estimate``), not measurements; the one measurement there is
(H200, ddp, batch 512) is printed beside its estimate when the configuration matches.
"""

import argparse
import json
import os
import time

from jaxdp.analysis.measured import against_measurement
from jaxdp.analysis.measure import inspect_strategy
from jaxdp.runtime.target import Target

MIB = 2**20


def measure(strategy: str, target: Target, args) -> dict:
    mesh_shape = (args.hsdp_replicas, target.devices // args.hsdp_replicas) \
        if strategy == "hsdp" and args.hsdp_replicas else None
    start = time.perf_counter()
    report = inspect_strategy(strategy, target.devices, model=args.model, width=args.width, dtype=args.dtype,
                              batch_per_device=args.batch_per_device, target=target, mesh_shape=mesh_shape,
                              options={"bucket_cap_mb": args.bucket_cap_mb} if strategy == "ddp" else {})
    report["compile_s"] = time.perf_counter() - start
    return report


def row(report: dict) -> dict:
    cs = report["collectives"]
    asynchronous = [c for c in cs if c["async"]]
    sent = {across: sum(c["runs"] * c["ring_bytes"] for c in cs if c["across_hosts"] == across) / MIB
            for across in (False, True)}
    measured = against_measurement(report)
    return {"strategy": report["strategy"], "collectives": len(cs), "async": len(asynchronous),
            "with_compute": sum(c["compute_between"] > 0 for c in asynchronous),
            "with_matmul": sum(c["matmul_between"] > 0 for c in asynchronous),
            "argument_mib": report["memory"]["argument_bytes"] / MIB, "temp_mib": report["memory"]["temp_bytes"] / MIB,
            "nvlink_mib": sent[False], "network_mib": sent[True], "estimated_ms": report["estimated_step_s"] * 1e3,
            "over_measured": measured and measured["estimate_over_measured"], "compile_s": report["compile_s"]}


def markdown(rows, target: Target, args) -> str:
    head = (f"{target.describe()}, {args.model} width {args.width}, {args.dtype}, {args.batch_per_device} per "
            f"device; estimated step times, not measurements")
    lines = [head, "", "| strategy | collectives | async | + compute | + matmul | argument MiB | temp MiB | "
             "NVLink MiB | network MiB | est. step ms | compile s |", "|" + "---|" * 11]
    for r in rows:
        ratio = f" ({r['over_measured']:.2f}x measured)" if r["over_measured"] else ""
        lines.append(f"| {r['strategy']} | {r['collectives']} | {r['async']} | {r['with_compute']} | "
                     f"{r['with_matmul']} | {r['argument_mib']:.1f} | {r['temp_mib']:.1f} | {r['nvlink_mib']:.1f} | "
                     f"{r['network_mib']:.1f} | {r['estimated_ms']:.2f}{ratio} | {r['compile_s']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="h100")
    p.add_argument("--devices", type=int, default=8, help="GPUs per host")
    p.add_argument("--hosts", type=int, default=1)
    p.add_argument("--strategies", default="ddp,zero1,zero2,zero3,hsdp")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-per-device", type=int, default=64)
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="ddp's bucket cap (torch's default: 25)")
    p.add_argument("--hsdp-replicas", type=int, default=None, help="hsdp's replica count (default: one per host)")
    p.add_argument("--out", default="runs/gpu-targets")
    args = p.parse_args()
    target = Target.parse(args.target, args.devices, args.hosts)
    reports = []
    for name in args.strategies.split(","):
        reports.append(measure(name, target, args))
        print(f"{name}: compiled in {reports[-1]['compile_s']:.0f} s", flush=True)
    table = markdown([row(r) for r in reports], target, args)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_targets.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out, "gpu_targets.json"), "w") as f:
        json.dump(reports, f)


if __name__ == "__main__":
    main()
