"""The bench's rows: every (N, strategy), jaxdp and torch_ref in alternating order, the
environment each ran in, and the input pipeline's rate beside the best training rate."""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Optional, Sequence

import numpy as np

from jaxdp import registry
from jaxdp.cli.commands import CommandError
from jaxdp.run.perf import peak_flops
from torch_commands.bench import cuda_host
from torch_commands.bench.bare import add_overheads, bench_bare
from torch_commands.bench.jax_side import bench_jax, bench_pipeline
from torch_commands.bench.report import row_line
from torch_commands.bench.torch_side import bench_torch, compile_preflight, torch_twin
from torch_commands.bench.variants import variants
from torch_commands.deadline import Deadline


def environment() -> dict:
    import jax

    env = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "host": platform.node(), "python": platform.python_version(),
        "jax": jax.__version__, "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind, "jax_devices": len(jax.devices()),
        "cpu_count": os.cpu_count(), "cpu_affinity": sorted(os.sched_getaffinity(0)),
        "cpu_model": _cpu_model(),
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        "jax_already_imported_before_flags": "xla_cpu_multi_thread_eigen" not in os.environ.get("XLA_FLAGS", ""),
        "torch_threads_per_rank": 1,
        "loadavg": list(os.getloadavg()),
    }
    try:
        import torch

        env["torch"] = torch.__version__
        env["torch_cuda"] = torch.cuda.is_available()
    except ImportError:
        env["torch"] = None
    return env


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def flop_per_image(cfg: dict) -> float:
    """The model's FLOPs per trained image: ``jaxdp.run.flops``, the count train's MFU uses."""
    from jaxdp.run.flops import model_flops_per_image

    options = dict(width=cfg["width"], blocks=cfg["blocks"]) if not cfg["model"].startswith("vit") else {}
    return model_flops_per_image(cfg["model"], dtype=cfg["dtype"], **options, **cfg.get("vit", {}))


def add_mfu(row: dict, fpi: Optional[float], peak: Optional[float]) -> None:
    """``mfu_<framework>`` for every timed framework of the row (``jaxdp.run.flops.mfu``)."""
    from jaxdp.run.flops import mfu

    for fw in ("jaxdp", "torch_ref", "torch_compile"):
        value = mfu((row.get(fw) or {}).get("images_per_s"), fpi, row["n"], peak)
        if value is not None:
            row[f"mfu_{fw}"] = value


def bare_key(n: int, lever) -> str:
    """Where a row's bare steps are: by N, and by lever beside the default."""
    return str(n) if lever in (None, "default") else f"{n} {lever}"


def _row(name: str, n: int, options: dict, lever, cfg: dict, images: np.ndarray, labels: np.ndarray, *,
         order_jax_first: bool, with_torch: bool, timeout_s: float, deadline: Deadline) -> dict:
    """One (N, strategy, options, lever) row: jaxdp and, if asked and the strategy has a twin,
    torch_ref (eager and compiled), in the given order. A side that raises keeps its error in the
    row; one the ``deadline`` does not leave time to start is NOT RUN (``problems``)."""
    row = {"strategy": name, "n": n, "options": options, "lever": lever, "bare_key": bare_key(n, lever),
           "mesh_shape": registry.mesh_shape(name, n), "global_batch": cfg["global_batch"],
           "order": "jaxdp first" if order_jax_first else "torch_ref first", "loadavg_before": list(os.getloadavg())}

    def do_jax():
        if deadline.passed():
            row["jaxdp"] = {"not_run": deadline.why()}
            return
        try:
            row["jaxdp"] = _summary(bench_jax(name, n, cfg, images.reshape(-1, 32, 32, 3), labels.reshape(-1),
                                              options, lever=lever), cfg["global_batch"])
        except Exception as e:
            row["jaxdp"] = {"error": f"{type(e).__name__}: {e}"}

    def do_torch():
        for key, backend in torch_runs(cfg):
            missing = compile_preflight(backend, cuda_host())
            if missing:
                row[key] = {"error": missing}
            elif deadline.passed():
                row[key] = {"not_run": deadline.why()}
            else:
                try:
                    row[key] = _summary(bench_torch(name, n, cfg, images, labels, deadline.timeout(timeout_s),
                                                    options, compile_backend=backend), cfg["global_batch"])
                except Exception as e:
                    row[key] = {"error": f"{type(e).__name__}: {str(e)[-2000:]}"}

    runs = [do_jax] + ([do_torch] if with_torch and torch_twin(name) is not None else [])
    for run in runs if order_jax_first else runs[::-1]:
        run()
    row["loadavg_after"] = list(os.getloadavg())
    j, t = row.get("jaxdp", {}), row.get("torch_ref", {})
    if j.get("median_step_s") and t.get("median_step_s"):
        row["ratio_jax_over_torch"] = j["median_step_s"] / t["median_step_s"]
    add_best_torch(row)
    return row


def torch_runs(cfg: dict):
    """(row key, torch.compile backend) of each torch run a row gets: eager always, and
    compiled under ``cfg["torch_compile"]`` when set."""
    return [("torch_ref", None)] + ([("torch_compile", cfg["torch_compile"])] if cfg.get("torch_compile") else [])


def add_best_torch(row: dict) -> None:
    """The headline ratio: jaxdp's step over the faster of torch eager and torch.compile."""
    steps = [(row.get(k) or {}).get("median_step_s") for k in ("torch_ref", "torch_compile")]
    best = min((s for s in steps if s), default=None)
    j = (row.get("jaxdp") or {}).get("median_step_s")
    if best and j:
        row["best_torch"] = "torch.compile" if best == steps[1] else "eager"
        row["ratio_jax_over_best_torch"] = j / best


def _median(xs):
    return statistics.median(xs) if xs else None


def _summary(rec: dict, global_batch: int) -> dict:
    med = _median(rec.get("step_times_s", []))
    rec["median_step_s"] = med
    rec["images_per_s"] = global_batch / med if med else None
    return rec


class BenchError(CommandError):
    """A bench request with nothing to measure: one line, no traceback."""


def run_bench(cfg: dict, strategies: Sequence[str], *, with_torch: bool = True, timeout_s: float = 600.0,
              pipeline_images: int = 4096, log=print, deadline: Optional[Deadline] = None) -> dict:
    """Every (N, strategy, options, lever) row, the bare steps and the input pipeline. Nothing is
    started once ``deadline`` has passed (what is left is NOT RUN: ``problems``)."""
    import jax

    deadline = deadline or Deadline(None)
    env = environment()
    available = len(jax.devices())
    ns = [n for n in cfg["n"] if n <= available and cfg["global_batch"] % n == 0]
    skipped = [n for n in cfg["n"] if n not in ns]
    if not ns or not strategies:
        raise BenchError("nothing to benchmark: no strategy given" if not strategies else
                         f"nothing to benchmark: every N in {list(cfg['n'])} was skipped (only {available} "
                         f"devices, or global batch {cfg['global_batch']} not divisible by N)")
    if skipped:
        log(f"bench: skipping N = {skipped} (only {available} devices, or global batch "
            f"{cfg['global_batch']} not divisible)")
    peak = peak_flops(env["device_kind"], cfg["dtype"]) if env["backend"] == "gpu" else None
    fpi = flop_per_image(cfg) if peak else None  # an abstract trace of the model: seconds, for MFU only
    rng = np.random.default_rng(0)
    rows, bare = [], {}
    lever_names = list(cfg.get("levers") or [None])
    for n in ns:
        images = rng.normal(size=(n, cfg["global_batch"] // n, 32, 32, 3)).astype(np.float32)
        labels = rng.integers(0, 10, size=(n, cfg["global_batch"] // n)).astype(np.int32)
        for lever in lever_names:
            first = lever == lever_names[0]  # torch is timed on the first lever's rows only: no lever touches it
            if cfg.get("bare", True):  # the same per-device batch with no strategy code (bare.py)
                bare[bare_key(n, lever)] = bench_bare(cfg, images[0], labels[0], with_torch=with_torch and first,
                                                      timeout_s=timeout_s, lever=lever,
                                                      compile_backend=cfg.get("torch_compile"))
            for name, options in [(s, o) for s in strategies for o in variants(s, cfg.get("variants", {}))]:
                row = _row(name, n, options, lever, cfg, images, labels, order_jax_first=len(rows) % 2 == 0,
                           with_torch=with_torch and first, timeout_s=timeout_s, deadline=deadline)
                add_overheads(row, bare.get(row["bare_key"], {}))
                add_mfu(row, fpi, peak)
                rows.append(row)
                log(row_line(row))
    if deadline.passed():
        pipe = {"not_run": deadline.why()}
    else:
        pipe = bench_pipeline(max(ns), cfg["global_batch"], pipeline_images) if ns else None
    best = max((r["jaxdp"]["images_per_s"] for r in rows if r.get("jaxdp", {}).get("images_per_s")), default=None)
    if pipe and best and "images_per_s" in pipe:
        pipe["best_jaxdp_train_images_per_s"] = best
        pipe["headroom"] = pipe["images_per_s"] / best
    env["loadavg_end"] = list(os.getloadavg())
    return {"config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()},
            "strategies": list(strategies), "environment": env, "peak_flops": peak, "flop_per_image": fpi,
            "rows": rows, "bare": bare, "pipeline": pipe}

