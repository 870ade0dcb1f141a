"""Eight GPUs' programs on one GPU: each strategy's step compiled for N devices and read.

    python -m jaxdp.analysis.mock_topology --devices 8 --out runs/mock8        # on one GPU
    python -m jaxdp.analysis.mock_topology --devices 8 --cpu --width 4 ...     # the same on simulated CPUs

On a GPU, JAX can mock a multi-GPU topology (``jax_mock_gpu_topology="1x8x1"``, set before its
backend starts): XLA's mock NCCL performs no collective, and this process runs every program as
device 0 of 8. So one GPU compiles and runs the real 8-GPU step. Per strategy it reports:

- **overlap**: the asynchronous collectives of the compiled program's schedule
  (``schedule.async_overlap``: ``-start``/``-done`` pairs) and how many have compute (a
  convolution or matmul) scheduled between their halves, i.e. hidden behind it. XLA:CPU
  emits only synchronous collectives: on CPU the count is 0 by construction;
- **memory**: the compiled step's bytes per device (``memory_analysis``: arguments, temp, and
  ``total`` = argument + output - alias + temp, as ``jaxdp plan`` and ``jaxdp bench`` count)
  beside the ZeRO formula for the model state (``state.strategy_formulas``, padded);
- **time**: the per-device step time at N (without communication, under the mock) beside
  the same per-device batch at N = 1 (``ddp`` on one device).

If the installed jax cannot start the mock (a trivial ``psum`` over the N devices fails), the
report says so in one line (``unsupported``) and nothing else runs. Writes ``mock.json`` and
``mock.md`` to ``--out``. The mock, the platform and the simulated device count are set before
jax creates its backend (``configure``), which importing jax does not do.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import List, Optional, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxdp.analysis.hlo import compiled_memory
from jaxdp.analysis.measure import build_strategy, random_batch
from jaxdp.analysis.plan import compile_from_shapes, with_total
from jaxdp.analysis.schedule import COMPUTE, async_overlap, entry_ops, overlapped
from jaxdp.analysis.state import model_state_bytes, strategy_formulas
from jaxdp.config.flags import comma_ints
from jaxdp.models import create_model
from jaxdp.runtime.mesh import make_mesh, simulate_cpu_devices

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


def configure(devices: int, cpu: bool) -> None:
    """Before jax starts its backend: ``devices`` simulated CPU devices, or the mock GPU topology."""
    if cpu:
        jax.config.update("jax_platforms", "cpu")  # not $JAX_PLATFORMS: jax read that when it was imported
        simulate_cpu_devices(devices)
        return
    jax.config.update("jax_mock_gpu_topology", f"1x{devices}x1")  # devices hosts of one GPU each


def probe(devices: int) -> Optional[str]:
    """None when a ``psum`` over ``devices`` devices compiles and runs; else why not, in one line."""
    try:
        mesh = make_mesh(devices)
        x = jax.make_array_from_callback((devices,), NamedSharding(mesh, P("data")),
                                         lambda index: np.ones((1,), np.float32))
        total = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "data"), mesh=mesh, in_specs=P("data"),
                                      out_specs=P()))(x)
        jax.block_until_ready(total)
        return None
    except Exception as e:  # the mock, or the backend, is not there
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"


def step_time(strategy, compiled, net, batch_per_device: int, image_size: int, steps: int) -> float:
    """The median seconds of ``steps`` runs of the ``compiled`` step (after one), fed a fresh state
    and this process's rows of a batch."""
    local = jax.local_device_count() if jax.process_count() > 1 else strategy.num_devices
    host = random_batch(net, batch_per_device * local, image_size)
    state = strategy.engine.init(jax.random.key(0), host)
    batch = strategy.engine.shard_batch(host)
    times = []
    for _ in range(steps + 1):
        t = time.perf_counter()
        state, out = compiled(state, batch)
        jax.block_until_ready((state, out))
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def analyse(name: str, n: int, net, *, batch_per_device: int, image_size: int, steps: int = 5) -> dict:
    """One strategy's step at N devices, compiled once: overlap, memory against the formula, step time."""
    strategy = build_strategy(name, make_mesh(n), net, "sgd")
    compiled = compile_from_shapes(strategy, batch_per_device, image_size)
    state = strategy_formulas(strategy)
    ops = entry_ops(compiled.as_text())
    pairs = async_overlap(ops)
    row = {"strategy": name, "n": n, "backend": jax.default_backend(), "psi": state["psi"],
           "memory": with_total(compiled_memory(compiled)),
           "formula_state_bytes": model_state_bytes(state["formula_padded"]),
           "collectives": sorted({o.kind for o in ops if o.kind not in COMPUTE}),
           "async_pairs": len(pairs), "overlapped_pairs": len(overlapped(pairs)),
           "overlap_by_kind": {kind: [sum(1 for p in pairs if p.kind == kind),
                                      sum(1 for p in overlapped(pairs) if p.kind == kind)]
                               for kind in sorted({p.kind for p in pairs})}}
    try:
        row["step_s"] = step_time(strategy, compiled, net, batch_per_device, image_size, steps)
    except Exception as e:  # memory and schedule still stand: say why there is no time
        row["step_error"] = f"{type(e).__name__}: {str(e).strip()[:300]}"
    return row


def run(devices: int, strategies: Sequence[str], *, width: int, blocks, batch_per_device: int, image_size: int,
        dtype: str, steps: int, log=print) -> dict:
    report = {"devices": devices, "batch_per_device": batch_per_device, "image_size": image_size,
              "model": f"resnet18 width {width}", "dtype": dtype, "rows": []}
    why = probe(devices)
    if why is not None:
        report["unsupported"] = f"no {devices}-device program runs here ({why})"
        log(report["unsupported"])
        return report
    report.update(backend=jax.default_backend(), jax=jax.__version__, device_kind=jax.devices()[0].device_kind,
                  process_count=jax.process_count())
    net = create_model("resnet18", width=width, blocks=blocks, dtype=dtype)
    for name in strategies:
        t0 = time.perf_counter()
        try:
            row = analyse(name, devices, net, batch_per_device=batch_per_device, image_size=image_size, steps=steps)
        except Exception as e:
            row = {"strategy": name, "n": devices, "error": f"{type(e).__name__}: {str(e).strip()[:500]}"}
        row["seconds"] = time.perf_counter() - t0
        report["rows"].append(row)
        log(row_line(row))
    try:
        one = analyse("ddp", 1, net, batch_per_device=batch_per_device, image_size=image_size, steps=steps)
        report["n1_step_s"] = one.get("step_s")
    except Exception as e:
        report["n1_error"] = f"{type(e).__name__}: {str(e).strip()[:300]}"
    return report


def _mib(x) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def row_line(r: dict) -> str:
    if "error" in r:
        return f"{r['strategy']}: ERROR {r['error']}"
    m = r["memory"]
    return (f"{r['strategy']}: {r['async_pairs']} async collectives, {r['overlapped_pairs']} overlapped; "
            f"argument {_mib(m['argument_bytes'])} MiB (state formula {_mib(r['formula_state_bytes'])}), total "
            f"{_mib(m['total_bytes'])} MiB; step {r.get('step_s', float('nan')):.4f} s")


def markdown(report: dict) -> str:
    head = (f"Mock {report['devices']}-GPU topology: {report['model']}, {report['dtype']}, "
            f"{report['batch_per_device']} images/device at {report['image_size']}x{report['image_size']}")
    if "unsupported" in report:
        return f"{head}: UNSUPPORTED here: {report['unsupported']}"
    lines = [head + f" ({report['backend']}, {report['device_kind']}, jax {report['jax']})", "",
             "| strategy | async collectives | overlapped with compute | state formula MiB | argument MiB | "
             "total MiB | step s (no comm.) | N=1 step s |", "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"| {r['strategy']} | ERROR: {r['error'][:200]} |||||||")
            continue
        m = r["memory"]
        lines.append(f"| {r['strategy']} | {r['async_pairs']} | {r['overlapped_pairs']} | "
                     f"{_mib(r['formula_state_bytes'])} | {_mib(m['argument_bytes'])} | {_mib(m['total_bytes'])} | "
                     f"{r.get('step_s', float('nan')):.4f} | {report.get('n1_step_s') or float('nan'):.4f} |")
    if report.get("backend") == "cpu":
        lines.append("\nXLA:CPU runs every collective synchronously: no overlap can show on a CPU.")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxdp.analysis.mock_topology", description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--cpu", action="store_true", help="simulated CPU devices instead of the mock GPU topology")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--blocks", type=comma_ints, default=None)
    p.add_argument("--batch-per-device", type=int, default=64)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default="runs/mock-topology")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    configure(args.devices, args.cpu)
    report = run(args.devices, [s for s in args.strategies.split(",") if s], width=args.width, blocks=args.blocks,
                 batch_per_device=args.batch_per_device, image_size=args.image_size, dtype=args.dtype,
                 steps=args.steps)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "mock.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    md = markdown(report)
    with open(os.path.join(args.out, "mock.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    failed = any("error" in r for r in report["rows"]) or "n1_error" in report
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
