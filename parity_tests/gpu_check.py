"""``make gpu-check``: every strategy's parity with its PyTorch twin on every visible GPU,
plus one benchmark row, in ONE report.

    python -m parity_tests.gpu_check                  # on a GPU host (>= 2 GPUs): run it all
    python -m parity_tests.gpu_check --dry-run        # anywhere: print and write the plan only
    python -m parity_tests.gpu_check --simulate 2     # CPU: the same plan, tiny, on 2 simulated
                                                      # JAX devices and 2 gloo torch ranks

The plan: for each of ``ddp zero1 zero2 zero3 hsdp dp`` and each dtype (float32, and
float64 where the GPU computes it: probed on the JAX side before the run), one parity run
(``parity_tests.runner.run_parity``, the code behind ``jaxdp parity``) at N = every
visible GPU (at least 2; refused with fewer), torch on nccl with rank r on ``cuda:r``;
then one ``jaxdp bench`` row (ddp at N) timing jaxdp and torch_ref. Each pair's
configuration is built by parsing its own ``jaxdp parity ...`` command line with the
parity CLI's parser (``add_parity_args``), so the command printed in the plan is exactly
what ran; each pair's ``report.json`` and ``parity.png`` go to ``OUT/pairs/<pair>/``.

``OUT/report.md`` and ``OUT/report.json`` (default ``runs/gpu-check``) say PASS or FAIL
per pair (with the first divergence, or the error), the bench row, the devices each side
ran on (each torch rank reports its own device and TF32 flags), the backend, and that
TF32 is off on both sides (torch: ``allow_tf32=False`` and ``NVIDIA_TF32_OVERRIDE=0`` in
every rank; JAX: ``jax_default_matmul_precision="highest"``). The overall status is PASS
only if every pair passed and the bench row ran on both sides. ``--dry-run`` writes the
same two files with every pair PLANNED and nothing run. Exit status: 0 PASS (or a dry
run), 1 FAIL, 2 refused (fewer than 2 GPUs, JAX without GPUs, bad options).

Nothing here imports jax at module level: ``--simulate N`` sets XLA's device count first.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "hsdp", "dp")
DTYPES = ("float32", "float64")

# The model and optimiser of the CPU parity suite (parity_tests/test_parity.py: TINY, SGD):
# the configuration whose bounds are measured there. --simulate shrinks it further.
SETTINGS = {
    "gpu": dict(width=4, blocks="1,1,1,1", image_size=16, batch_per_device=8, steps=4),
    "simulate": dict(width=4, blocks="1,1,1,1", image_size=8, batch_per_device=4, steps=2),
}
OPTIMIZER = ["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--nesterov", "--weight-decay", "5e-4"]
BENCH = {
    "gpu": dict(model="resnet18", width=16, blocks=None, per_device_batch=32, dtype="bfloat16", steps=10, warmup=2,
                torch_compile="inductor"),
    "simulate": dict(model="resnet18", width=4, blocks=(1, 1, 1, 1), per_device_batch=2, dtype="float32",
                     steps=2, warmup=1, torch_compile=None),
}
BENCH_STRATEGY = "ddp"


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
    n: int
    backend: str
    dtypes: List[str]
    strategies: List[str]
    out: str
    notes: List[str]
    pairs: List[PairPlan]
    bench: Optional[Dict]            # {"config", "command", "status", ...}; None with --no-bench


# ----------------------------------------------------------------------------- the plan

def hsdp_mesh_shape(n: int) -> Tuple[int, int]:
    """(replicas, shards): 2 replicas of N/2 shards when N >= 4 is even, else all shards (1, N)."""
    return (2, n // 2) if n >= 4 and n % 2 == 0 else (1, n)


def parity_argv(strategy: str, dtype: str, n: int, backend: str, settings: dict, out: str) -> List[str]:
    """The ``jaxdp parity`` arguments of one pair."""
    s = settings
    argv = ["--strategy", strategy, "--devices", str(n), "--dtype", dtype, "--backend", backend,
            "--width", str(s["width"]), "--blocks", s["blocks"], "--image-size", str(s["image_size"]),
            "--batch-per-device", str(s["batch_per_device"]), "--steps", str(s["steps"]), *OPTIMIZER]
    if strategy == "hsdp":
        argv += ["--mesh-shape", ",".join(map(str, hsdp_mesh_shape(n)))]
    return argv + ["--out", out]


def parity_config(argv: Sequence[str]):
    """The ``ParityConfig`` that ``jaxdp parity ARGV`` runs (the parity CLI's own parser)."""
    from parity_tests.command import add_parity_args, config_from_args

    parser = argparse.ArgumentParser(prog="jaxdp parity")
    add_parity_args(parser)
    return config_from_args(parser.parse_args(list(argv)))


def make_plan(mode: str, n: int, backend: str, dtypes: Sequence[str], strategies: Sequence[str], out: str, *,
              steps: Optional[int] = None, bench: bool = True, dry_run: bool = False,
              notes: Sequence[str] = ()) -> CheckPlan:
    from parity_tests.pairs import pair_for
    from parity_tests.plan import torch_layout

    settings = dict(SETTINGS[mode], **({"steps": steps} if steps else {}))
    gpus = n if backend == "nccl" else 0
    pairs = []
    for dtype in dtypes:
        for strategy in strategies:
            pid = f"{strategy}-{dtype}"
            pair_out = os.path.join(out, "pairs", pid)
            argv = parity_argv(strategy, dtype, n, backend, settings, pair_out)
            cfg = parity_config(argv)
            twin, world, _, _ = torch_layout(cfg, pair_for(strategy), gpus)
            pairs.append(PairPlan(pid, strategy, dtype, n, backend, twin, world, argv, pair_out))
    bench_plan = None
    if bench:
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
        bench_plan = {"strategy": BENCH_STRATEGY, "n": n, "config": cfg, "status": "PLANNED",
                      "command": f"JAXDP_TORCH_BACKEND={backend} jaxdp bench " + shlex.join(args)}
    return CheckPlan(mode, dry_run, n, backend, list(dtypes), list(strategies), out, list(notes), pairs, bench_plan)


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

    from parity_tests.bench.report import markdown
    from parity_tests.bench.runner import run_bench

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


# ----------------------------------------------------------------------------- the report

def environment(plan: CheckPlan) -> dict:
    env: Dict = {"python": sys.version.split()[0], "mode": plan.mode}
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
    return env


def to_json(plan: CheckPlan) -> dict:
    return {"status": overall(plan), "mode": plan.mode, "dry_run": plan.dry_run, "n": plan.n,
            "backend": plan.backend, "dtypes": plan.dtypes, "strategies": plan.strategies,
            "notes": plan.notes, "tf32": tf32_policy(plan), "environment": environment(plan),
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


def markdown(plan: CheckPlan) -> str:
    status = overall(plan)
    env = environment(plan)
    gpus = env.get("torch_gpus") or []
    where = (f"{plan.n} GPU(s): {', '.join(sorted(set(gpus[:plan.n])))}" if plan.mode == "gpu" and gpus else
             f"N = {plan.n} {'GPUs (planned)' if plan.mode == 'gpu' else 'simulated CPU devices'}")
    lines = [f"# gpu-check: {status}", "",
             f"- mode: {plan.mode}{' (dry run: nothing was run)' if plan.dry_run else ''}; {where}",
             f"- torch backend: {plan.backend} (rank r on {'cuda:r' if plan.backend == 'nccl' else 'the CPU'}); "
             f"jaxdp on " + (f"{env['jax_backend']} ({', '.join(sorted(set(env['jax_devices'])))})" if "jax" in env
                             else f"{plan.n} {'GPUs' if plan.mode == 'gpu' else 'CPU devices'} (planned)"),
             f"- TF32: {tf32_policy(plan)}",
             f"- dtypes: {', '.join(plan.dtypes)}; strategies: {', '.join(plan.strategies)}",
             f"- versions: torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), jax {env.get('jax', '?')}, "
             f"python {env['python']}"]
    lines += [f"- note: {n}" for n in plan.notes]
    lines += ["", "## Parity, per pair", "",
              "| pair | dtype | N | torch twin (ranks, backend) | torch devices | result | detail | s |",
              "|---|---|---|---|---|---|---|---|"]
    for p in plan.pairs:
        ranks = (p.details.get("devices") or {}).get("torch_ranks") or []
        devs = ", ".join(r["device"] for r in ranks) or (f"cuda:0..cuda:{p.n - 1} (planned)"
                                                          if p.backend == "nccl" else "cpu (planned)")
        msg = p.message.replace("|", "/").replace("\n", " ")[:240]
        lines.append(f"| {p.strategy} | {p.dtype} | {p.n} | {p.torch_twin} ({p.torch_ranks}, {p.backend}) | {devs} "
                     f"| **{p.status}** | {msg} | {_fmt(p.seconds, '.1f')} |")
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
    p.add_argument("--dry-run", action="store_true",
                   help="print and write the plan (pairs, N, dtypes, backend, commands); run nothing, no GPU needed")
    p.add_argument("--simulate", type=int, default=None, metavar="N",
                   help="run the plan on N simulated CPU JAX devices and N gloo torch ranks, tiny model (a CPU test "
                        "of the check itself; no GPU involved)")
    p.add_argument("--devices", type=int, default=None,
                   help="GPUs to use (default: every visible GPU; at least 2)")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma list (default: %(default)s)")
    p.add_argument("--dtypes", default=",".join(DTYPES),
                   help="comma list (default: %(default)s; float64 is skipped where the GPU does not compute it)")
    p.add_argument("--steps", type=int, default=None, help="parity steps per pair (default 4; --simulate 2)")
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
    strategies = _choices(args.strategies, STRATEGIES, "strategies")
    dtypes = _choices(args.dtypes, DTYPES, "dtypes")
    notes: List[str] = []
    if args.simulate is not None:
        n = args.simulate
        if n < 2:
            raise CheckRefused(f"--simulate needs N >= 2 devices, got {n}")
        if "jax" not in sys.modules:
            from jaxdp.mesh import simulate_cpu_devices

            os.environ["JAX_PLATFORMS"] = "cpu"
            simulate_cpu_devices(n)
        backend = args.backend or "gloo"
        if backend == "nccl":
            raise CheckRefused("--simulate runs torch on the CPU: its backend is gloo")
        notes.append(f"simulated: jaxdp on {n} CPU devices, torch_ref on {n} gloo ranks; a tiny model "
                     "(this checks the check, not a GPU)")
        return make_plan("simulate", n, backend, dtypes, strategies, args.out, steps=args.steps,
                         bench=args.bench, dry_run=args.dry_run, notes=notes)

    backend = args.backend or "nccl"
    # torch's ranks share the GPUs: JAX takes memory as it needs it (a dry run too: its plan reads
    # each strategy's facts from jaxdp, which imports jax)
    if "jax" not in sys.modules:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    gpus = torch_gpus()
    if args.dry_run:
        n = args.devices or (len(gpus) if len(gpus) >= 2 else 2)
        if len(gpus) < 2:
            notes.append(f"this machine has {len(gpus)} visible GPU(s): the plan is shown for N = {n}; "
                         "on a GPU host N = every visible GPU")
        if "float64" in dtypes:
            notes.append("float64 runs where the GPU computes it (probed on the JAX side before the run)")
        return make_plan("gpu", n, backend, dtypes, strategies, args.out, steps=args.steps, bench=args.bench,
                         dry_run=True, notes=notes)

    if len(gpus) < 2:
        raise CheckRefused(f"gpu-check needs at least 2 visible CUDA GPUs, torch sees {len(gpus)}"
                           f"{' (CUDA is not available)' if not gpus else ''}; see the plan with --dry-run, or "
                           "exercise the check on CPU with --simulate 2")
    n = args.devices or len(gpus)
    if not 2 <= n <= len(gpus):
        raise CheckRefused(f"--devices {n}: needs 2 <= N <= {len(gpus)} visible GPUs")
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
    return make_plan("gpu", n, backend, dtypes, strategies, args.out, steps=args.steps, bench=args.bench,
                     notes=notes)


def run(plan: CheckPlan, png: bool = True, log=print) -> str:
    """Run every pair and the bench row (not for a dry run); returns the overall status."""
    if not plan.dry_run:
        if any(p.dtype == "float64" for p in plan.pairs):
            import jax

            jax.config.update("jax_enable_x64", True)
        for i, pair in enumerate(plan.pairs):
            log(f"[{i + 1}/{len(plan.pairs)}] {pair.command}")
            run_pair(pair, png=png)
            log(f"    {pair.status}: {pair.message} ({pair.seconds:.1f}s)")
            write(plan)  # a report after every pair: an interrupted check still has one
        if plan.bench:
            log(f"[bench] {plan.bench['command']}")
            run_bench_row(plan)
            log(f"    {plan.bench['status']}: {plan.bench.get('message', '')}")
    return overall(plan)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parity_tests.gpu_check", description=__doc__.splitlines()[0])
    add_args(parser)
    args = parser.parse_args(argv)
    try:
        plan = prepare(args)
    except CheckRefused as e:
        print(f"gpu-check: error: {e}", file=sys.stderr)
        return 2
    print(f"gpu-check plan ({plan.mode}{', dry run' if plan.dry_run else ''}): N = {plan.n}, backend {plan.backend}, "
          f"dtypes {', '.join(plan.dtypes)}, {len(plan.pairs)} pair(s){' + 1 bench row' if plan.bench else ''}")
    for note in plan.notes:
        print(f"  note: {note}")
    if plan.dry_run:
        for p in plan.pairs:
            print(f"  {p.id:<16} torch {p.torch_twin} x{p.torch_ranks} ({p.backend}): {p.command}")
        if plan.bench:
            print(f"  {'bench':<16} {plan.bench['command']}")
    status = run(plan, png=args.png)
    print(f"gpu-check: {status}; wrote {', '.join(write(plan))}")
    if status == "DRY RUN":
        return 0
    return 0 if status == "PASS" else 1


if __name__ == "__main__":  # the guard matters: torch_ref's ranks re-import the main module
    sys.exit(main())
