"""``jaxdp bench --preset gpu``: ResNet-18 CIFAR throughput on every visible GPU.

ResNet-18 width 64, bf16 compute with fp32 master weights (``--dtype bfloat16``: the params,
the optimizer and BN statistics stay f32), SGD momentum, per-device batches of 256 and 512,
every strategy at N = 1 and N = all visible GPUs, each row against torch_ref (eager) beside
it, plus the bare steps. Reported per row: images/s, MFU (``runner.PEAK_TFLOPS``, 3.33 GFLOP
per trained image) and the scaling efficiency ``img/s(N) / (N x img/s(1))`` at the same
per-device batch. Target: >= 100k img/s on one H100 (its bf16 ceiling is about 297k).

torch_ref under ``torch.compile`` is not run yet (torch_ref's step has no compile switch):
the dry run lists it as a row to add. Without a GPU the preset refuses in one line;
``--dry-run`` prints the rows it would run, anywhere.

Torch- and jax-free at import.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import List, Sequence

PRESET = dict(model="resnet18", width=64, blocks=None, dtype="bfloat16", optimizer="sgd", steps=20, warmup=5)
BATCHES_PER_DEVICE = (256, 512)
ASSUMED_GPUS = 8  # what a dry run on a host without GPUs plans for


def visible_gpus() -> int:
    """GPUs ``nvidia-smi -L`` lists (within ``CUDA_VISIBLE_DEVICES`` when set), without starting jax."""
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    count = sum(line.startswith("GPU ") for line in listed.splitlines())
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return min(count, len([d for d in visible.split(",") if d.strip()])) if visible is not None else count


def device_counts(gpus: int, asked: Sequence[int] = ()) -> List[int]:
    """N = 1 (the scaling baseline) and N = every GPU, unless ``--devices`` names others."""
    return sorted(set(asked)) if asked else sorted({1, gpus})


def planned_rows(ns: Sequence[int], strategies: Sequence[str]) -> List[dict]:
    """Every (per-device batch, N, strategy) the preset runs, and what it runs each against."""
    return [{"batch_per_device": b, "n": n, "global_batch": b * n, "strategy": name,
             "against": ["torch_ref", "torch_ref + torch.compile (not yet: torch_ref has no compile switch)",
                         "bare jax", "bare torch"]}
            for b in BATCHES_PER_DEVICE for n in ns for name in strategies]


def dry_run_text(rows: List[dict], gpus: int) -> str:
    head = (f"jaxdp bench --preset gpu: {PRESET['model']} width {PRESET['width']}, {PRESET['dtype']} compute with "
            f"fp32 master weights, {PRESET['optimizer']}, {PRESET['steps']} steps after {PRESET['warmup']}; "
            + (f"{gpus} GPU(s) visible" if gpus else f"no GPU visible: planned for {ASSUMED_GPUS}"))
    lines = [head, f"{len(rows)} rows:"]
    lines += [f"  batch/device {r['batch_per_device']:>4}  N {r['n']:>2}  global batch {r['global_batch']:>5}  "
              f"{r['strategy']:<6} vs {', '.join(r['against'])}" for r in rows]
    return "\n".join(lines)


def scaling_efficiency(rows: List[dict]) -> None:
    """Each row's ``scaling_jaxdp`` (and torch_ref's): img/s at N over N x img/s at N = 1, same strategy
    and per-device batch."""
    for fw in ("jaxdp", "torch_ref"):
        base = {(r["strategy"], r["global_batch"] // r["n"]): (r.get(fw) or {}).get("images_per_s")
                for r in rows if r["n"] == 1}
        for r in rows:
            one, here = base.get((r["strategy"], r["global_batch"] // r["n"])), (r.get(fw) or {}).get("images_per_s")
            if one and here:
                r[f"scaling_{fw}"] = here / (r["n"] * one)


def run_preset(args, strategies: Sequence[str], write) -> int:
    """The preset's rows (``--dry-run``: printed, not run); ``write(result)`` saves the merged result."""
    from parity_tests.bench.jax_side import prepare_jax
    from parity_tests.bench.runner import BenchError, run_bench

    gpus = visible_gpus()
    ns = device_counts(gpus or ASSUMED_GPUS, args.n or ())
    if args.dry_run:
        print(dry_run_text(planned_rows(ns, strategies), gpus))
        return 0
    if not gpus:
        raise BenchError("--preset gpu needs CUDA GPUs and nvidia-smi lists none; --dry-run prints the rows it runs")
    prepare_jax(max(ns))
    runs = [run_bench(dict(PRESET, global_batch=b * n, n=(n,), bare=args.bare), strategies, with_torch=args.torch,
                      timeout_s=args.timeout, pipeline_images=args.pipeline_images)
            for b in BATCHES_PER_DEVICE for n in ns]
    result = {**runs[0], "rows": [r for run in runs for r in run["rows"]], "bare": {},
              "runs": [{"config": run["config"], "bare": run["bare"]} for run in runs]}
    scaling_efficiency(result["rows"])
    write(result)
    return 0
