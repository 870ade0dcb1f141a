"""What one parity run will do, resolved from a ``ParityConfig`` and the hardware: the pair,
the torch strategy and its ranks, both sides' options; what has no twin is refused here,
before anything runs.

Jax- and torch-free at import (torch is asked for its GPUs when a plan is made).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np

from parity_tests import pairs
from parity_tests.config import ParityConfig, ParityError
from parity_tests.pairs import JAX_ONLY_OPTIONS, PAIR_OPTIONS, Pair, pair_for

SYNC_BN_CPU = ("torch's SyncBatchNorm raises on CPU tensors, so the twin of --sync-bn here is "
               "torch in ONE process on the full global batch: the same math (BN statistics "
               "over all N*b images, gradients of the global mean loss, running stats of the "
               "full batch)")


@dataclass
class Plan:
    """What one run will do: resolved from a ParityConfig and the hardware."""

    cfg: ParityConfig
    pair: Pair
    torch_strategy: str
    world: int                      # torch ranks
    full_batch: bool                # torch gets the whole global batch on one rank (sync_bn on CPU)
    jax_options: Dict[str, Any]
    torch_config: Dict[str, Any]
    cuda: bool
    notes: List[str] = field(default_factory=list)
    powersgd_q: Optional[Dict[str, np.ndarray]] = None  # torch name -> initial Q
    backend: str = "gloo"           # the torch process group's: nccl (cuda:r per rank) or gloo (CPU)
    torch_ranks: Optional[List[dict]] = None  # each torch rank's launcher.rank_info, once it ran
    jax_x64: Optional[bool] = None  # whether jaxdp's side ran with 64-bit types, once it ran

    def to_json(self) -> dict:
        tc = {k: v for k, v in self.torch_config.items() if k != "powersgd_q"}
        return {"jaxdp": {"strategy": self.cfg.strategy, "options": jsonable(self.jax_options),
                          "devices": self.cfg.devices, "accum_steps": self.cfg.accum_steps,
                          "sync_bn": self.cfg.sync_bn, "x64": self.jax_x64},
                "torch": {"strategy": self.torch_strategy, "world": self.world,
                          "full_batch": self.full_batch, "config": jsonable(tc),
                          "backend": self.backend},
                "twin": self.pair.twin, "notes": self.notes}


def cuda_gpus() -> int:
    from torch_ref.dist import cuda_device_count  # torch when a plan is made, not at import

    return cuda_device_count()


def plan(cfg: ParityConfig, gpus: Optional[int] = None) -> Plan:
    """Resolve the pair for ``cfg``: torch strategy, ranks, options; refuse what has no twin.
    ``gpus``: the CUDA GPUs of the host the run is for (default: this one's), e.g. a GPU target's."""
    pair = _checked_pair(cfg)
    backend, gpus, (torch_strategy, world, full_batch, notes) = _torch_backend(cfg, pair, gpus)
    cuda = backend == "nccl"
    defaults = ParityConfig()
    jax_options = {n: getattr(cfg, n) for n in pair.options if getattr(cfg, n) != getattr(defaults, n)}
    tcfg = _torch_config(cfg, pair, torch_strategy, full_batch)
    if _one_process(torch_strategy) and world == 1 and cuda:
        tcfg["devices"] = cfg.devices  # nn.DataParallel's GPUs
    if cfg.allreduce != "psum":
        notes.append(f"jaxdp sums with allreduce={cfg.allreduce!r}; torch with the {'nccl' if cuda else 'gloo'} all-reduce")
    p = Plan(cfg, pair, torch_strategy, world, full_batch, jax_options, tcfg, cuda, notes, backend=backend)
    if cfg.compress == "powersgd":
        if "powersgd_options" not in pair.jax_takes:  # the shared initial Q goes through it
            raise ParityError(f"--compress powersgd has no parity run for {cfg.strategy!r}: its PowerSGD "
                              "cannot be seeded with torch's initial Q (use ddp or zero1)")
        _plan_powersgd(p)
    if cfg.torch_cudnn == "off":
        notes.append("torch without cuDNN (--torch-cudnn off): its own CUDA convolutions, as a reference")
    if full_batch:
        notes.append(f"torch runs '{torch_strategy}' on one rank with the full batch")
    return p


def _checked_pair(cfg: ParityConfig) -> Pair:
    """``cfg``'s pair, once every option is one it can run (ParityError, one line, if not)."""
    row = pairs.twin_row(cfg.strategy)
    if row is None:
        raise ParityError(f"no torch twin registered for strategy {cfg.strategy!r}; pairs: "
                          f"{', '.join(pairs.PAIRS)} (its jaxdp.registry row names its torch_twin)")
    pair = pair_for(row)
    try:
        cfg.model_summary()  # an unknown model, or an option of the other family, is the user's
    except ValueError as e:
        raise ParityError(str(e)) from None
    if cfg.dtype not in ("float32", "float64", "bfloat16"):
        raise ParityError(f"--dtype must be float32, float64 or bfloat16, got {cfg.dtype!r}")
    if cfg.steps < 1 or cfg.devices < 1 or cfg.accum_steps < 1 or cfg.batch_per_device < 1:
        raise ParityError("--steps, --devices, --accum-steps and --batch-per-device must be >= 1")
    if cfg.batch_per_device % cfg.accum_steps:
        raise ParityError(f"--batch-per-device {cfg.batch_per_device} is not divisible by "
                          f"--accum-steps {cfg.accum_steps}")
    if cfg.torch_cudnn not in ("on", "off"):
        raise ParityError(f"--torch-cudnn must be on or off, got {cfg.torch_cudnn!r}")
    if not 1 <= cfg.image_size <= 32:
        raise ParityError(f"--image-size must be in 1..32 (a centre crop of the 32x32 images), got {cfg.image_size}")
    defaults = ParityConfig()
    for name in PAIR_OPTIONS:
        if name not in pair.options and getattr(cfg, name) != getattr(defaults, name):
            raise ParityError(f"option --{name.replace('_', '-')} does not apply to pair {cfg.strategy!r} "
                              f"(it takes: {', '.join(pair.options) or 'none'})")
    err = pair.check(cfg) if pair.check is not None else None
    if err:
        raise ParityError(err)
    return pair


def _torch_config(cfg: ParityConfig, pair: Pair, torch_strategy: str, full_batch: bool) -> Dict[str, Any]:
    """torch_ref's step config (``jaxdp.config.step.StepConfig``, as a dict) for ``cfg``: the same
    names, the pair's options that the twin has a knob for, and the schedule over the run."""
    tcfg: Dict[str, Any] = dict(
        strategy=torch_strategy, model=cfg.model, **cfg.model_options(),
        num_classes=cfg.num_classes, dtype=cfg.dtype, optimizer=cfg.optimizer, lr=cfg.lr,
        momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay,
        betas=tuple(cfg.betas), eps=cfg.eps, clip_grad_norm=cfg.clip_grad_norm, schedule=cfg.schedule,
        total_steps=max(cfg.steps, cfg.warmup_steps + 1), warmup_steps=cfg.warmup_steps,
        accum_steps=cfg.accum_steps, sync_bn=cfg.sync_bn and not full_batch, seed=cfg.seed,
    )
    defaults = ParityConfig()
    for n in pair.options:
        if n not in JAX_ONLY_OPTIONS and getattr(cfg, n) != getattr(defaults, n):
            tcfg[n] = tuple(getattr(cfg, n)) if n == "mesh_shape" else getattr(cfg, n)
    return tcfg


def torch_layout(cfg: ParityConfig, pair: Pair, gpus: int):
    """(torch strategy, ranks, full batch on one rank?, notes) with ``gpus`` CUDA GPUs to use."""
    torch_strategy = pair.torch(cfg, gpus) if callable(pair.torch) else pair.torch
    one_process = _one_process(torch_strategy)
    notes = [pair.note] if pair.note and not one_process else []
    world, full_batch = cfg.devices, False
    if one_process:
        world = 1  # nn.DataParallel: one process driving N GPUs
    if cfg.sync_bn:
        if gpus and gpus >= cfg.devices:
            notes.append("torch: DDP-family + SyncBatchNorm on N CUDA ranks")
        else:
            world, full_batch = 1, True
            notes.append(SYNC_BN_CPU)
    return torch_strategy, world, full_batch, notes


def _one_process(torch_strategy: str) -> bool:
    """The twin is one process driving every device (nn.DataParallel: ``Twin.one_process``)."""
    from torch_ref.strategies import twin

    return twin(torch_strategy).one_process


def _torch_backend(cfg: ParityConfig, pair: Pair, gpus: Optional[int] = None):
    """(backend, GPUs used, ``torch_layout``) for ``cfg.backend`` (auto: ``JAXDP_TORCH_BACKEND``
    if set, else nccl when CUDA has a GPU for every torch rank, else gloo; see
    ``torch_ref.dist.resolve_backend``) on a host of ``gpus`` (default: this one's). gloo means
    the CPU, GPUs or not."""
    from torch_ref.dist import BackendError, resolve_backend

    gpus = cuda_gpus() if gpus is None else gpus
    side = torch_layout(cfg, pair, gpus)
    try:  # the ranks the twin needs with these GPUs; without any, every rank of the run on the CPU
        backend = resolve_backend(cfg.backend, side[1] if gpus else cfg.devices, gpus=gpus)
    except BackendError as e:
        raise ParityError(str(e)) from None
    if backend == "gloo" and gpus:  # gloo asked for, or auto with fewer GPUs than ranks: the CPU path
        gpus, side = 0, torch_layout(cfg, pair, 0)
    return backend, gpus, side


def _plan_powersgd(p: Plan) -> None:
    """PowerSGD's initial Q is random and drawn differently by each framework: draw one
    from numpy and hand it to both (torch: ``powersgd_q`` by param name; jaxdp:
    ``powersgd_options["initial_q"]`` by leaf name, torch layout)."""
    from parity_tests.inputs import torch_model
    from torch_ref.strategies import powersgd_shapes

    cfg = p.cfg
    shapes = powersgd_shapes(torch_model(cfg), cfg.powersgd_rank)
    rng = np.random.default_rng([cfg.seed, 0x5D6])
    dtype = np.float64 if cfg.dtype == "float64" else np.float32
    qs = {name: rng.standard_normal(shape).astype(dtype) for name, shape in sorted(shapes.items())}
    p.powersgd_q = qs
    p.torch_config.update(powersgd_q=qs, powersgd_start_iter=cfg.powersgd_start_iter,
                          powersgd_seed=cfg.seed)
    p.jax_options["powersgd_options"] = {"start_iter": cfg.powersgd_start_iter,
                                         "initial_q": {powersgd_leaf(name): q for name, q in qs.items()}}
    p.notes.append(f"PowerSGD: the same random initial Q on both sides; plain averaging for "
                   f"the first {cfg.powersgd_start_iter} steps, then rank-{cfg.powersgd_rank} compression")


def powersgd_leaf(torch_name: str) -> str:
    """torch param name -> jaxdp's PowerSGD leaf name ('layer1.0.conv1.weight' -> '...conv1.kernel')."""
    *module, leaf = torch_name.split(".")
    if leaf == "weight":
        # conv / linear weights are kernels; PowerSGD only ever compresses those (>= 2-D)
        leaf = "kernel"
    return ".".join(module + [leaf])


def jsonable(x):
    """``x`` with numpy values and non-finite floats made JSON-safe (arrays as their shape)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return f"array{tuple(x.shape)}"
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x
