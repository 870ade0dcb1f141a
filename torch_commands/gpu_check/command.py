"""``python -m torch_commands.gpu_check`` (``make gpu-check``): its options, the checks before a
plan is made (refused in one line, exit 2), and the run."""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Sequence

from jaxdp.runtime.startup import backend_started
from torch_commands.gpu_check import hardware
from torch_commands.gpu_check.plan import (BUDGET_S, DEADLINE_FACTOR, REALISTIC_DTYPES, SIMULATED_DTYPES,
                                           TINY_DTYPES, CheckPlan, make_plan, strategies)
from torch_commands.gpu_check.report import EXIT, environment, overall, table, where, write
from torch_commands.gpu_check.run import run


class CheckRefused(Exception):
    """The check cannot run here as asked (one line, exit status 2)."""


def add_args(p: argparse.ArgumentParser) -> None:
    from jaxdp.config.flags import comma_ints

    p.add_argument("--dry-run", action="store_true",
                   help="print and write the plan (pairs, N, dtypes, backend, commands); run nothing, no GPU needed")
    p.add_argument("--simulate", type=comma_ints, default=None, metavar="N[,N...]",
                   help="run the tiny pairs at each N on simulated CPU JAX devices and gloo torch ranks (a CPU test "
                        "of the check, and the simulated part of a one-GPU host's check; no GPU involved)")
    p.add_argument("--rehearse", action="store_true",
                   help="run the one-GPU plan's GPU pairs on the CPU at N = 1 (jax on CPU, torch on gloo): slow "
                        "(about an hour on 2 cores), so that the first GPU run tests the GPU, not the plan")
    p.add_argument("--devices", type=int, default=None,
                   help="GPUs to use (default: every visible GPU; 1 runs the one-GPU plan on a bigger host)")
    p.add_argument("--strategies", default=",".join(strategies()), help="comma list (default: %(default)s)")
    p.add_argument("--dtypes", default=None,
                   help=f"comma list (default: {','.join(REALISTIC_DTYPES)} on GPUs, with the tiny pairs in "
                        f"{','.join(TINY_DTYPES)}; {','.join(SIMULATED_DTYPES)} with --simulate; float64 is left out "
                        "where the GPU does not compute it)")
    p.add_argument("--steps", type=int, default=None, help="parity steps per tiny pair (default 4; --simulate 2)")
    p.add_argument("--budget", dest="budget_s", type=float, default=BUDGET_S,
                   help="seconds the check may take by its per-pair estimates: the plan leaves out, by name, the "
                        "realistic pairs beyond it; 0: no limit (default %(default)s)")
    p.add_argument("--deadline", dest="deadline_s", type=float, default=None,
                   help=f"hard stop in seconds: pairs not started by then are NOT RUN and the verdict INCOMPLETE "
                        f"(default {DEADLINE_FACTOR:g} x the budget; 0: none)")
    p.add_argument("--full", action="store_true", help="every realistic pair (both models, every strategy and dtype), "
                                                       "no budget")
    p.add_argument("--no-realistic", dest="realistic", action="store_false",
                   help="only the tiny pairs (and, on one GPU, the simulated ones)")
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                   help="torch backend (default: nccl on GPUs, gloo with --simulate and --rehearse)")
    p.add_argument("--no-bench", dest="bench", action="store_false", help="skip the benchmark row")
    p.add_argument("--png", action="store_true", help="also write each pair's parity.png (outside the budget)")
    p.add_argument("--out", default="runs/gpu-check", help="report.md, report.json, pairs/, bench/ (default %(default)s)")


def _choices(text: str, allowed: Sequence[str], what: str) -> List[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise CheckRefused(f"--{what} must be a comma list of {', '.join(allowed)}, got {text!r}")
    return items


def _jax_on_cpu_before_it_starts() -> None:
    if "jax" not in sys.modules:
        os.environ["JAX_PLATFORMS"] = "cpu"


def prepare_simulate(args, chosen: List[str]) -> CheckPlan:
    ns = sorted(set(args.simulate))
    if ns[0] < 2:
        raise CheckRefused(f"--simulate needs N >= 2 devices, got {args.simulate}")
    dtypes = _choices(args.dtypes or ",".join(SIMULATED_DTYPES), REALISTIC_DTYPES, "dtypes")
    if (args.backend or "gloo") == "nccl":
        raise CheckRefused("--simulate runs torch on the CPU: its backend is gloo")
    if "jax" not in sys.modules:
        from jaxdp.runtime.mesh import simulate_cpu_devices

        _jax_on_cpu_before_it_starts()
        simulate_cpu_devices(ns[-1])
    notes = [f"simulated: jaxdp on CPU devices, torch_ref on gloo ranks, N = {', '.join(map(str, ns))}; a tiny "
             "model (this checks the pairs' strategies at N > 1, not a GPU)"]
    return make_plan("simulate", ns[-1], "gloo", dtypes, chosen, args.out, steps=args.steps, bench=args.bench,
                     dry_run=args.dry_run, notes=notes, simulated_n=ns, deadline_s=args.deadline_s)


def prepare_rehearsal(args, chosen: List[str]) -> CheckPlan:
    from parity_tests import parity_mode

    dtypes = _choices(args.dtypes or ",".join(REALISTIC_DTYPES), REALISTIC_DTYPES, "dtypes")
    if (args.backend or "gloo") == "nccl":
        raise CheckRefused("--rehearse runs torch on the CPU: its backend is gloo")
    _jax_on_cpu_before_it_starts()
    parity_mode.enable()  # what the GPU run sets (no number changes on a CPU)
    notes = ["rehearsal: the one-GPU plan's GPU pairs, each run on the CPU at N = 1 (jaxdp on XLA:CPU, torch on "
             "gloo); the times are a CPU's, not a GPU's"]
    return make_plan("rehearse", 1, "gloo", dtypes, chosen, args.out, dry_run=args.dry_run, notes=notes,
                     full=args.full)


def prepare_gpu(args, chosen: List[str]) -> CheckPlan:
    from jaxdp.run.perf import enable_compile_cache
    from parity_tests import parity_mode

    dtypes = _choices(args.dtypes or ",".join(REALISTIC_DTYPES), REALISTIC_DTYPES, "dtypes")
    backend = args.backend or "nccl"
    # before JAX starts: parity mode's XLA flags; JAX takes GPU memory as it needs it, torch's ranks
    # share the GPUs (a dry run too: its plan reads each strategy's facts from jaxdp, which imports jax)
    if not backend_started():
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    parity_mode.enable()
    gpus = hardware.torch_gpus()
    notes: List[str] = []
    options = dict(steps=args.steps, bench=args.bench, budget_s=args.budget_s, deadline_s=args.deadline_s,
                   realistic=args.realistic, full=args.full)
    if args.dry_run:
        n = args.devices or (len(gpus) if gpus else 2)
        if not gpus:
            notes.append(f"this machine has no visible GPU: the plan is shown for N = {n} GPUs; on a GPU host N = "
                         "every visible GPU (1 GPU: the one-GPU plan, --devices 1 shows it)")
        if "float64" in dtypes:
            notes.append("float64 runs where the GPU computes it (probed on the JAX side before the run)")
        return make_plan("gpu", n, backend, dtypes, chosen, args.out, dry_run=True, notes=notes, **options)

    if not gpus:
        raise CheckRefused("gpu-check needs a visible CUDA GPU, torch sees 0 (CUDA is not available); see the plan "
                           "with --dry-run, or exercise the check on CPU with --simulate 2,3 or --rehearse")
    n = args.devices or len(gpus)
    if not 1 <= n <= len(gpus):
        raise CheckRefused(f"--devices {n}: needs 1 <= N <= {len(gpus)} visible GPUs")
    if backend == "gloo":
        notes.append("torch on gloo: the torch side runs on the CPU, the JAX side on the GPUs")
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        raise CheckRefused("JAX_PLATFORMS=cpu hides the GPUs from JAX: unset it (make gpu-check does)")
    jax_backend, jgpus = hardware.jax_gpus()
    if len(jgpus) < n:
        raise CheckRefused(f"JAX sees {len(jgpus)} GPU(s) (default backend {jax_backend}) but torch sees {len(gpus)}: "
                           "install JAX's CUDA build (pip install -e '.[gpu]'; make gpu-check does) and give both "
                           "the same CUDA_VISIBLE_DEVICES")
    cache = enable_compile_cache(True)  # a rerun on this host loads its programs instead of compiling them
    notes.append(f"JAX's persistent compilation cache: {cache}")
    if "float64" in dtypes:
        ok, why = hardware.jax_float64_ok()
        if not ok:
            dtypes = [d for d in dtypes if d != "float64"]
            notes.append(f"float64 left out of the plan: this GPU does not compute it under JAX ({why})")
        else:
            notes.append("float64: supported here (probed: a float64 matmul on the GPU under JAX)")
    if not dtypes:
        raise CheckRefused("no dtype left to run: " + "; ".join(notes[-1:]))
    return make_plan("gpu", n, backend, dtypes, chosen, args.out, notes=notes, **options)


def prepare(args) -> CheckPlan:
    """Decide mode, N, backend and dtypes (refusing what cannot run) and make the final plan; set
    JAX up before it starts."""
    chosen = _choices(args.strategies, strategies(), "strategies")
    if args.simulate is not None and args.rehearse:
        raise CheckRefused("--simulate and --rehearse are two different runs: choose one")
    if args.simulate is not None:
        return prepare_simulate(args, chosen)
    if args.rehearse:
        return prepare_rehearsal(args, chosen)
    return prepare_gpu(args, chosen)


def print_plan(plan: CheckPlan) -> None:
    env = environment(plan)
    print("gpu-check found: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v) +
          f"; torch GPUs: {env.get('torch_gpus') or 'none'}; jax devices: {env.get('jax_devices', 'not started')}")
    print(f"gpu-check plan ({plan.mode}{', dry run' if plan.dry_run else ''}): {where(plan, env)}, backend "
          f"{plan.backend}, dtypes {', '.join(plan.dtypes)}, {len(plan.pairs)} pair(s)"
          f"{' + 1 bench row' if plan.bench else ''}, "
          + (f"estimated {plan.estimate_s:.0f} s" if plan.estimate_s else "no estimate (a CPU's pace)")
          + f" (budget {f'{plan.budget_s:.0f} s' if plan.budget_s else 'none'}"
          f"{f', deadline {plan.deadline_s:.0f} s' if plan.deadline_s else ''})")
    for note in plan.notes:
        print(f"  note: {note}")
    if plan.dry_run:
        for p in plan.pairs:
            print(f"  {p.id:<34} {p.where:<15} ~{p.estimate_s:3.0f}s torch {p.torch_twin} x{p.torch_ranks} "
                  f"({p.backend}): {p.command}")
        if plan.bench:
            print(f"  {'bench':<34} {plan.bench['command']}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_commands.gpu_check",
                                     description="every strategy's parity with its PyTorch twin on the GPUs at hand")
    add_args(parser)
    args = parser.parse_args(argv)
    try:
        plan = prepare(args)
    except CheckRefused as e:
        print(f"gpu-check: error: {e}", file=sys.stderr)
        return 2
    print_plan(plan)
    run(plan, png=args.png)
    if not plan.dry_run:
        print(table(plan))
    status = overall(plan)
    print(f"gpu-check: {status}; wrote {', '.join(write(plan))}")
    return EXIT[status]
