"""The parity harness: run a jaxdp strategy and its PyTorch twin side by side, compare every step.

    jaxdp parity --strategy ddp --width 4 --blocks 1,1,1,1 --steps 20 --devices 2 \\
        --dtype float64 --optimizer sgd --nesterov --image-size 16 --out runs/parity
    python -m parity_tests ...            # the same

What one run does:

1. **Same weights.** The model is initialised once, in torch (``torch_ref.models.resnet``
   under ``torch.manual_seed(seed)``, torchvision's init), and converted to Flax with
   ``jaxdp.interop.variables_from_state_dict``; torch_ref loads the same state_dict.
2. **Same bytes.** One stream of per-rank numpy batches from the shared pipeline
   (``jaxdp.data.epoch_batches`` over the synthetic set, pad-crop/flip augmentation),
   with the epoch permutation drawn by torch itself (``torch.randperm`` seeded with
   ``seed + epoch``, exactly as ``DistributedSampler`` does) and passed explicitly.
   ``--image-size S`` keeps the centre S x S of each augmented 32 x 32 image (cheaper
   tests). jaxdp gets the NHWC arrays as they are; torch_ref transposes them to NCHW.
3. **K steps on each side.** jaxdp on N (simulated or real) devices with
   ``return_grads=True``; torch_ref through ``torch_ref.launcher.run_steps`` on its own
   ranks (gloo on CPU, nccl on GPU).
4. **Compare every step** (``parity_tests.compare``): the loss of every rank and the
   global loss; every averaged gradient; every parameter after the update; BN running
   stats; the optimizer state (``parity_tests.optim_state.torch_optimizer_state`` +
   ``jaxdp.interop.tree_to_torch_names``). A terminal table, ``report.json`` and
   ``parity.png`` go to ``--out``; the exit status is 1 when a bound is exceeded, and the
   message names the first tensor and step where the two sides part.

The pieces: ``config`` (``ParityConfig``), ``pairs`` (each strategy's twin), ``plan`` (what a
run will do, refused in one line where there is no twin), ``inputs`` (weights, batches),
``jax_side`` and ``torch_side`` (K steps each), ``compare``, ``report``; ``command`` is
``jaxdp parity``. This module runs one comparison: ``run_parity``.

Bounds (``parity_tests.compare``): float64, every tensor at every step rel <= 1e-10
(measured <= 2e-13 over 20 steps); float32, bounds from measured noise (see
``compare.FLOAT32``: every tensor at step 0, the loss at every step, the loss curves);
bf16/fp16 hooks on N > 2 ranks, step-0 tensors within the wire's rounding and every
gradient an exact wire value (``compare.low_precision_wire``).

GPU mode: the same runner, when CUDA is available to both sides: torch on nccl, rank r on
``cuda:r`` (the launcher gives it ``LOCAL_RANK=r``, ``LOCAL_WORLD_SIZE=N``), with TF32
off in every rank (``torch_ref.launcher.no_tf32``: ``allow_tf32 = False`` for matmuls and
cuDNN, and ``NVIDIA_TF32_OVERRIDE=0``, set by the rank itself since its forkserver may
predate this process's environment), JAX on the GPUs with
``jax_default_matmul_precision="highest"``. ``--backend`` picks the torch side's process
group: ``auto`` (default; ``JAXDP_TORCH_BACKEND`` if set, else nccl when there is a GPU for
every torch rank, else gloo), ``nccl`` (an error without one GPU per rank) or ``gloo``
(torch on the CPU, also on a GPU host). Both sides run in parity mode
(``parity_tests.parity_mode``: deterministic cuDNN engines chosen by heuristics, not
XLA's autotuner; set by ``jaxdp parity`` before JAX starts). The report states both
sides' devices, the backend, the TF32 and cuDNN flags each torch rank ran with, and whether
XLA started with parity mode's flags. ``make gpu-check``
(``torch_commands.gpu_check``) runs the whole set on every visible GPU.

Nothing here imports jax or torch at module level: ``jaxdp parity --devices N`` must set
XLA's simulated-device flag first.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from parity_tests.config import ParityConfig
from parity_tests.inputs import init_state_dict, make_batches
from parity_tests.jax_side import compile_step, configure_precision, run_jax
from parity_tests.plan import Plan, jsonable, plan
from parity_tests.torch_side import torch_records


@dataclass
class ParityResult:
    plan: Plan
    comparison: Any            # compare.Comparison
    jax_records: List[dict]
    torch_records: List[dict]
    seconds: Dict[str, float]
    bug: Optional[str] = None  # the bug injected into jaxdp, if any

    @property
    def passed(self) -> bool:
        """The comparison found no divergence."""
        return self.comparison.passed

    @property
    def missed_bug(self) -> bool:
        """A bug was injected and yet the sides agree: the harness or the injection is broken."""
        return self.bug is not None and self.passed

    @property
    def ok(self) -> bool:
        """What the run set out to show: parity, or with a bug injected, a divergence."""
        return self.passed and self.bug is None

    @property
    def divergence(self):
        return self.comparison.divergence

    def message(self) -> str:
        if self.missed_bug:
            return (f"bug {self.bug} was injected but no divergence was found: the harness or "
                    "the injection is broken")
        if self.passed:
            c = self.comparison
            bounded = [(e.rel_err, s.step, e.key) for s in c.steps for e in s.entries
                       if math.isfinite(e.bound)]
            free = [(e.rel_err, s.step, e.key) for s in c.steps for e in s.entries
                    if not math.isfinite(e.bound)]
            rel, step, key = max(bounded, default=(0.0, 0, "-"))
            msg = (f"parity OK: {len(c.steps)} steps, every bounded quantity within its "
                   f"{c.bounds.name} bound (largest rel err {rel:.1e}: {key} at step {step})")
            if free:
                rel, step, key = max(free)
                msg += (f"; not bounded ({c.bounds.name} tensors after step 0): largest "
                        f"{rel:.1e}, {key} at step {step}")
            return msg
        return self.divergence.message()

    def to_json(self) -> dict:
        from parity_tests.report import environment

        return {"config": jsonable(self.plan.cfg.to_json()), "plan": self.plan.to_json(),
                "passed": self.passed, "injected_bug": self.bug, "message": self.message(),
                "seconds": self.seconds,
                "environment": environment(self.plan.cuda, self.plan),
                "comparison": self.comparison.to_json()}


def bounds_for(p: Plan):
    """float64 or float32/bf16 bounds (``compare.DEFAULT_BOUNDS``), each float32/bf16 step-0 bound
    raised to this model's measured error budget where that is larger (``budgets.rows_for``:
    the rows of this model, crop size, optimizer, lr and schedule); with a bf16/fp16 hook, those adapted to the wire's
    rounding on ``p.world`` ranks (``compare.low_precision_wire``)."""
    import dataclasses

    from jaxdp import names
    from parity_tests import budgets, compare

    base = compare.DEFAULT_BOUNDS[p.cfg.dtype]
    if p.cfg.dtype == "bfloat16" and names.family(p.cfg.model).batchnorm:
        base = compare.BFLOAT16_BN
    if p.cfg.dtype in ("float32", "bfloat16"):
        rows = budgets.rows_for(p.cfg.model_summary(), p.cfg.image_size, (p.cfg.optimizer, p.cfg.lr, p.cfg.schedule))
        budget = budgets.step0_bounds(p.cfg.dtype, rows)
        if any(budget.get(c, 0.0) > v for c, v in base.first.items()):
            base = dataclasses.replace(base, first={c: max(v, budget.get(c, 0.0)) for c, v in base.first.items()},
                                       name=f"{base.name}, raised to the measured budget")
    if p.cfg.compress in compare.UNIT_ROUNDOFF:
        return compare.low_precision_wire(base, p.cfg.compress, p.world)
    return base


def _note_parity_mode(p: Plan) -> None:
    """On a GPU, say so in the report when XLA started without parity mode's flags (jax's
    backend existed before ``parity_mode.enable``): its convolutions were then autotuned."""
    import jax

    from parity_tests import parity_mode

    if jax.default_backend() == "gpu" and not parity_mode.xla_flags_in_effect():
        p.notes.append("parity mode's XLA flags were NOT in effect (jax's backend started before "
                       f"parity_tests.parity_mode.enable): set XLA_FLAGS='{' '.join(parity_mode.XLA_FLAGS)}' "
                       "before jax starts, or run jaxdp parity / python -m torch_commands.gpu_check")


def compile_for_target(cfg: ParityConfig, target):
    """``run_parity``'s jax side for ``cfg`` as a host of ``target`` (``jaxdp.runtime.target.Target``)
    would run it, compiled for the target's compile-only GPUs on this machine: that host's plan and
    matmul precision, one step's batch, the step from shapes (``jax_side.compile_step``). XLA takes this
    process's flags: parity mode's where ``parity_mode.enable`` ran before jax started, as in gpu-check.
    Returns (plan, the compiled step)."""
    from jaxdp.runtime.target import compile_only_devices

    p = plan(cfg, gpus=target.devices_per_host)
    configure_precision(p.cuda)
    return p, compile_step(p, make_batches(cfg)[0], compile_only_devices(target))


def run_parity(cfg: ParityConfig, *, reuse_torch: bool = False, bounds=None,
               jax_steps: Optional[int] = None, bug: Optional[str] = None) -> ParityResult:
    """Run both sides and compare them step by step.

    ``reuse_torch``: take the torch records from an earlier identical torch run in this
    process (``torch_side.torch_cache_key``), e.g. when several jaxdp pairs share one twin,
    or the injected bugs share the clean run's. ``jax_steps``: run only that many jaxdp steps
    and compare that prefix. ``bug``: a ``parity_tests.bugs.BUGS`` name, injected into jaxdp
    for this run only."""
    from parity_tests import bugs, compare

    p = plan(cfg)
    # Refused before anything runs: a bug that cannot apply would only "pass".
    injected = bugs.injection(bug, cfg) if bug is not None else contextlib.nullcontext()
    configure_precision(p.cuda)
    _note_parity_mode(p)
    t0 = time.perf_counter()
    sd = init_state_dict(cfg)
    batches = make_batches(cfg)
    t1 = time.perf_counter()
    # A comparison of the first ``jax_steps`` needs only those torch steps: the torch config
    # (its lr schedule's length included) stays the full run's, so they are its prefix.
    torch_steps = min(jax_steps or cfg.steps, cfg.steps)
    from_torch = torch_records(p, sd, batches, steps=torch_steps, reuse=reuse_torch)
    t2 = time.perf_counter()
    if bug is not None:
        p.notes.append(f"INJECTED BUG in jaxdp: {bugs.BUGS[bug].what}")
    with injected:
        jax_records = run_jax(p, sd, batches[:jax_steps] if jax_steps else batches)
    t3 = time.perf_counter()
    skip = ("loss_per_rank",) if p.world != cfg.devices else ()
    # Only the prefix asked for; a side that stopped short of it is still a failure.
    from_torch = from_torch[:jax_steps] if jax_steps else from_torch
    comparison = compare.compare_runs(jax_records, from_torch, bounds or bounds_for(p), skip)
    return ParityResult(p, comparison, jax_records, from_torch,
                        {"inputs": t1 - t0, "torch": t2 - t1, "jax": t3 - t2}, bug)
