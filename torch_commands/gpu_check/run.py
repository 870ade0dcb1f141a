"""Running a plan: the simulated child first (it needs no GPU, so it overlaps the GPU pairs),
then this process's pairs in the plan's order, then the bench row.

Nothing is cut by estimate here (the plan did that). The one stop is the hard deadline
(``CheckPlan.deadline_s``): a pair not started by then, and a simulated child still running
then, leave their pairs NOT RUN with the reason, which makes the verdict INCOMPLETE.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import traceback
from typing import Optional

from torch_commands.deadline import Deadline
from torch_commands.gpu_check.plan import CheckPlan, PairPlan, parity_config
from torch_commands.gpu_check.report import write


def not_run(pair: PairPlan, why: str) -> None:
    pair.status, pair.message = "NOT RUN", why


def run_pair(pair: PairPlan, png: bool = False) -> None:
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


def start_simulated(plan: CheckPlan, log=print) -> Optional[subprocess.Popen]:
    """The plan's simulated CPU pairs in a child process (``--simulate``), started now: this
    process's JAX is on the GPU, and a process's JAX devices are fixed when it starts."""
    sims = plan.in_child()
    if not sims:
        return None
    out = os.path.join(plan.out, "simulated")
    argv = [sys.executable, "-m", "torch_commands.gpu_check", "--simulate", ",".join(map(str, plan.simulated_n)),
            "--strategies", ",".join(dict.fromkeys(p.strategy for p in sims)),
            "--dtypes", ",".join(dict.fromkeys(p.dtype for p in sims)), "--no-bench", "--deadline", "0", "--out", out]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAXDP_TORCH_BACKEND")}
    env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="", JAXDP_TORCH_BACKEND="gloo")
    log(f"[simulated, in a child process from now on] {shlex.join(argv[1:])}  (JAX_PLATFORMS=cpu, torch on gloo)")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "child.log"), "w") as logfile:  # the child writes through its own copy
        return subprocess.Popen(argv, env=env, stdout=logfile, stderr=subprocess.STDOUT, text=True)


def finish_simulated(plan: CheckPlan, child: Optional[subprocess.Popen], clock: Deadline, log=print) -> None:
    """Wait for the child until the deadline, stop it there, and fill the simulated pairs from
    its report (written after each pair). A pair it did not report is NOT RUN, with the reason."""
    if child is None:
        return
    late = ""
    try:
        code = child.wait(timeout=clock.left())
    except subprocess.TimeoutExpired:
        child.kill()
        code = child.wait()
        late = f"deadline: the simulated child was stopped at {plan.deadline_s:.0f} s (--deadline 0: none)"
    out = os.path.join(plan.out, "simulated")
    done = {}
    try:
        with open(os.path.join(out, "report.json")) as f:
            done = {p["id"]: p for p in json.load(f)["pairs"]}
    except (OSError, ValueError, KeyError):
        pass
    for pair in plan.in_child():
        got = done.get(pair.id)
        if got is None or got["status"] in ("PLANNED", "NOT RUN"):
            not_run(pair, late or (got or {}).get("message") or
                    f"the simulated child (exit {code}) did not report it: {_tail(os.path.join(out, 'child.log'))}")
        else:
            pair.status, pair.message, pair.seconds = got["status"], got["message"], got["seconds"]
            pair.details = got["details"]
        log(f"    {pair.id}: {pair.status}: {pair.message[:160]}")


def _tail(path: str, chars: int = 800) -> str:
    try:
        with open(path) as f:
            return f.read()[-chars:]
    except OSError:
        return "(no log)"


def run_bench_row(plan: CheckPlan) -> None:
    """The multi-GPU plan's bench row: both sides timed (``run_bench``); an error on either side,
    or a side without a step time, fails it."""
    import jax

    from torch_commands.bench.report import markdown, problems, problems_markdown
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
            f.write(markdown(result) + problems_markdown(result) + "\n")
        rows = result["rows"]
        row = rows[0] if rows else {}
        j, t = row.get("jaxdp") or {}, row.get("torch_ref") or {}
        b.update(jaxdp_step_s=j.get("median_step_s"), torch_step_s=t.get("median_step_s"),
                 jaxdp_images_per_s=j.get("images_per_s"), torch_images_per_s=t.get("images_per_s"),
                 ratio_jax_over_torch=row.get("ratio_jax_over_torch"), torch_backend=t.get("backend"),
                 torch_compile_step_s=(row.get("torch_compile") or {}).get("median_step_s"),
                 ratio_jax_over_best_torch=row.get("ratio_jax_over_best_torch"),
                 device_kind=result["environment"].get("device_kind"), report=os.path.join(out, "bench.json"))
        errors = problems(result)["errors"]
        if not rows:
            b.update(status="FAIL", message=f"no row ran (N={plan.n} devices available?)")
        elif errors or not (j.get("median_step_s") and t.get("median_step_s")):
            b.update(status="FAIL", message="; ".join(e[:300] for e in errors) or "a side has no step time")
        else:
            b.update(status="PASS", message="both sides ran and were timed")
    except Exception as e:
        b.update(status="ERROR", message=f"{type(e).__name__}: {str(e)[-1500:]}")
    finally:
        jax.config.update("jax_default_matmul_precision", precision)
    b["seconds"] = time.perf_counter() - t0


def run_here(plan: CheckPlan, clock: Deadline, png: bool, log) -> None:
    """This process's pairs in the plan's order, each started only before the deadline."""
    here = plan.here()
    for i, pair in enumerate(here):
        if clock.passed():
            not_run(pair, f"{clock.why()} (--deadline 0: none)")
            log(f"[{i + 1}/{len(here)}] {pair.id}: NOT RUN ({pair.message})")
            continue
        log(f"[{i + 1}/{len(here)}] {pair.command}")
        run_pair(pair, png=png)
        estimate = f", estimated {pair.estimate_s:.0f}s" if pair.estimate_s else ""
        log(f"    {pair.status}: {pair.message} ({pair.seconds:.1f}s{estimate})")
        write(plan)  # a report after every pair: an interrupted check still has one


def run(plan: CheckPlan, png: bool = False, log=print) -> None:
    """Run every planned pair (the simulated ones in a child started first) and the bench row,
    up to the deadline; the plan's pairs carry the results. A dry run runs nothing."""
    if plan.dry_run:
        return
    clock = Deadline(plan.deadline_s)
    child = start_simulated(plan, log)
    try:
        run_here(plan, clock, png, log)
        finish_simulated(plan, child, clock, log)
    finally:  # an interrupted check leaves no child behind
        if child is not None and child.poll() is None:
            child.kill()
    if plan.bench:
        if clock.passed():
            plan.bench.update(status="NOT RUN", message=clock.why())
        else:
            log(f"[bench] {plan.bench['command']}")
            run_bench_row(plan)
            log(f"    {plan.bench['status']}: {plan.bench.get('message', '')}")
    plan.seconds = clock.elapsed()
