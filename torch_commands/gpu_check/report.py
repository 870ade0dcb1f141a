"""The verdict and its report: ``report.md``, ``report.json`` and the table printed at the end.

The verdict cannot pass what did not run (``overall``):

=============  ==========================================================  ====
verdict        when                                                        exit
=============  ==========================================================  ====
PASS           every planned pair (and the bench row) ran and passed       0
FAIL           a pair or the bench row failed or errored                   1
INCOMPLETE     none failed, but a planned pair or row did not run          3
DRY RUN        ``--dry-run``: the plan only                                0
=============  ==========================================================  ====

(2 is a check refused before its plan: no GPU, bad options.)
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from typing import Dict, List

from torch_commands.gpu_check.hardware import torch_gpus, versions
from torch_commands.gpu_check.plan import SIMULATED, CheckPlan

EXIT = {"PASS": 0, "DRY RUN": 0, "FAIL": 1, "INCOMPLETE": 3}
FAILED = ("FAIL", "ERROR")


def statuses(plan: CheckPlan) -> List[str]:
    return [p.status for p in plan.pairs] + ([plan.bench["status"]] if plan.bench else [])


def overall(plan: CheckPlan) -> str:
    if plan.dry_run:
        return "DRY RUN"
    seen = statuses(plan)
    if any(s in FAILED for s in seen):
        return "FAIL"
    return "PASS" if seen and all(s == "PASS" for s in seen) else "INCOMPLETE"


def unfinished(plan: CheckPlan) -> List[str]:
    """'id: reason' of each planned pair or row that did not run (or is still only planned)."""
    rows = [(p.id, p.status, p.message) for p in plan.pairs]
    if plan.bench:
        rows.append(("bench " + plan.bench["strategy"], plan.bench["status"], plan.bench.get("message", "")))
    return [f"{pid}: {msg or status}" for pid, status, msg in rows if status not in ("PASS", *FAILED)]


def verdict_line(plan: CheckPlan) -> str:
    status = overall(plan)
    if status == "INCOMPLETE":
        missing = unfinished(plan)
        return (f"INCOMPLETE: {len(missing)} of {len(statuses(plan))} planned pair(s)/row(s) did not run "
                f"(none failed): " + "; ".join(m[:160] for m in missing))
    if status == "FAIL":
        failed = [p.id for p in plan.pairs if p.status in FAILED] + \
                 (["bench"] if plan.bench and plan.bench["status"] in FAILED else [])
        missing = unfinished(plan)
        return f"FAIL: {', '.join(failed)}" + (f"; {len(missing)} more did not run" if missing else "")
    return status


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
                   jax_default_matmul_precision=jax.config.jax_default_matmul_precision,
                   jax_compilation_cache_dir=jax.config.jax_compilation_cache_dir)
    env["JAXDP_TORCH_BACKEND"] = os.environ.get("JAXDP_TORCH_BACKEND")
    from parity_tests import parity_mode

    env["parity_mode"] = parity_mode.summary()
    return env


def to_json(plan: CheckPlan) -> dict:
    return {"status": overall(plan), "verdict": verdict_line(plan), "mode": plan.mode, "dry_run": plan.dry_run,
            "n": plan.n, "backend": plan.backend, "dtypes": plan.dtypes, "strategies": plan.strategies,
            "budget_s": plan.budget_s, "deadline_s": plan.deadline_s, "estimate_s": plan.estimate_s,
            "seconds": plan.seconds, "left_out": plan.left_out, "not_run": unfinished(plan) if not plan.dry_run else [],
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


def where(plan: CheckPlan, env: dict) -> str:
    gpus = env.get("torch_gpus") or []
    if plan.mode == "simulate":
        return f"N = {', '.join(map(str, plan.simulated_n))} on simulated CPU devices"
    if plan.mode == "rehearse":
        return "the one-GPU plan's GPU pairs on the CPU at N = 1 (a rehearsal: no GPU involved)"
    names = f": {', '.join(sorted(set(gpus[:plan.n])))}" if gpus else " (planned)"
    return f"{plan.n} GPU(s){names}" + (f"; N = {', '.join(map(str, plan.simulated_n))} on simulated CPU devices"
                                         if plan.simulated_n else "")


def _time_line(plan: CheckPlan) -> str:
    line = ((f"- time: estimated {plan.estimate_s:.0f} s (per-pair estimates, not yet measured on a GPU), budget "
             if plan.estimate_s else "- time: no estimate (a CPU's pace), budget ")
            + (f"{plan.budget_s:.0f} s" if plan.budget_s else "none")
            + (f", hard deadline {plan.deadline_s:.0f} s" if plan.deadline_s else ""))
    if plan.seconds is not None:
        line += f"; took {plan.seconds:.0f} s"
        if plan.budget_s and plan.seconds > plan.budget_s:
            line += f" (OVER the {plan.budget_s:.0f} s budget)"
    return line


def markdown(plan: CheckPlan) -> str:
    status = overall(plan)
    env = environment(plan)
    v = env["versions"]
    lines = [f"# gpu-check: {status}", "", f"**{verdict_line(plan)}**", "",
             f"- mode: {plan.mode}{' (dry run: nothing was run)' if plan.dry_run else ''}; {where(plan, env)}",
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
             _time_line(plan)]
    lines += [f"- note: {n}" for n in plan.notes]
    lines += ["", "## Parity, per pair", "",
              "| pair | where | size | dtype | N | torch twin (ranks, backend) | torch devices | result | detail | s (est.) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for p in plan.pairs:
        ranks = (p.details.get("devices") or {}).get("torch_ranks") or []
        devs = ", ".join(r["device"] for r in ranks) or (f"cuda:0..cuda:{p.n - 1} (planned)"
                                                          if p.backend == "nccl" else "cpu (planned)")
        msg = p.message.replace("|", "/").replace("\n", " ")[:240]
        place = {SIMULATED: "**simulated CPU**"}.get(p.where, p.where.upper() if p.where == "gpu" else p.where)
        lines.append(f"| {p.strategy} | {place} | {p.size} | {p.dtype} | {p.n} | {p.torch_twin} ({p.torch_ranks}, "
                     f"{p.backend}) | {devs} | **{p.status}** | {msg} | {_fmt(p.seconds, '.1f')} ({_fmt(p.estimate_s or None, '.0f')}) |")
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
    """The one table printed at the end: a line per pair (and the bench row), then the verdict."""
    rows = [f"{'pair':<34} {'where':<15} {'result':<8} {'s':>6}  detail"]
    for p in plan.pairs:
        rows.append(f"{p.id:<34} {p.where:<15} {p.status:<8} {_fmt(p.seconds, '6.1f'):>6}  {p.message[:100]}")
    if plan.bench:
        b = plan.bench
        rows.append(f"{'bench ' + b['strategy']:<34} {'gpu':<15} {b['status']:<8} {_fmt(b.get('seconds'), '6.1f'):>6}  "
                    f"{b.get('message', '')[:100]}")
    return "\n".join(rows + [verdict_line(plan)])


def write(plan: CheckPlan) -> List[str]:
    os.makedirs(plan.out, exist_ok=True)
    md, js = os.path.join(plan.out, "report.md"), os.path.join(plan.out, "report.json")
    with open(md, "w") as f:
        f.write(markdown(plan))
    with open(js, "w") as f:
        json.dump(to_json(plan), f, indent=1, default=str)
    return [md, js]
