"""``make gpu-check``: every strategy's parity with its PyTorch twin on the GPUs at hand, at
the test suite's tiny size and at realistic sizes, in ONE report with one PASS/FAIL table.

    python -m torch_commands.gpu_check                  # on a GPU host (1 GPU or more): run it all
    python -m torch_commands.gpu_check --dry-run        # anywhere: print and write the plan only
    python -m torch_commands.gpu_check --simulate 2,3   # CPU: the simulated part alone, tiny, on
                                                      # 3 simulated JAX devices and gloo torch ranks

The plan (``make_plan``):

- **One GPU**: every strategy (``ddp zero1 zero2 zero3 hsdp dp``) at N = 1 on the GPU, at
  realistic sizes (``REALISTIC``: ResNet-18 of width 64 at 32x32 with 64 images, and ViT-Tiny,
  dim 192 depth 12, at 32x32 with 64 images), in float32, bfloat16 and float64; then, clearly
  labelled, the N = 2 and N = 3 pairs on simulated CPU devices with torch on gloo (tiny
  model, float64), run in a child process (``--simulate 2,3``) since JAX's devices are fixed
  per process.
- **N >= 2 GPUs**: the tiny pairs at N = every GPU in float32 and float64, as the CPU suite
  runs them; the realistic pairs at that N; one ``jaxdp bench`` row (ddp at N).

Everything must fit ``--budget`` seconds (default ``BUDGET_S``: 6 minutes on one H100).
Each pair has an estimated cost (``ESTIMATE_S``: a compile and a torch launch dominate);
the realistic pairs are taken in priority order (``realistic_order``: the float32 ResNet
the first GPU run failed on, both models in every dtype, every strategy once) while the
estimate fits, and the rest are listed as left out, with the ``--budget 0`` that runs them
all. While running, a GPU pair that would overrun the budget is SKIPPED (named, not a
failure). Each pair's measured seconds are in the report beside its estimate. float64 is planned where the GPU computes it (probed on the JAX side).

Each pair's configuration is built by parsing its own ``jaxdp parity ...`` command line with
the parity CLI's parser (``add_parity_args``), so the command printed in the plan is exactly
what ran; each pair's ``report.json`` and ``parity.png`` go to ``OUT/pairs/<pair>/``. The
check runs in parity mode (``parity_tests.parity_mode``: deterministic cuDNN engines on both
sides, no TF32), set up here before JAX starts.

``OUT/report.md`` and ``OUT/report.json`` (default ``runs/gpu-check``) say PASS or FAIL per
pair (with the first divergence, or the error), where it ran (GPU, or simulated CPU), the
bench row, the versions and devices found, and that TF32 is off on both sides. The overall
status is PASS only if every pair that ran passed. ``--dry-run`` writes the same two files
with every pair PLANNED. Exit status: 0 PASS (or a dry run), 1 FAIL, 2 refused (no GPU,
JAX without GPUs, bad options).

Nothing here imports jax at module level: ``--simulate`` sets XLA's device count first.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from jaxdp import registry

DTYPES = ("float32", "float64")                   # the tiny pairs on >= 2 GPUs
REALISTIC_DTYPES = ("float32", "bfloat16", "float64")
SIMULATED_N = (2, 3)                              # one-GPU hosts: these N on simulated CPU devices
SIMULATED_DTYPES = ("float64",)

SGD = ["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--nesterov", "--weight-decay", "5e-4"]
ADAMW = ["--optimizer", "adamw", "--lr", "1e-3", "--weight-decay", "1e-2"]
# The model and optimiser of the CPU parity suite (parity_tests/cases.py: TINY, SGD):
# the configuration whose bounds are measured there; "simulate" shrinks it further.
TINY = {
    "gpu": dict(model="resnet18", width=4, blocks="1,1,1,1", image_size=16, batch_per_device=8, steps=4, opt=SGD),
    "simulate": dict(model="resnet18", width=4, blocks="1,1,1,1", image_size=8, batch_per_device=4, steps=2, opt=SGD),
}
# The sizes people train (issue 25): two steps each (float32 and bf16 bound every tensor at
# step 0 and the loss at every step; float64 every tensor at every step).
REALISTIC = {
    "resnet18-w64": dict(model="resnet18", width=64, blocks="2,2,2,2", image_size=32, batch_per_device=64, steps=2,
                         opt=SGD),
    "vit-tiny": dict(model="vit-tiny", image_size=32, batch_per_device=64, steps=2, opt=ADAMW),
}
# Estimated seconds per pair on one H100, compile and torch launch included: guesses from the
# CPU timings (a ResNet-18 step compiles in ~3x the tiny one's time) until a GPU run reports
# each pair's seconds beside them (report.json: "seconds" and "estimate_s").
ESTIMATE_S = {"resnet18-w64": 25.0, "vit-tiny": 20.0, "tiny": 8.0, "simulated": 6.0}
STARTUP_S = 20.0  # JAX's GPU backend, torch's forkserver, the float64 probe
BUDGET_S = 360.0  # issue 25: the whole check in <= 6 minutes on one H100
BENCH = {
    "gpu": dict(model="resnet18", width=16, blocks=None, per_device_batch=32, dtype="bfloat16", steps=10, warmup=2,
                torch_compile="inductor"),
    "simulate": dict(model="resnet18", width=4, blocks=(1, 1, 1, 1), per_device_batch=2, dtype="float32",
                     steps=2, warmup=1, torch_compile=None),
}
ESTIMATE_S["bench"] = 30.0
BENCH_STRATEGY = "ddp"


def __getattr__(name):
    """``STRATEGIES``: the registered strategies gpu-check pairs (``jaxdp.registry``, ``gpu_checked``)."""
    if name == "STRATEGIES":
        return registry.names(gpu_checked=True)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class CheckRefused(Exception):
    """The check cannot run here as asked (one line, exit status 2)."""


@dataclass
class PairPlan:
    id: str
    strategy: str
    dtype: str
    n: int
    backend: str
    torch_twin: str
    torch_ranks: int
    argv: List[str]
    out: str
    size: str = "tiny"               # a TINY or REALISTIC key
    where: str = "gpu"               # gpu | simulated cpu
    estimate_s: float = 0.0
    status: str = "PLANNED"          # PLANNED | PASS | FAIL | ERROR | SKIPPED
    message: str = ""
    seconds: Optional[float] = None
    details: Dict = field(default_factory=dict)

    @property
    def command(self) -> str:
        return "jaxdp parity " + shlex.join(self.argv)


@dataclass
class CheckPlan:
    mode: str                        # gpu | simulate
    dry_run: bool
    n: int                           # GPUs used (simulate: the largest simulated N)
    backend: str
    dtypes: List[str]
    strategies: List[str]
    out: str
    notes: List[str]
    pairs: List[PairPlan]
    bench: Optional[Dict]            # {"config", "command", "status", ...}; None with --no-bench
    budget_s: float = BUDGET_S
    left_out: List[str] = field(default_factory=list)  # pairs the budget left out: "id (estimate)"
    simulated_n: List[int] = field(default_factory=list)  # N of the simulated CPU pairs (a child process)

    @property
    def estimate_s(self) -> float:
        return STARTUP_S + sum(p.estimate_s for p in self.pairs) + (ESTIMATE_S["bench"] if self.bench else 0.0)


# ----------------------------------------------------------------------------- the plan

def hsdp_mesh_shape(n: int) -> Tuple[int, int]:
    """The default (replicas, shards) on one host (``jaxdp.registry.default_mesh``, jaxdp's and
    torch_ref's): a replicated pair runs what a user gets without --mesh-shape, named in its command."""
    return registry.default_mesh(n)


def parity_argv(strategy: str, dtype: str, n: int, backend: str, size: dict, out: str) -> List[str]:
    """The ``jaxdp parity`` arguments of one pair at one size (a TINY or REALISTIC entry)."""
    argv = ["--strategy", strategy, "--devices", str(n), "--dtype", dtype, "--backend", backend,
            "--model", size["model"]]
    if "width" in size:  # a ResNet's; a ViT's sizes are its name's (vit-tiny)
        argv += ["--width", str(size["width"]), "--blocks", size["blocks"]]
    argv += ["--image-size", str(size["image_size"]), "--batch-per-device", str(size["batch_per_device"]),
             "--steps", str(size["steps"]), *size["opt"]]
    if registry.row(strategy).replicas:
        argv += ["--mesh-shape", ",".join(map(str, hsdp_mesh_shape(n)))]
    return argv + ["--out", out]


def parity_config(argv: Sequence[str]):
    """The ``ParityConfig`` that ``jaxdp parity ARGV`` runs (the parity CLI's own parser)."""
    from parity_tests.command import add_parity_args, config_from_args

    parser = argparse.ArgumentParser(prog="jaxdp parity")
    add_parity_args(parser)
    return config_from_args(parser.parse_args(list(argv)))


def make_pair(strategy: str, dtype: str, n: int, backend: str, size_name: str, size: dict, out: str, *,
              where: str = "gpu", estimate_s: Optional[float] = None, pid: Optional[str] = None) -> PairPlan:
    """One planned pair: its command, and the torch twin and ranks that command will get."""
    from parity_tests.pairs import pair_for
    from parity_tests.plan import torch_layout

    pid = pid or f"{strategy}-{dtype}-{size_name}-n{n}"
    pair_out = os.path.join(out, "pairs", pid)
    argv = parity_argv(strategy, dtype, n, backend, size, pair_out)
    cfg = parity_config(argv)
    twin, world, _, _ = torch_layout(cfg, pair_for(strategy), n if backend == "nccl" else 0)
    return PairPlan(pid, strategy, dtype, n, backend, twin, world, argv, pair_out, size_name, where,
                    ESTIMATE_S[size_name if size_name in ESTIMATE_S else "tiny"] if estimate_s is None else estimate_s)


def realistic_order(strategies: Sequence[str], dtypes: Sequence[str]) -> List[Tuple[str, str, str]]:
    """(size, dtype, strategy) of the realistic pairs, most wanted first: the float32 ResNet that
    the first GPU run failed on (ddp, zero3), the ViT in float32, both models in bf16 and float64
    (ddp), every other strategy once (the float32 ResNet), then the rest."""
    r, v = REALISTIC
    wanted = [(r, "float32", "ddp"), (r, "float32", "zero3"), (v, "float32", "ddp"), (r, "bfloat16", "ddp"),
              (r, "float64", "ddp"), (v, "bfloat16", "ddp"), (v, "float64", "ddp")]
    every = registry.names(gpu_checked=True)
    wanted += [(r, "float32", s) for s in every]
    wanted += [(size, d, s) for d in REALISTIC_DTYPES for size in REALISTIC for s in every]
    return [w for w in dict.fromkeys(wanted) if w[1] in dtypes and w[2] in strategies]


def simulated_pairs(ns: Sequence[int], dtypes: Sequence[str], strategies: Sequence[str], out: str,
                    steps: Optional[int] = None) -> List[PairPlan]:
    """The tiny pairs at each N on simulated CPU devices, torch on gloo."""
    size = dict(TINY["simulate"], **({"steps": steps} if steps else {}))
    return [make_pair(s, d, n, "gloo", "tiny", size, out, where="simulated cpu", estimate_s=ESTIMATE_S["simulated"],
                      pid=f"{s}-{d}-n{n}-simulated")
            for n in ns for d in dtypes for s in strategies]


def make_plan(mode: str, n: int, backend: str, dtypes: Sequence[str], strategies: Sequence[str], out: str, *,
              steps: Optional[int] = None, bench: bool = True, dry_run: bool = False,
              notes: Sequence[str] = (), budget_s: float = BUDGET_S, simulated_n: Sequence[int] = (),
              realistic: bool = True) -> CheckPlan:
    """``simulate``: the tiny pairs at each of ``simulated_n`` on CPU devices. ``gpu`` with n = 1: the
    realistic pairs on the GPU, then the simulated N = 2, 3 pairs; n >= 2: the tiny pairs at N = n,
    the realistic ones, one bench row. Realistic pairs beyond ``budget_s`` (0: no limit) are left out."""
    notes = list(notes)
    if mode == "simulate":
        pairs = simulated_pairs(simulated_n, dtypes, strategies, out, steps)
        return CheckPlan(mode, dry_run, max(simulated_n), backend, list(dtypes), list(strategies), out, notes, pairs,
                         _bench_plan("simulate", max(simulated_n), backend, out) if bench else None, budget_s,
                         simulated_n=list(simulated_n))
    tiny = dict(TINY["gpu"], **({"steps": steps} if steps else {}))
    pairs = [] if n == 1 else [make_pair(s, d, n, backend, "tiny", tiny, out, pid=f"{s}-{d}")
                               for d in dtypes if d in DTYPES for s in strategies]
    sims = simulated_pairs(SIMULATED_N, [d for d in SIMULATED_DTYPES if d in dtypes] or ["float64"],
                           strategies, out) if n == 1 else []
    plan = CheckPlan(mode, dry_run, n, backend, list(dtypes), list(strategies), out, notes, pairs,
                     _bench_plan("gpu", n, backend, out) if bench and n >= 2 else None, budget_s,
                     simulated_n=list(SIMULATED_N) if n == 1 else [])
    spent = plan.estimate_s + sum(p.estimate_s for p in sims)
    for size, dtype, strategy in realistic_order(strategies, dtypes) if realistic else ():
        pair = make_pair(strategy, dtype, n, backend, size, REALISTIC[size], out)
        if budget_s and spent + pair.estimate_s > budget_s:
            plan.left_out.append(f"{pair.id} (~{pair.estimate_s:.0f} s)")
            continue
        spent += pair.estimate_s
        plan.pairs.append(pair)
    plan.pairs += sims
    if plan.left_out:
        plan.notes.append(f"{len(plan.left_out)} realistic pair(s) left out to stay within the {budget_s:.0f} s budget "
                          f"(estimated): {', '.join(plan.left_out)}; --budget 0 runs them all")
    return plan


def _bench_plan(mode: str, n: int, backend: str, out: str) -> Dict:
    b = BENCH[mode]
    cfg = {"model": b["model"], "width": b["width"], "blocks": b["blocks"],
           "global_batch": b["per_device_batch"] * n, "dtype": b["dtype"], "optimizer": "sgd",
           "steps": b["steps"], "warmup": b["warmup"], "n": [n], "torch_backend": backend,
           "torch_compile": b["torch_compile"]}
    args = ["--strategies", BENCH_STRATEGY, "--devices", str(n), "--model", b["model"], "--width", str(b["width"]),
            *(["--blocks", ",".join(map(str, b["blocks"]))] if b["blocks"] else []),
            "--global-batch-size", str(cfg["global_batch"]), "--dtype", b["dtype"], "--steps", str(b["steps"]),
            "--warmup", str(b["warmup"]), *(["--torch-compile", b["torch_compile"]] if b["torch_compile"] else []),
            "--out", os.path.join(out, "bench"), "--tag", "bench"]
    return {"strategy": BENCH_STRATEGY, "n": n, "config": cfg, "status": "PLANNED",
            "command": f"JAXDP_TORCH_BACKEND={backend} jaxdp bench " + shlex.join(args),
            "note": "a smoke test of both sides' step: it runs in the check's process, under parity mode "
                    "(no XLA autotuning, deterministic cuDNN), so jaxdp bench times the real thing"}


# ----------------------------------------------------------------------------- the hardware

def torch_gpus() -> List[str]:
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def jax_gpus() -> Tuple[str, List[str]]:
    """(JAX's default backend, its GPU device kinds)."""
    import jax

    try:
        gpus = jax.devices("gpu")
    except RuntimeError:  # no GPU backend (CPU-only jaxlib, or JAX_PLATFORMS=cpu)
        gpus = []
    return jax.default_backend(), [d.device_kind for d in gpus]


def jax_float64_ok() -> Tuple[bool, str]:
    """Whether JAX computes float64 on its default (GPU) device: a tiny matmul."""
    import jax
    import numpy as np

    jax.config.update("jax_enable_x64", True)
    try:
        x = jax.device_put(np.arange(4.0).reshape(2, 2))
        got = np.asarray(jax.jit(lambda a: a @ a)(x))
        ok = got.dtype == np.float64 and np.array_equal(got, np.array([[2.0, 3.0], [6.0, 11.0]]))
        return ok, "" if ok else f"float64 matmul returned {got.dtype} {got.tolist()}"
    except Exception as e:  # pragma: no cover - depends on the device
        return False, f"{type(e).__name__}: {e}"


# ----------------------------------------------------------------------------- running it

def run_pair(pair: PairPlan, png: bool = True) -> None:
    """One parity run (``run_parity``), its report written to ``pair.out``; fills the pair."""
    from parity_tests import report
    from parity_tests.config import ParityError
    from parity_tests.runner import run_parity

    t0 = time.perf_counter()
    try:
        result = run_parity(parity_config(pair.argv))
        os.makedirs(pair.out, exist_ok=True)
        if png:
            report.write(result, pair.out)
        else:
            report.write_json(result, os.path.join(pair.out, "report.json"))
        pair.status = "PASS" if result.ok else "FAIL"
        pair.message = result.message()
        p = result.plan
        dev = report.devices(p)
        pair.torch_twin, pair.torch_ranks, pair.backend = p.torch_strategy, p.world, p.backend
        pair.details = {"devices": dev, "seconds": result.seconds, "report": os.path.join(pair.out, "report.json")}
        if dev["tf32"]["off_on_both_sides"] is not True:  # parity in float32 assumes full precision
            pair.status = "FAIL"
            pair.message = f"TF32 not verified off: {dev['tf32']}; " + pair.message
    except ParityError as e:
        pair.status, pair.message = "ERROR", f"refused: {e}"
    except Exception as e:
        pair.status, pair.message = "ERROR", f"{type(e).__name__}: {str(e)[-1500:]}"
        pair.details = {"traceback": traceback.format_exc()[-4000:]}
    pair.seconds = time.perf_counter() - t0


def run_bench_row(plan: CheckPlan) -> None:
    import jax

    from torch_commands.bench.report import markdown
    from torch_commands.bench.runner import run_bench

    b = plan.bench
    out = os.path.join(plan.out, "bench")
    t0 = time.perf_counter()
    # Parity left JAX at the highest matmul precision; a benchmark times the default, as
    # `jaxdp bench` would (the row's dtype is bfloat16 on GPUs, where TF32 does not arise).
    precision = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", None)
    try:
        result = run_bench(dict(b["config"], n=tuple(b["config"]["n"])), [b["strategy"]],
                                 with_torch=True, timeout_s=600.0, pipeline_images=256)
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "bench.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
        with open(os.path.join(out, "bench.md"), "w") as f:
            f.write(markdown(result) + "\n")
        rows = result["rows"]
        row = rows[0] if rows else {}
        j, t = row.get("jaxdp") or {}, row.get("torch_ref") or {}
        b.update(jaxdp_step_s=j.get("median_step_s"), torch_step_s=t.get("median_step_s"),
                 jaxdp_images_per_s=j.get("images_per_s"), torch_images_per_s=t.get("images_per_s"),
                 ratio_jax_over_torch=row.get("ratio_jax_over_torch"), torch_backend=t.get("backend"),
                torch_compile_step_s=(row.get("torch_compile") or {}).get("median_step_s"),
                ratio_jax_over_best_torch=row.get("ratio_jax_over_best_torch"),
                 device_kind=result["environment"].get("device_kind"), report=os.path.join(out, "bench.json"))
        errors = [f"{fw}: {r['error'].splitlines()[0][:300]}" for fw, r in (("jaxdp", j), ("torch_ref", t))
                  if r.get("error")]
        if not rows:
            b.update(status="FAIL", message=f"no row ran (N={plan.n} devices available?)")
        elif errors or not (j.get("median_step_s") and t.get("median_step_s")):
            b.update(status="FAIL", message="; ".join(errors) or "a side has no step time")
        else:
            b.update(status="PASS", message="both sides ran and were timed")
    except Exception as e:
        b.update(status="ERROR", message=f"{type(e).__name__}: {str(e)[-1500:]}")
    finally:
        jax.config.update("jax_default_matmul_precision", precision)
    b["seconds"] = time.perf_counter() - t0


def overall(plan: CheckPlan) -> str:
    if plan.dry_run:
        return "DRY RUN"
    statuses = [p.status for p in plan.pairs] + ([plan.bench["status"]] if plan.bench else [])
    return "PASS" if statuses and all(s in ("PASS", "SKIPPED") for s in statuses) \
        and any(s == "PASS" for s in statuses) else "FAIL"


def run_simulated(plan: CheckPlan, log=print, timeout_s: Optional[float] = None) -> None:
    """The plan's simulated CPU pairs, in a child process (``--simulate``): this one's JAX is on
    the GPU, and a process's JAX devices are fixed when it starts. Fills those pairs from the
    child's report (written after each pair); past ``timeout_s`` the child is stopped and the
    pairs it did not reach are SKIPPED (the time budget), not failed."""
    sims = [p for p in plan.pairs if p.where == "simulated cpu"]
    if not sims:
        return
    out = os.path.join(plan.out, "simulated")
    argv = [sys.executable, "-m", "torch_commands.gpu_check", "--simulate", ",".join(map(str, plan.simulated_n)),
            "--strategies", ",".join(dict.fromkeys(p.strategy for p in sims)),
            "--dtypes", ",".join(dict.fromkeys(p.dtype for p in sims)), "--no-bench", "--no-png", "--out", out]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAXDP_TORCH_BACKEND")}
    env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="", JAXDP_TORCH_BACKEND="gloo")
    log(f"[simulated] {shlex.join(argv[1:])}  (JAX_PLATFORMS=cpu, torch on gloo)")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s)
        late = ""
    except subprocess.TimeoutExpired as e:
        proc = subprocess.CompletedProcess(argv, "timeout", e.stdout or "", e.stderr or "")
        late = f"time budget: the simulated part was stopped after {timeout_s:.0f} s (--budget 0: no limit)"
    done = {}
    try:
        with open(os.path.join(out, "report.json")) as f:
            done = {p["id"]: p for p in json.load(f)["pairs"]}
    except (OSError, ValueError, KeyError):
        pass
    for pair in sims:
        got = done.get(pair.id)
        if (got is None or got["status"] == "PLANNED") and late:
            pair.status, pair.message = "SKIPPED", late
        elif got is None or got["status"] == "PLANNED":
            pair.status = "ERROR"
            pair.message = f"the simulated run (exit {proc.returncode}) did not report it: {proc.stderr[-800:]}"
        else:
            pair.status, pair.message, pair.seconds = got["status"], got["message"], got["seconds"]
            pair.details = got["details"]
        log(f"    {pair.id}: {pair.status}: {pair.message[:160]}")
    log(f"[simulated] {time.perf_counter() - t0:.1f}s")


# ----------------------------------------------------------------------------- the report

def versions() -> Dict[str, Optional[str]]:
    """The installed jax, jaxlib, flax, optax, orbax and torch (what this host's image ships)."""
    from importlib import metadata

    out = {}
    for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "torch", "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def environment(plan: CheckPlan) -> dict:
    env: Dict = {"python": sys.version.split()[0], "mode": plan.mode, "versions": versions()}
    try:
        import torch

        env.update(torch=torch.__version__, torch_cuda=torch.version.cuda, torch_gpus=torch_gpus())
    except Exception:  # pragma: no cover
        pass
    if "jax" in sys.modules:
        import jax

        env.update(jax=jax.__version__, jax_backend=jax.default_backend(),
                   jax_devices=[d.device_kind for d in jax.devices()][:plan.n],
                   jax_default_matmul_precision=jax.config.jax_default_matmul_precision)
    env["JAXDP_TORCH_BACKEND"] = os.environ.get("JAXDP_TORCH_BACKEND")
    from parity_tests import parity_mode

    env["parity_mode"] = parity_mode.summary()
    return env


def to_json(plan: CheckPlan) -> dict:
    return {"status": overall(plan), "mode": plan.mode, "dry_run": plan.dry_run, "n": plan.n,
            "backend": plan.backend, "dtypes": plan.dtypes, "strategies": plan.strategies,
            "budget_s": plan.budget_s, "estimate_s": plan.estimate_s, "left_out": plan.left_out,
            "simulated_n": plan.simulated_n, "notes": plan.notes, "tf32": tf32_policy(plan),
            "environment": environment(plan),
            "pairs": [dict(asdict(p), command=p.command) for p in plan.pairs], "bench": plan.bench}


def tf32_policy(plan: CheckPlan) -> str:
    ran = [p.details["devices"]["tf32"] for p in plan.pairs if "devices" in p.details]
    if not ran:
        return ("planned off on both sides: torch allow_tf32=False (matmul, cuDNN) and NVIDIA_TF32_OVERRIDE=0 in "
                "every rank; JAX jax_default_matmul_precision=highest")
    if all(t["off_on_both_sides"] is True for t in ran):
        return f"off on both sides in every pair that ran (jaxdp: {ran[0]['jaxdp']}; torch: {ran[0]['torch']})"
    return "NOT off in some pair: see the pairs' devices.tf32"


def _fmt(x, spec=".4f"):
    return "-" if x is None else format(x, spec)


def _where(plan: CheckPlan, env: dict) -> str:
    gpus = env.get("torch_gpus") or []
    if plan.mode == "simulate":
        return f"N = {', '.join(map(str, plan.simulated_n))} on simulated CPU devices"
    names = f": {', '.join(sorted(set(gpus[:plan.n])))}" if gpus else " (planned)"
    return f"{plan.n} GPU(s){names}" + (f"; N = {', '.join(map(str, plan.simulated_n))} on simulated CPU devices"
                                         if plan.simulated_n else "")


def markdown(plan: CheckPlan) -> str:
    status = overall(plan)
    env = environment(plan)
    v = env["versions"]
    lines = [f"# gpu-check: {status}", "",
             f"- mode: {plan.mode}{' (dry run: nothing was run)' if plan.dry_run else ''}; {_where(plan, env)}",
             f"- torch backend: {plan.backend} (rank r on {'cuda:r' if plan.backend == 'nccl' else 'the CPU'}); "
             f"jaxdp on " + (f"{env['jax_backend']} ({', '.join(sorted(set(env['jax_devices'])))})" if "jax" in env
                             else f"{plan.n} {'GPUs' if plan.mode == 'gpu' else 'CPU devices'} (planned)"),
             f"- TF32: {tf32_policy(plan)}",
             f"- parity mode: XLA_FLAGS {' '.join(env['parity_mode']['xla_flags'])} (in effect: "
             f"{env['parity_mode']['xla_flags_in_effect']}), {env['parity_mode']['env']}; torch cudnn.deterministic, "
             "no cudnn.benchmark, in every rank",
             f"- dtypes: {', '.join(plan.dtypes)}; strategies: {', '.join(plan.strategies)}",
             f"- versions: torch {v['torch']} (CUDA {env.get('torch_cuda')}), jax {v['jax']} (jaxlib {v['jaxlib']}), "
             f"flax {v['flax']}, optax {v['optax']}, orbax {v['orbax-checkpoint']}, python {env['python']}",
             f"- time: estimated {plan.estimate_s:.0f} s for a budget of {plan.budget_s:.0f} s; took "
             f"{_fmt(sum(p.seconds or 0 for p in plan.pairs) or None, '.0f')} s in the pairs"]
    lines += [f"- note: {n}" for n in plan.notes]
    lines += ["", "## Parity, per pair", "",
              "| pair | where | size | dtype | N | torch twin (ranks, backend) | torch devices | result | detail | s (est.) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for p in plan.pairs:
        ranks = (p.details.get("devices") or {}).get("torch_ranks") or []
        devs = ", ".join(r["device"] for r in ranks) or (f"cuda:0..cuda:{p.n - 1} (planned)"
                                                          if p.backend == "nccl" else "cpu (planned)")
        msg = p.message.replace("|", "/").replace("\n", " ")[:240]
        where = "**simulated CPU**" if p.where == "simulated cpu" else "GPU"
        lines.append(f"| {p.strategy} | {where} | {p.size} | {p.dtype} | {p.n} | {p.torch_twin} ({p.torch_ranks}, "
                     f"{p.backend}) | {devs} | **{p.status}** | {msg} | {_fmt(p.seconds, '.1f')} ({p.estimate_s:.0f}) |")
    if plan.bench:
        b = plan.bench
        lines += ["", "## Benchmark (one row: jaxdp and torch_ref)", "",
                  "| strategy | N | dtype | jaxdp step s | torch step s | jax/torch | jaxdp img/s | torch img/s | result |",
                  "|---|---|---|---|---|---|---|---|---|",
                  f"| {b['strategy']} | {b['n']} | {b['config']['dtype']} | {_fmt(b.get('jaxdp_step_s'))} "
                  f"| {_fmt(b.get('torch_step_s'))} | {_fmt(b.get('ratio_jax_over_torch'), '.2f')} "
                  f"| {_fmt(b.get('jaxdp_images_per_s'), '.1f')} | {_fmt(b.get('torch_images_per_s'), '.1f')} "
                  f"| **{b['status']}** {b.get('message', '')} |"]
    lines += ["", "## Commands (each pair is exactly this `jaxdp parity` run)", "", "```"]
    lines += [p.command for p in plan.pairs]
    if plan.bench:
        lines.append(plan.bench["command"])
    lines += ["```", ""]
    return "\n".join(lines)


def table(plan: CheckPlan) -> str:
    """The one PASS/FAIL table printed at the end: a line per pair (and the bench row)."""
    rows = [f"{'pair':<34} {'where':<14} {'result':<8} {'s':>6}  detail"]
    for p in plan.pairs:
        rows.append(f"{p.id:<34} {p.where:<14} {p.status:<8} {_fmt(p.seconds, '6.1f'):>6}  {p.message[:100]}")
    if plan.bench:
        b = plan.bench
        rows.append(f"{'bench ' + b['strategy']:<34} {'gpu':<14} {b['status']:<8} {_fmt(b.get('seconds'), '6.1f'):>6}  "
                    f"{b.get('message', '')[:100]}")
    return "\n".join(rows)


def write(plan: CheckPlan) -> List[str]:
    os.makedirs(plan.out, exist_ok=True)
    md, js = os.path.join(plan.out, "report.md"), os.path.join(plan.out, "report.json")
    with open(md, "w") as f:
        f.write(markdown(plan))
    with open(js, "w") as f:
        json.dump(to_json(plan), f, indent=1, default=str)
    return [md, js]


# ----------------------------------------------------------------------------- the command

def add_args(p: argparse.ArgumentParser) -> None:
    from jaxdp.config.flags import comma_ints

    p.add_argument("--dry-run", action="store_true",
                   help="print and write the plan (pairs, N, dtypes, backend, commands); run nothing, no GPU needed")
    p.add_argument("--simulate", type=comma_ints, default=None, metavar="N[,N...]",
                   help="run the tiny pairs at each N on simulated CPU JAX devices and gloo torch ranks (a CPU test "
                        "of the check, and the simulated part of a one-GPU host's check; no GPU involved)")
    p.add_argument("--devices", type=int, default=None,
                   help="GPUs to use (default: every visible GPU; 1 runs the one-GPU plan on a bigger host)")
    p.add_argument("--strategies", default=",".join(registry.names(gpu_checked=True)),
                   help="comma list (default: %(default)s)")
    p.add_argument("--dtypes", default=None,
                   help=f"comma list (default: {','.join(REALISTIC_DTYPES)} on GPUs, with the tiny pairs in "
                        f"{','.join(DTYPES)}; {','.join(SIMULATED_DTYPES)} with --simulate; float64 is skipped "
                        "where the GPU does not compute it)")
    p.add_argument("--steps", type=int, default=None, help="parity steps per tiny pair (default 4; --simulate 2)")
    p.add_argument("--budget", dest="budget_s", type=float, default=BUDGET_S,
                   help="seconds the check may take (estimated per pair, ESTIMATE_S): realistic pairs beyond it are "
                        "left out, named in the report; 0: no limit (default %(default)s)")
    p.add_argument("--no-realistic", dest="realistic", action="store_false",
                   help="only the tiny pairs (and, on one GPU, the simulated ones)")
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                   help="torch backend (default: nccl on GPUs, gloo with --simulate)")
    p.add_argument("--no-bench", dest="bench", action="store_false", help="skip the benchmark row")
    p.add_argument("--no-png", dest="png", action="store_false", help="skip each pair's parity.png")
    p.add_argument("--out", default="runs/gpu-check", help="report.md, report.json, pairs/, bench/ (default %(default)s)")


def _choices(text: str, allowed: Sequence[str], what: str) -> List[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise CheckRefused(f"--{what} must be a comma list of {', '.join(allowed)}, got {text!r}")
    return items


def prepare(args) -> CheckPlan:
    """Decide mode, N, backend and dtypes (refusing what cannot run); set JAX up before it starts."""
    from parity_tests import parity_mode

    strategies = _choices(args.strategies, registry.names(gpu_checked=True), "strategies")
    notes: List[str] = []
    if args.simulate is not None:
        ns = sorted(set(args.simulate))
        if ns[0] < 2:
            raise CheckRefused(f"--simulate needs N >= 2 devices, got {args.simulate}")
        dtypes = _choices(args.dtypes or ",".join(SIMULATED_DTYPES), REALISTIC_DTYPES, "dtypes")
        if "jax" not in sys.modules:
            from jaxdp.runtime.mesh import simulate_cpu_devices

            os.environ["JAX_PLATFORMS"] = "cpu"
            simulate_cpu_devices(ns[-1])
        backend = args.backend or "gloo"
        if backend == "nccl":
            raise CheckRefused("--simulate runs torch on the CPU: its backend is gloo")
        notes.append(f"simulated: jaxdp on CPU devices, torch_ref on gloo ranks, N = {', '.join(map(str, ns))}; a tiny "
                     "model (this checks the pairs' strategies at N > 1, not a GPU)")
        return make_plan("simulate", ns[-1], backend, dtypes, strategies, args.out, steps=args.steps,
                         bench=args.bench, dry_run=args.dry_run, notes=notes, simulated_n=ns)

    dtypes = _choices(args.dtypes or ",".join(REALISTIC_DTYPES), REALISTIC_DTYPES, "dtypes")
    backend = args.backend or "nccl"
    # before JAX starts: parity mode's XLA flags; JAX takes GPU memory as it needs it, torch's ranks
    # share the GPUs (a dry run too: its plan reads each strategy's facts from jaxdp, which imports jax)
    if "jax" not in sys.modules:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    parity_mode.enable()
    gpus = torch_gpus()
    options = dict(steps=args.steps, bench=args.bench, budget_s=args.budget_s, realistic=args.realistic)
    if args.dry_run:
        n = args.devices or (len(gpus) if gpus else 2)
        if not gpus:
            notes.append(f"this machine has no visible GPU: the plan is shown for N = {n} GPUs; on a GPU host N = "
                         "every visible GPU (1 GPU: the one-GPU plan, --devices 1 shows it)")
        if "float64" in dtypes:
            notes.append("float64 runs where the GPU computes it (probed on the JAX side before the run)")
        return make_plan("gpu", n, backend, dtypes, strategies, args.out, dry_run=True, notes=notes, **options)

    if not gpus:
        raise CheckRefused("gpu-check needs a visible CUDA GPU, torch sees 0 (CUDA is not available); see the plan "
                           "with --dry-run, or exercise the check on CPU with --simulate 2,3")
    n = args.devices or len(gpus)
    if not 1 <= n <= len(gpus):
        raise CheckRefused(f"--devices {n}: needs 1 <= N <= {len(gpus)} visible GPUs")
    if backend == "gloo":
        notes.append("torch on gloo: the torch side runs on the CPU, the JAX side on the GPUs")
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        raise CheckRefused("JAX_PLATFORMS=cpu hides the GPUs from JAX: unset it (make gpu-check does)")
    jax_backend, jgpus = jax_gpus()
    if len(jgpus) < n:
        raise CheckRefused(f"JAX sees {len(jgpus)} GPU(s) (default backend {jax_backend}) but torch sees {len(gpus)}: "
                           "install JAX's CUDA build (pip install -e '.[gpu]'; make gpu-check does) and give both "
                           "the same CUDA_VISIBLE_DEVICES")
    if "float64" in dtypes:
        ok, why = jax_float64_ok()
        if not ok:
            dtypes = [d for d in dtypes if d != "float64"]
            notes.append(f"float64 skipped: this GPU does not compute it under JAX ({why})")
        else:
            notes.append("float64: supported here (probed: a float64 matmul on the GPU under JAX)")
    if not dtypes:
        raise CheckRefused("no dtype left to run: " + "; ".join(notes[-1:]))
    return make_plan("gpu", n, backend, dtypes, strategies, args.out, notes=notes, **options)


def run(plan: CheckPlan, png: bool = True, log=print) -> str:
    """Run every pair (the simulated ones in a child process) and the bench row (not for a dry
    run); returns the overall status."""
    if not plan.dry_run:
        here = [p for p in plan.pairs if p.where != "simulated cpu" or plan.mode == "simulate"]
        if any(p.dtype == "float64" for p in here):
            import jax

            jax.config.update("jax_enable_x64", True)
        start, reserve = time.perf_counter(), sum(p.estimate_s for p in plan.pairs if p not in here)
        for i, pair in enumerate(here):
            spent = time.perf_counter() - start + STARTUP_S
            if plan.budget_s and plan.mode == "gpu" and spent + pair.estimate_s + reserve > plan.budget_s:
                pair.status, pair.message = "SKIPPED", (f"time budget: {spent:.0f} s spent, ~{pair.estimate_s:.0f} s "
                                                        f"more would pass {plan.budget_s:.0f} s (--budget 0: no limit)")
                log(f"[{i + 1}/{len(here)}] {pair.id}: SKIPPED ({pair.message})")
                continue
            log(f"[{i + 1}/{len(here)}] {pair.command}")
            run_pair(pair, png=png)
            log(f"    {pair.status}: {pair.message} ({pair.seconds:.1f}s, estimated {pair.estimate_s:.0f}s)")
            write(plan)  # a report after every pair: an interrupted check still has one
        if plan.mode != "simulate":
            left = plan.budget_s - (time.perf_counter() - start + STARTUP_S) if plan.budget_s else None
            run_simulated(plan, log, None if left is None else max(left, 60.0))
            write(plan)
        if plan.bench:
            log(f"[bench] {plan.bench['command']}")
            run_bench_row(plan)
            log(f"    {plan.bench['status']}: {plan.bench.get('message', '')}")
    return overall(plan)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_commands.gpu_check", description=__doc__.splitlines()[0])
    add_args(parser)
    args = parser.parse_args(argv)
    try:
        plan = prepare(args)
    except CheckRefused as e:
        print(f"gpu-check: error: {e}", file=sys.stderr)
        return 2
    env = environment(plan)
    print("gpu-check found: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v) +
          f"; torch GPUs: {env.get('torch_gpus') or 'none'}; jax devices: {env.get('jax_devices', 'not started')}")
    print(f"gpu-check plan ({plan.mode}{', dry run' if plan.dry_run else ''}): {_where(plan, env)}, backend "
          f"{plan.backend}, dtypes {', '.join(plan.dtypes)}, {len(plan.pairs)} pair(s)"
          f"{' + 1 bench row' if plan.bench else ''}, estimated {plan.estimate_s:.0f} s (budget {plan.budget_s:.0f} s)")
    for note in plan.notes:
        print(f"  note: {note}")
    if plan.dry_run:
        for p in plan.pairs:
            print(f"  {p.id:<34} {p.where:<14} ~{p.estimate_s:3.0f}s torch {p.torch_twin} x{p.torch_ranks} "
                  f"({p.backend}): {p.command}")
        if plan.bench:
            print(f"  {'bench':<34} {plan.bench['command']}")
    status = run(plan, png=args.png)
    if not plan.dry_run:
        print(table(plan))
    print(f"gpu-check: {status}; wrote {', '.join(write(plan))}")
    if status == "DRY RUN":
        return 0
    return 0 if status == "PASS" else 1


if __name__ == "__main__":  # the guard matters: torch_ref's ranks re-import the main module
    sys.exit(main())
