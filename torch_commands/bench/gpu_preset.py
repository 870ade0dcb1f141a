"""``jaxdp bench --preset gpu``: ResNet-18 CIFAR throughput on every visible GPU.

ResNet-18 width 64, bf16 compute with fp32 master weights (``--dtype bfloat16``: the params,
the optimizer and BN statistics stay f32), SGD momentum, per-device batches of 256 and 512,
every strategy at N = 1 and N = all visible GPUs, each row against torch_ref beside it,
eager (tuned: channels_last, cudnn.benchmark) and under ``torch.compile`` (inductor), plus
the bare steps. Reported per row: images/s, MFU (``jaxdp.run.flops`` over ``jaxdp.run.perf``'s
peaks), jaxdp over the faster torch, and the scaling efficiency ``img/s(N) / (N x img/s(1))``
at the same per-device batch. Target: >= 100k img/s on one H100 (its bf16 ceiling is about
297k).

``--preset gpu --quick`` (``make gpu-bench``) is sized for scarce GPU time, <= 5 minutes on
one H100, a deadline the run enforces (``QUICK_DEADLINE_S``, ``--deadline``): one GPU, batch
512, ddp only, no bare rows. It reports jaxdp's step rate, ``jaxdp train``'s end-to-end rate (a
run with train's own defaults for the data path, before the bench starts jax in this process,
so it has the GPU to itself), torch eager (tuned) and torch.compile, MFU from the bench and
from train's records (the same ``jaxdp.run.flops.mfu``), and the host input pipeline's images/s.

Honest and bounded: every component that errors (train, the jaxdp step, torch eager,
torch.compile, whose preflight names a missing C compiler, Python headers or Triton) is shown
with its error and makes the exit status 1; one the deadline leaves no time to start is NOT
RUN, exit 3 (``report.problems``). JAX's preallocation is turned off here, before JAX starts
(torch's ranks share the GPU), not only by the Makefile.

Without a GPU the preset refuses in one line; ``--dry-run`` prints what it would run,
anywhere. The GPU count is ``nvidia-smi``'s, else torch's.

Torch- and jax-free at import.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from typing import List, Optional, Sequence

from torch_commands.deadline import Deadline

PRESET = dict(model="resnet18", width=64, blocks=None, dtype="bfloat16", optimizer="sgd", steps=20, warmup=5,
              torch_compile="inductor")
QUICK_BATCH = 512
QUICK_STRATEGY = "ddp"
TRAIN_STEPS = 60  # jaxdp train's end-to-end run: the rate is the median of its records after TRAIN_SKIP
TRAIN_SKIP = 10
TRAIN_TIMEOUT_S = 240
QUICK_DEADLINE_S = 300.0  # make gpu-bench: <= 5 minutes on one H100
BATCHES_PER_DEVICE = (256, 512)
ASSUMED_GPUS = 8  # what a dry run on a host without GPUs plans for


def visible_gpus() -> int:
    """GPUs ``nvidia-smi -L`` lists (within ``CUDA_VISIBLE_DEVICES`` when set), else the CUDA GPUs
    torch counts (an image without nvidia-smi); never by starting jax."""
    listed = _nvidia_smi_list()
    if listed is None:
        from torch_ref.dist import cuda_device_count  # torch: only without nvidia-smi

        return cuda_device_count()
    count = sum(line.startswith("GPU ") for line in listed.splitlines())
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return min(count, len([d for d in visible.split(",") if d.strip()])) if visible is not None else count


def _nvidia_smi_list() -> Optional[str]:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None


def jax_off_preallocation() -> None:
    """JAX takes memory as it needs it, leaving the rest to torch's ranks on the same GPUs; only
    effective before jax starts its backend (a value the user set is kept)."""
    from jaxdp.runtime.startup import backend_started

    if not backend_started():
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def device_counts(gpus: int, asked: Sequence[int] = ()) -> List[int]:
    """N = 1 (the scaling baseline) and N = every GPU, unless ``--devices`` names others."""
    return sorted(set(asked)) if asked else sorted({1, gpus})


def planned_rows(ns: Sequence[int], strategies: Sequence[str]) -> List[dict]:
    """Every (per-device batch, N, strategy) the preset runs, and what it runs each against."""
    return [{"batch_per_device": b, "n": n, "global_batch": b * n, "strategy": name,
             "against": ["torch_ref (tuned eager)", "torch_ref + torch.compile (inductor)",
                         "bare jax", "bare torch (eager, compiled)"]}
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


def preset_config(args, **over) -> dict:
    """The preset's bench config with the command line's say on bare rows, levers and torch.compile."""
    return {**PRESET, "bare": args.bare, "levers": args.levers,
            "torch_compile": args.torch_compile or PRESET["torch_compile"], **over}


def train_argv(out: str) -> List[str]:
    """``jaxdp train``'s end-to-end run for --quick: the bench's model, batch and dtype on one
    GPU, with train's own defaults for everything else (the data path among them)."""
    return ["train", "--strategy", QUICK_STRATEGY, "--model", PRESET["model"], "--width", str(PRESET["width"]),
            "--dtype", PRESET["dtype"], "--devices", "1", "--global-batch-size", str(QUICK_BATCH),
            "--synthetic-size", f"{QUICK_BATCH * TRAIN_STEPS},{QUICK_BATCH}", "--max-steps", str(TRAIN_STEPS),
            "--no-progress", "--no-tensorboard", "--out", out, "--overwrite"]


def quick_plan_text(gpus: int, out: str, strategies: Sequence[str], deadline_s: Optional[float] = None,
                    mock_gpus: Optional[int] = None) -> str:
    b = QUICK_BATCH
    deadline_s = QUICK_DEADLINE_S if deadline_s is None else deadline_s
    return "\n".join([
        f"jaxdp bench --preset gpu --quick: {PRESET['model']} width {PRESET['width']}, {PRESET['dtype']} compute with "
        f"fp32 master weights, one GPU, batch {b}; "
        + (f"{gpus} GPU(s) visible" if gpus else "no GPU visible: it would refuse"),
        f"  1. jaxdp train end to end: jaxdp {' '.join(train_argv(os.path.join(out, 'train')))}",
        f"     ({TRAIN_STEPS} steps; images/s = median of the records after step {TRAIN_SKIP}; their MFU beside the bench's)",
        *[f"  2. bench row: batch/device {b:>4}  N  1  {name:<6} {PRESET['steps']} steps after {PRESET['warmup']}: "
          f"jaxdp vs torch_ref (tuned eager) and torch_ref + torch.compile ({PRESET['torch_compile']}); MFU"
          for name in strategies],
        "  3. host input pipeline: numpy epoch_batches with augmentation, images/s",
        *([f"  4. mock {mock_gpus}-GPU topology: python -m jaxdp.analysis.mock_topology --devices {mock_gpus} "
           "(each strategy's N-GPU step on this GPU: overlap, memory vs formula, step time vs N = 1)"]
          if mock_gpus else []),
        (f"  deadline {deadline_s:.0f} s: what it leaves no time to start is NOT RUN (exit 3); " if deadline_s else
         "  no deadline; ") + "an error in any part exits 1",
    ])


def _train_rate(out: str) -> dict:
    """Train's end-to-end images/s and MFU: the medians of its records after ``TRAIN_SKIP``."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [r for r in map(json.loads, f) if r.get("kind") == "train" and r["step"] > TRAIN_SKIP]
    rates = [r["images_per_sec"] for r in records if r.get("images_per_sec")]
    mfus = [r["mfu"] for r in records if r.get("mfu")]
    return {"images_per_s": statistics.median(rates) if rates else None,
            "mfu": statistics.median(mfus) if mfus else None, "records": len(records)}


def run_child(argv: List[str], command: str, timeout_s: float):
    """``python ARGV`` in a child process (its own jax, the GPU to itself, preallocation off):
    ({"command": command}, its CompletedProcess), or that record with its ``error`` and None on a timeout."""
    rec = {"command": command}
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    try:
        return rec, subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout_s,
                                   env=env)
    except subprocess.TimeoutExpired:
        return dict(rec, error=f"no result in {timeout_s:.0f} s"), None


def run_train(out: str, timeout_s: float = TRAIN_TIMEOUT_S) -> dict:
    """``jaxdp train`` in a child process; a failure is recorded as the record's ``error``."""
    rec, done = run_child(["-m", "jaxdp.cli", *train_argv(out)], " ".join(["jaxdp", *train_argv(out)]), timeout_s)
    if done is None:
        return rec
    if done.returncode:
        return dict(rec, error=f"exit {done.returncode}: {done.stderr.strip()[-1500:]}")
    return dict(rec, **_train_rate(out))


MOCK_TIMEOUT_S = 240


def run_mock_topology(devices: int, out: str, timeout_s: float) -> dict:
    """``python -m jaxdp.analysis.mock_topology`` in a child process (the mock is set before its jax
    starts): N GPUs' compiled steps on this one. A jax that cannot mock says so (``unsupported``:
    reported, not an error); a step that fails is an error."""
    argv = ["-m", "jaxdp.analysis.mock_topology", "--devices", str(devices), "--out", out]
    rec, done = run_child(argv, " ".join(["python", *argv]), timeout_s)
    if done is None:
        return rec
    try:
        with open(os.path.join(out, "mock.json")) as f:
            report = json.load(f)
    except (OSError, ValueError):
        return dict(rec, error=f"exit {done.returncode}, no report: {done.stderr.strip()[-800:]}")
    errors = [f"{r['strategy']}: {r['error']}" for r in report["rows"] if "error" in r]
    return dict(rec, report=report, **({"error": "; ".join(errors)[:800]} if errors else {}))


def quick_markdown(result: dict) -> str:
    """The quick preset's summary: the rates the GPU targets are judged on, in one table."""
    train = result.get("train")
    if train is None:
        return ""
    row = result["rows"][0] if result["rows"] else {}
    get = lambda fw, key: (row.get(fw) or {}).get(key)  # noqa: E731
    step = get("jaxdp", "images_per_s")
    pipe = (result.get("pipeline") or {}).get("images_per_s")
    fmt = lambda x, spec=",.0f": "-" if x is None else format(x, spec)  # noqa: E731
    e2e = train.get("images_per_s")
    lines = ["", f"Quick GPU bench ({result['environment']['device_kind']}), batch {QUICK_BATCH}, N = 1:", "",
             "| what | img/s | note |", "|---|---|---|",
             f"| jaxdp {row.get('strategy', '-')} step | {fmt(step)} | MFU {fmt(row.get('mfu_jaxdp'), '.1%')} |",
             f"| jaxdp train end to end | {fmt(e2e)} | {fmt(e2e / step if e2e and step else None, '.0%')} of the step; "
             f"MFU in its records {fmt(train.get('mfu'), '.1%')}{'; ' + train['error'][:200] if train.get('error') else ''} |",
             f"| torch_ref eager (tuned) | {fmt(get('torch_ref', 'images_per_s'))} | "
             f"MFU {fmt(row.get('mfu_torch_ref'), '.1%')} |",
             f"| torch_ref + torch.compile | {fmt(get('torch_compile', 'images_per_s'))} | "
             f"MFU {fmt(row.get('mfu_torch_compile'), '.1%')} |",
             f"| jaxdp / best torch (step time) | {fmt(row.get('ratio_jax_over_best_torch'), '.2f')} | "
             f"best: {row.get('best_torch', '-')} |",
             f"| host input pipeline | {fmt(pipe)} | numpy, one thread |"]
    for name, rec in (result.get("extra") or {}).items():
        if rec.get("report"):
            from jaxdp.analysis.mock_topology import markdown as mock_markdown

            lines += ["", mock_markdown(rec["report"])]
    return "\n".join(lines)


def run_quick(args, strategies: Sequence[str], write) -> int:
    """The <= 5 minute bench, every component within the deadline; the exit status says whether
    each ran (``report.exit_status``)."""
    from torch_commands.bench.jax_side import prepare_jax
    from torch_commands.bench.report import exit_status
    from torch_commands.bench.runner import run_bench

    deadline = Deadline(QUICK_DEADLINE_S if args.deadline is None else args.deadline)
    # first: before this process's jax takes the GPU
    train = run_train(os.path.join(args.out, "train"), deadline.timeout(TRAIN_TIMEOUT_S))
    prepare_jax(1)
    result = run_bench(preset_config(args, global_batch=QUICK_BATCH, n=(1,), bare=False), strategies,
                       with_torch=args.torch, timeout_s=args.timeout, pipeline_images=args.pipeline_images,
                       deadline=deadline)
    result["train"] = train
    if args.mock_gpus:
        name = f"mock {args.mock_gpus}-GPU topology"
        result.setdefault("extra", {})[name] = (
            {"not_run": deadline.why()} if deadline.passed() else
            run_mock_topology(args.mock_gpus, os.path.join(args.out, f"mock{args.mock_gpus}"),
                              deadline.timeout(MOCK_TIMEOUT_S)))
    result["deadline_s"], result["seconds"] = deadline.seconds, deadline.elapsed()
    write(result)
    return exit_status(result)


def run_preset(args, strategies: Sequence[str], write) -> int:
    """The preset's rows (``--dry-run``: printed, not run); ``write(result)`` saves the merged result."""
    from torch_commands.bench.jax_side import prepare_jax
    from torch_commands.bench.report import exit_status
    from torch_commands.bench.runner import BenchError, run_bench

    jax_off_preallocation()
    gpus = visible_gpus()
    ns = device_counts(gpus or ASSUMED_GPUS, args.n or ())
    if args.quick:
        strategies = strategies if args.strategies else [QUICK_STRATEGY]
    if args.dry_run:
        print(quick_plan_text(gpus, args.out, strategies, args.deadline, args.mock_gpus) if args.quick else
              dry_run_text(planned_rows(ns, strategies), gpus))
        return 0
    if not gpus:
        raise BenchError("--preset gpu needs CUDA GPUs and neither nvidia-smi nor torch sees one; --dry-run prints the "
                         "rows it runs")
    if args.quick:
        return run_quick(args, strategies, write)
    prepare_jax(max(ns))
    runs = [run_bench(preset_config(args, global_batch=b * n, n=(n,)), strategies, with_torch=args.torch,
                      timeout_s=args.timeout, pipeline_images=args.pipeline_images)
            for b in BATCHES_PER_DEVICE for n in ns]
    result = {**runs[0], "rows": [r for run in runs for r in run["rows"]], "bare": {},
              "runs": [{"config": run["config"], "bare": run["bare"]} for run in runs]}
    scaling_efficiency(result["rows"])
    write(result)
    return exit_status(result)
