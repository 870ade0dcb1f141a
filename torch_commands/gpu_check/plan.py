"""What gpu-check runs: every pair decided, and fitted to the budget, before anything runs.

The plan is final: ``--dry-run`` prints exactly the pairs a run executes. Pairs the budget
cannot hold are *left out* here, by name, never cut at run time; a pair that a run then
fails to reach (the hard ``--deadline``) is NOT RUN and the verdict is INCOMPLETE
(``report.overall``).

- **One GPU**, in order of value: the realistic float32 ResNet-18 under every strategy (ddp,
  zero1, zero2, zero3, hsdp, dp), zero3 in bf16 (FSDP2's BatchNorm policy), ddp and zero3 in
  float64 at the realistic size, then the ViT in float32 and bf16 (``ONE_GPU``); beside them,
  in a child process started at time zero, the tiny pairs at N = 2 and 3 on simulated CPU
  devices with torch on gloo (``simulated_pairs``).
- **N >= 2 GPUs**: the tiny pairs at N in float32 and float64, then the realistic pairs at N
  in the same order of value, and one bench row.
- ``--full``: every realistic pair (both models, every strategy, every dtype), no budget.
- ``--rehearse``: the one-GPU plan's GPU pairs on the CPU at N = 1 (jax on CPU, torch on gloo),
  no budget: the slow CPU run that tries every pair before a GPU minute is spent on it.

Jax- and torch-free at import (torch is asked for each pair's twin when a plan is made).
"""

from __future__ import annotations

import argparse
import os
import shlex
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from jaxdp import registry
from jaxdp.runtime.mesh import MeshDims

TINY_DTYPES = ("float32", "float64")              # the tiny pairs on >= 2 GPUs
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
# The sizes people train: two steps each (float32 and bf16 bound every tensor at step 0 and
# the loss at every step; float64 every tensor at every step).
RESNET, VIT = "resnet18-w64", "vit-tiny"
REALISTIC = {
    RESNET: dict(model="resnet18", width=64, blocks="2,2,2,2", image_size=32, batch_per_device=64, steps=2, opt=SGD),
    VIT: dict(model="vit-tiny", image_size=32, batch_per_device=64, steps=2, opt=ADAMW),
}
# The one-GPU plan after the float32 ResNet under every strategy, in order of value: the FSDP2
# bf16 + BatchNorm policy made for the GPU, the semantic check at the real size, the ViT.
AFTER_EVERY_STRATEGY = ((RESNET, "bfloat16", "zero3"), (RESNET, "float64", "ddp"), (RESNET, "float64", "zero3"),
                        (VIT, "float32", "ddp"), (VIT, "bfloat16", "ddp"))

# Seconds per pair on one H100, compile and the torch rank's start included. ESTIMATES: no GPU
# has run this plan yet (the CPU rehearsal's seconds are in docs/parity.md and say nothing of a
# GPU's). Replace them with the first GPU run's report.json "seconds".
ESTIMATE_S: Dict[object, float] = {
    (RESNET, "float32"): 25.0, (RESNET, "bfloat16"): 30.0, (RESNET, "float64"): 30.0,
    (VIT, "float32"): 30.0, (VIT, "bfloat16"): 30.0, (VIT, "float64"): 35.0,
    "tiny": 8.0, "simulated": 8.0, "bench": 30.0,
}
STARTUP_S = 20.0        # JAX's GPU backend, torch's forkserver, the float64 probe
SIMULATED_STARTUP_S = 15.0  # the child's own jax and torch imports
BUDGET_S = 360.0        # the whole check in <= 6 minutes on one H100
DEADLINE_FACTOR = 1.5   # the run's hard stop, unless --deadline says otherwise
BENCH = {
    "gpu": dict(model="resnet18", width=16, blocks=None, per_device_batch=32, dtype="bfloat16", steps=10, warmup=2,
                torch_compile="inductor"),
    "simulate": dict(model="resnet18", width=4, blocks=(1, 1, 1, 1), per_device_batch=2, dtype="float32",
                     steps=2, warmup=1, torch_compile=None),
}
BENCH_STRATEGY = "ddp"

GPU, SIMULATED, REHEARSAL = "gpu", "simulated cpu", "cpu (rehearsal)"  # where a pair runs


def strategies() -> Tuple[str, ...]:
    """The registered strategies gpu-check pairs (``jaxdp.registry``, ``gpu_checked``)."""
    return registry.names(gpu_checked=True)


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
    where: str = GPU
    estimate_s: float = 0.0
    status: str = "PLANNED"          # PLANNED | PASS | FAIL | ERROR | NOT RUN
    message: str = ""
    seconds: Optional[float] = None
    details: Dict = field(default_factory=dict)

    @property
    def command(self) -> str:
        return "jaxdp parity " + shlex.join(self.argv)


@dataclass
class CheckPlan:
    mode: str                        # gpu | simulate | rehearse
    dry_run: bool
    n: int                           # GPUs used (simulate: the largest simulated N)
    backend: str
    dtypes: List[str]
    strategies: List[str]
    out: str
    notes: List[str]
    pairs: List[PairPlan]
    bench: Optional[Dict]            # {"config", "command", "status", ...}; None with --no-bench
    budget_s: float = BUDGET_S       # 0: no budget
    deadline_s: float = 0.0          # the run's hard stop (0: none); pairs not reached are NOT RUN
    left_out: List[str] = field(default_factory=list)  # pairs the budget left out: "id (~estimate)"
    simulated_n: List[int] = field(default_factory=list)  # N of the simulated CPU pairs (a child process)
    seconds: Optional[float] = None  # the whole run's wall time, once it ran

    def here(self) -> List[PairPlan]:
        """The pairs this process runs (a one-GPU plan's simulated pairs run in a child)."""
        return [p for p in self.pairs if p.where != SIMULATED or self.mode == "simulate"]

    def in_child(self) -> List[PairPlan]:
        return [p for p in self.pairs if p.where == SIMULATED and self.mode != "simulate"]

    @property
    def estimate_s(self) -> float:
        """Estimated wall time: this process's pairs (and bench row) after start-up, or the
        simulated child beside them if that takes longer (the two run at the same time)."""
        if self.mode == "rehearse":
            return 0.0  # the estimates are a GPU's; a CPU takes minutes per pair
        main = STARTUP_S + sum(p.estimate_s for p in self.here()) + (ESTIMATE_S["bench"] if self.bench else 0.0)
        child = self.in_child()
        return max(main, SIMULATED_STARTUP_S + sum(p.estimate_s for p in child)) if child else main


def parity_argv(strategy: str, dtype: str, n: int, backend: str, size: dict, out: str) -> List[str]:
    """The ``jaxdp parity`` arguments of one pair at one size (a TINY or REALISTIC entry)."""
    argv = ["--strategy", strategy, "--devices", str(n), "--dtype", dtype, "--backend", backend,
            "--model", size["model"]]
    if "width" in size:  # a ResNet's; a ViT's sizes are its name's (vit-tiny)
        argv += ["--width", str(size["width"]), "--blocks", size["blocks"]]
    argv += ["--image-size", str(size["image_size"]), "--batch-per-device", str(size["batch_per_device"]),
             "--steps", str(size["steps"]), *size["opt"]]
    if registry.row(strategy).replicas:  # what a user gets without --mesh-shape, named in the command
        argv += ["--mesh-shape", ",".join(map(str, MeshDims.hsdp_default(n)))]
    return argv + ["--out", out]


def parity_config(argv: Sequence[str]):
    """The ``ParityConfig`` that ``jaxdp parity ARGV`` runs (the parity CLI's own parser)."""
    from parity_tests.command import add_parity_args, config_from_args

    parser = argparse.ArgumentParser(prog="jaxdp parity")
    add_parity_args(parser)
    return config_from_args(parser.parse_args(list(argv)))


def make_pair(strategy: str, dtype: str, n: int, backend: str, size_name: str, size: dict, out: str, *,
              where: str = GPU, estimate_s: Optional[float] = None, pid: Optional[str] = None) -> PairPlan:
    """One planned pair: its command, and the torch twin and ranks that command will get."""
    from parity_tests.pairs import pair_for
    from parity_tests.plan import torch_layout

    pid = pid or f"{strategy}-{dtype}-{size_name}-n{n}"
    pair_out = os.path.join(out, "pairs", pid)
    argv = parity_argv(strategy, dtype, n, backend, size, pair_out)
    cfg = parity_config(argv)
    twin, world, _, _ = torch_layout(cfg, pair_for(strategy), n if backend == "nccl" else 0)
    if estimate_s is None:
        estimate_s = ESTIMATE_S.get((size_name, dtype), ESTIMATE_S["tiny"])
    return PairPlan(pid, strategy, dtype, n, backend, twin, world, argv, pair_out, size_name, where, estimate_s)


def realistic_order(chosen: Sequence[str], dtypes: Sequence[str], full: bool = False) -> List[Tuple[str, str, str]]:
    """(size, dtype, strategy) of the realistic pairs, most valuable first: the float32 ResNet
    under every strategy, then ``AFTER_EVERY_STRATEGY``; ``full``: then every other pair."""
    wanted = [(RESNET, "float32", s) for s in strategies()] + list(AFTER_EVERY_STRATEGY)
    if full:
        wanted += [(size, d, s) for size in REALISTIC for d in REALISTIC_DTYPES for s in strategies()]
    return [w for w in dict.fromkeys(wanted) if w[1] in dtypes and w[2] in chosen]


def simulated_pairs(ns: Sequence[int], dtypes: Sequence[str], chosen: Sequence[str], out: str,
                    steps: Optional[int] = None) -> List[PairPlan]:
    """The tiny pairs at each N on simulated CPU devices, torch on gloo."""
    size = dict(TINY["simulate"], **({"steps": steps} if steps else {}))
    return [make_pair(s, d, n, "gloo", "tiny", size, out, where=SIMULATED, estimate_s=ESTIMATE_S["simulated"],
                      pid=f"{s}-{d}-n{n}-simulated")
            for n in ns for d in dtypes for s in chosen]


def make_plan(mode: str, n: int, backend: str, dtypes: Sequence[str], chosen: Sequence[str], out: str, *,
              steps: Optional[int] = None, bench: bool = True, dry_run: bool = False, notes: Sequence[str] = (),
              budget_s: float = BUDGET_S, deadline_s: Optional[float] = None, simulated_n: Sequence[int] = (),
              realistic: bool = True, full: bool = False) -> CheckPlan:
    """The final plan. ``simulate``: the tiny pairs at each of ``simulated_n`` on CPU devices.
    ``rehearse``: the one-GPU plan's GPU pairs, on the CPU. ``gpu`` with n = 1: the realistic pairs,
    with the simulated N = 2, 3 pairs beside them; n >= 2: the tiny pairs at N = n, the realistic ones,
    one bench row. The realistic pairs that ``budget_s`` (0: none; ``full``: none) cannot hold are
    left out, named. ``deadline_s``: the run's hard stop (default ``DEADLINE_FACTOR`` x the budget)."""
    notes = list(notes)
    if mode == "simulate":  # at a CPU's own pace: no budget, a deadline only when asked
        pairs = simulated_pairs(simulated_n, dtypes, chosen, out, steps)
        return CheckPlan(mode, dry_run, max(simulated_n), backend, list(dtypes), list(chosen), out, notes, pairs,
                         _bench_plan("simulate", max(simulated_n), backend, out) if bench else None,
                         budget_s=0.0, deadline_s=deadline_s or 0.0, simulated_n=list(simulated_n))
    if mode == "rehearse":  # minutes per pair on a CPU: neither
        pairs = [make_pair(s, d, 1, "gloo", size, REALISTIC[size], out, where=REHEARSAL, estimate_s=0.0)
                 for size, d, s in realistic_order(chosen, dtypes, full)]
        return CheckPlan(mode, dry_run, 1, "gloo", list(dtypes), list(chosen), out, notes, pairs, None,
                         budget_s=0.0, deadline_s=0.0)
    budget_s = 0.0 if full else budget_s
    common = dict(budget_s=budget_s, deadline_s=DEADLINE_FACTOR * budget_s if deadline_s is None else deadline_s)
    tiny = dict(TINY["gpu"], **({"steps": steps} if steps else {}))
    pairs = [] if n == 1 else [make_pair(s, d, n, backend, "tiny", tiny, out, pid=f"{s}-{d}")
                               for d in dtypes if d in TINY_DTYPES for s in chosen]
    sims = simulated_pairs(SIMULATED_N, [d for d in SIMULATED_DTYPES if d in dtypes] or ["float64"],
                           chosen, out) if n == 1 else []
    plan = CheckPlan(mode, dry_run, n, backend, list(dtypes), list(chosen), out, notes, pairs + sims,
                     _bench_plan("gpu", n, backend, out) if bench and n >= 2 else None,
                     simulated_n=list(SIMULATED_N) if n == 1 else [], **common)
    for size, dtype, strategy in realistic_order(chosen, dtypes, full) if realistic else ():
        pair = make_pair(strategy, dtype, n, backend, size, REALISTIC[size], out)
        gpu_pairs = [p for p in plan.pairs if p.where == GPU]
        plan.pairs.insert(len(gpu_pairs), pair)  # the GPU pairs first, in order; the simulated ones last
        if budget_s and plan.estimate_s > budget_s:
            plan.pairs.remove(pair)
            plan.left_out.append(f"{pair.id} (~{pair.estimate_s:.0f} s)")
    if plan.left_out:
        plan.notes.append(f"{len(plan.left_out)} realistic pair(s) left out of the plan to stay within the "
                          f"{budget_s:.0f} s budget (estimated): {', '.join(plan.left_out)}; --full runs every "
                          "realistic pair")
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
