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
   stats; the optimizer state (``jaxdp.optim.torch_optimizer_state`` +
   ``jaxdp.interop.tree_to_torch_names``). A terminal table, ``report.json`` and
   ``parity.png`` go to ``--out``; the exit status is 1 when a bound is exceeded, and the
   message names the first tensor and step where the two sides part.

Pairs: jaxdp strategy -> its PyTorch twin
=========================================

``pair_for`` builds each row from the strategy's facts (``jaxdp.strategies.facts``); a later
strategy plugs in by adding its name to ``PAIRS`` (and, if it has options of its own, rows to ``OPTIONS``).

==========================  ==============================================  ======  =================================
jaxdp                       torch_ref (PyTorch)                             ranks   notes
==========================  ==============================================  ======  =================================
ddp                         DistributedDataParallel, broadcast_buffers      N       BN: per-rank stats, rank 0's
                                                                                    running stats
ddp --accum-steps K         DDP, ``no_sync()`` on K-1 micro-steps           N       loss/K per micro-step
ddp --sync-bn               CUDA: DDP + SyncBatchNorm (N ranks);            N / 1   SyncBatchNorm raises on CPU
                            CPU: ONE process on the full global batch               tensors; full-batch BN is the
                                                                                    same math (global statistics)
ddp --allreduce ring        DDP (gloo/nccl all-reduce)                      N       ring of ppermutes vs library
ddp --compress bf16|fp16    DDP + ``bf16/fp16_compress_hook``               N       bounds at the wire's precision
ddp --compress powersgd     DDP + ``powerSGD_hook`` (error feedback, warm   N       same initial Q fed to both sides
                            start, start_iter 2)
zero1                       DDP + ``ZeroRedundancyOptimizer``               N       the ddp rows' all-reduce options
                                                                                    too: one AllReduce on both sides
zero2                       FSDP2 ``fully_shard(reshard_after_forward=      N       per block + root
                            False)``
zero3                       FSDP2 ``fully_shard(reshard_after_forward=      N
                            True)``
hsdp --mesh-shape R,S       FSDP2 on a 2-D DeviceMesh (replicate, shard)    R*S
dp                          ``nn.DataParallel`` with >= N GPUs; else DDP    1 / N   DataParallel's math is DDP's:
                            on N ranks                                              per-chunk BN, chunk 0's running
                                                                                    stats, averaged gradients
async --staleness 0         DDP                                             N       k > 0 has no torch twin (refused)
==========================  ==============================================  ======  =================================

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
(torch on the CPU, also on a GPU host). The report states both sides' devices, the
backend and the TF32 flags each torch rank ran with. ``make gpu-check``
(``parity_tests.gpu_check``) runs the whole set on every visible GPU.

Nothing here imports jax or torch at module level: ``jaxdp parity --devices N`` must set
XLA's simulated-device flag first.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np


class ParityError(ValueError):
    """A parity run that cannot be set up as asked (unknown pair, impossible option)."""


# ----------------------------------------------------------------------------- configuration

@dataclass
class ParityConfig:
    strategy: str = "ddp"
    # model
    model: str = "resnet18"
    width: int = 4
    blocks: Optional[Tuple[int, ...]] = (1, 1, 1, 1)
    stem: str = "cifar"
    # ViT sizes (None keeps the named model's); image_size below sets its position embeddings
    depth: Optional[int] = None
    dim: Optional[int] = None
    heads: Optional[int] = None
    mlp_dim: Optional[int] = None
    patch: Optional[int] = None
    num_classes: int = 10
    dtype: str = "float64"
    # run
    steps: int = 5
    devices: int = 2
    batch_per_device: int = 8
    image_size: int = 32
    dataset_size: int = 256
    seed: int = 0
    # optimisation
    optimizer: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    schedule: str = "constant"
    warmup_steps: int = 0
    # strategy
    accum: int = 1
    sync_bn: bool = False
    bucket_cap_mb: float = 25.0
    allreduce: str = "psum"
    compress: Optional[str] = None
    powersgd_rank: int = 1
    powersgd_start_iter: int = 2
    staleness: int = 0
    mesh_shape: Optional[Tuple[int, int]] = None
    # harness
    timeout_s: float = 300.0
    backend: str = "auto"           # torch side: auto | nccl | gloo (torch_ref.dist.resolve_backend)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def model_options(self) -> Dict[str, Any]:
        """The options of this model's family, as both ``create_model``s take them."""
        from jaxdp.models import family

        sizes = dict(depth=self.depth, dim=self.dim, heads=self.heads, mlp_dim=self.mlp_dim, patch=self.patch)
        if family(self.model) == "resnet":
            given = [k for k, v in sizes.items() if v is not None]
            if given:
                raise ValueError(f"{', '.join(given)} size a ViT, not {self.model}")
            return dict(width=self.width, blocks=tuple(self.blocks) if self.blocks else None, stem=self.stem)
        return {**{k: v for k, v in sizes.items() if v is not None}, "image_size": self.image_size}

    def model_summary(self) -> str:
        """'resnet18 width 4 blocks (1, 1, 1, 1)' or 'vit-tiny depth 2 dim 16 ...' for reports."""
        opts = {k: v for k, v in self.model_options().items() if k not in ("stem", "image_size")}
        return " ".join([self.model, *(f"{k} {v}" for k, v in opts.items())])


@dataclass(frozen=True)
class Option:
    """A strategy option: its default, the jaxdp constructor keyword and the torch_ref
    config key it maps to (None: the torch twin has no such knob; any value is fine)."""

    default: Any
    jax: Optional[str]
    torch: Optional[str]


OPTIONS: Dict[str, Option] = {
    "bucket_cap_mb": Option(25.0, "bucket_cap_mb", "bucket_cap_mb"),
    "allreduce": Option("psum", "allreduce", None),  # how jaxdp sums; gloo/nccl pick their own
    "compress": Option(None, "compress", "compress"),
    "powersgd_rank": Option(1, "powersgd_rank", "powersgd_rank"),
    "staleness": Option(0, "staleness", None),
    "mesh_shape": Option(None, "mesh_shape", "mesh_shape"),
}


@dataclass(frozen=True)
class Pair:
    """One row of the strategy -> torch twin table, built by ``pair_for`` from the strategy's facts.

    ``twin``: the torch twin in words. ``torch``: torch_ref strategy name, or a function
    ``(cfg, cuda_gpus) -> name`` when the twin depends on the hardware. ``options``: the
    ``OPTIONS`` this pair accepts; others must stay at their defaults. ``check``: refuses
    configurations with no twin (returns an error).
    """

    twin: str
    torch: Any
    options: Tuple[str, ...] = ()
    check: Optional[Callable[["ParityConfig"], Optional[str]]] = None
    note: str = ""


# The strategies paired: all of jaxdp.strategies.STRATEGIES (test_parity checks), named here
# because this module must not import jax. ``pair_for`` reads a pair's facts when a run needs them.
PAIRS = ("ddp", "zero1", "zero2", "zero3", "hsdp", "dp", "async")

DP_NOTE = ("without N GPUs nn.DataParallel cannot split the batch, so the twin is DDP, whose math is "
           "DataParallel's: per-chunk BN statistics, chunk/rank 0's running stats, gradients averaged over chunks")


def pair_for(name: str) -> Pair:
    """``name``'s row: its twin from its facts (``jaxdp.strategies.facts``); the options both its
    jaxdp constructor (``options_of``) and its torch_ref twin (``STRATEGY_OPTIONS``) take."""
    from jaxdp.strategies import facts, options_of
    from torch_ref.strategies import STRATEGY_OPTIONS

    f = facts(name)
    jax_takes, torch_takes = options_of(name), STRATEGY_OPTIONS[f.torch_twin]
    options = tuple(n for n, o in OPTIONS.items() if o.jax in jax_takes and (o.torch is None or o.torch in torch_takes))
    if name == "dp":  # nn.DataParallel splits the batch over GPUs: without them, DDP
        return Pair(f"{f.twin} (>= N GPUs), else DDP on N ranks: the same math", _dp_torch, options, note=DP_NOTE)
    return Pair(f.twin, f.torch_twin, options, _twin_check(name, f.twin_when, f.twin) if f.twin_when else None)


def _twin_check(name: str, twin_when: Mapping[str, Any], twin: str):
    """Refuses the options under which ``name`` has no twin (its ``facts.twin_when``)."""
    def check(cfg: ParityConfig) -> Optional[str]:
        for flag, opt in OPTIONS.items():
            if opt.jax in twin_when and getattr(cfg, flag) != twin_when[opt.jax]:
                return f"{name} with {flag} {getattr(cfg, flag)} has no PyTorch twin; its twin: {twin}"
        return None
    return check


def _dp_torch(cfg: ParityConfig, cuda_gpus: int) -> str:
    return "dp" if cuda_gpus >= max(cfg.devices, 2) else "ddp"


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
        return {"jaxdp": {"strategy": self.cfg.strategy, "options": _jsonable(self.jax_options),
                          "devices": self.cfg.devices, "accum_steps": self.cfg.accum,
                          "sync_bn": self.cfg.sync_bn, "x64": self.jax_x64},
                "torch": {"strategy": self.torch_strategy, "world": self.world,
                          "full_batch": self.full_batch, "config": _jsonable(tc),
                          "backend": self.backend},
                "twin": self.pair.twin, "notes": self.notes}


def cuda_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def plan(cfg: ParityConfig) -> Plan:
    """Resolve the pair for ``cfg``: torch strategy, ranks, options; refuse what has no twin."""
    if cfg.strategy not in PAIRS:
        raise ParityError(f"no torch twin registered for strategy {cfg.strategy!r}; pairs: "
                          f"{', '.join(PAIRS)} (add its name to parity_tests.runner.PAIRS)")
    pair = pair_for(cfg.strategy)
    try:
        cfg.model_summary()  # an unknown model, or an option of the other family, is the user's
    except ValueError as e:
        raise ParityError(str(e)) from None
    if cfg.dtype not in ("float32", "float64", "bfloat16"):
        raise ParityError(f"--dtype must be float32, float64 or bfloat16, got {cfg.dtype!r}")
    if cfg.steps < 1 or cfg.devices < 1 or cfg.accum < 1 or cfg.batch_per_device < 1:
        raise ParityError("--steps, --devices, --accum-steps and --batch-per-device must be >= 1")
    if cfg.batch_per_device % cfg.accum:
        raise ParityError(f"--batch-per-device {cfg.batch_per_device} is not divisible by --accum-steps {cfg.accum}")
    if not 1 <= cfg.image_size <= 32:
        raise ParityError(f"--image-size must be in 1..32 (a centre crop of the 32x32 images), got {cfg.image_size}")
    for name, opt in OPTIONS.items():
        value = getattr(cfg, name)
        if name not in pair.options and value != opt.default:
            raise ParityError(f"option --{name.replace('_', '-')} does not apply to pair {cfg.strategy!r} "
                              f"(it takes: {', '.join(pair.options) or 'none'})")
    if pair.check is not None:
        err = pair.check(cfg)
        if err:
            raise ParityError(err)

    backend, gpus, (torch_strategy, world, full_batch, notes) = _torch_backend(cfg, pair)
    cuda = backend == "nccl"

    jax_options = {OPTIONS[n].jax: getattr(cfg, n) for n in pair.options
                   if getattr(cfg, n) != OPTIONS[n].default}
    tcfg: Dict[str, Any] = dict(
        strategy=torch_strategy, model=cfg.model, **cfg.model_options(),
        num_classes=cfg.num_classes, dtype=cfg.dtype, optimizer=cfg.optimizer, lr=cfg.lr,
        momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay,
        betas=tuple(cfg.betas), eps=cfg.eps, schedule=cfg.schedule,
        total_steps=max(cfg.steps, cfg.warmup_steps + 1), warmup_steps=cfg.warmup_steps,
        accum_steps=cfg.accum, sync_bn=cfg.sync_bn and not full_batch, seed=cfg.seed,
    )
    if torch_strategy == "dp" and world == 1 and cuda:
        tcfg["devices"] = cfg.devices
    for n in pair.options:
        key = OPTIONS[n].torch
        if key is not None and getattr(cfg, n) != OPTIONS[n].default:
            tcfg[key] = tuple(getattr(cfg, n)) if n == "mesh_shape" else getattr(cfg, n)
    if cfg.allreduce != "psum":
        notes.append(f"jaxdp sums with allreduce={cfg.allreduce!r}; torch with the {'nccl' if cuda else 'gloo'} all-reduce")
    p = Plan(cfg, pair, torch_strategy, world, full_batch, jax_options, tcfg, cuda, notes, backend=backend)
    if cfg.compress == "powersgd":
        from jaxdp.strategies import options_of

        if "powersgd_options" not in options_of(cfg.strategy):  # the shared initial Q goes through it
            raise ParityError(f"--compress powersgd has no parity run for {cfg.strategy!r}: its PowerSGD "
                              "cannot be seeded with torch's initial Q (use ddp or zero1)")
        _plan_powersgd(p)
    if full_batch and cfg.strategy != "ddp":
        notes.append(f"torch runs '{torch_strategy}' on one rank with the full batch")
    return p


def _torch_side(cfg: ParityConfig, pair: Pair, gpus: int):
    """(torch strategy, ranks, full batch on one rank?, notes) with ``gpus`` CUDA GPUs to use."""
    torch_strategy = pair.torch(cfg, gpus) if callable(pair.torch) else pair.torch
    notes = [pair.note] if pair.note and torch_strategy != "dp" else []
    world, full_batch = cfg.devices, False
    if torch_strategy == "dp":
        world = 1  # nn.DataParallel: one process driving N GPUs
    if cfg.sync_bn:
        if gpus and gpus >= cfg.devices:
            notes.append("torch: DDP-family + SyncBatchNorm on N CUDA ranks")
        else:
            world, full_batch = 1, True
            notes.append(SYNC_BN_CPU)
    return torch_strategy, world, full_batch, notes


def _torch_backend(cfg: ParityConfig, pair: Pair):
    """(backend, GPUs used, ``_torch_side``) for ``cfg.backend`` (auto: ``JAXDP_TORCH_BACKEND``
    if set, else nccl when CUDA has a GPU for every torch rank, else gloo; see
    ``torch_ref.dist.resolve_backend``). gloo means the CPU, GPUs or not."""
    from torch_ref.dist import BackendError, resolve_backend

    gpus = cuda_gpus()
    try:
        if resolve_backend(cfg.backend, 1 if gpus else cfg.devices) == "gloo":  # asked for, or no GPU
            gpus = 0
        side = _torch_side(cfg, pair, gpus)
        backend = resolve_backend(cfg.backend, side[1]) if gpus else "gloo"
    except BackendError as e:
        raise ParityError(str(e)) from None
    if backend == "gloo" and gpus:  # auto with fewer GPUs than ranks: the CPU path
        gpus, side = 0, _torch_side(cfg, pair, 0)
    return backend, gpus, side


def _plan_powersgd(p: Plan) -> None:
    """PowerSGD's initial Q is random and drawn differently by each framework: draw one
    from numpy and hand it to both (torch: ``powersgd_q`` by param name; jaxdp:
    ``powersgd_options["initial_q"]`` by leaf name, torch layout)."""
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
                                         "initial_q": {_leaf(name): q for name, q in qs.items()}}
    p.notes.append(f"PowerSGD: the same random initial Q on both sides; plain averaging for "
                   f"the first {cfg.powersgd_start_iter} steps, then rank-{cfg.powersgd_rank} compression")


def _leaf(torch_name: str) -> str:
    """torch param name -> jaxdp's PowerSGD leaf name ('layer1.0.conv1.weight' -> '...conv1.kernel')."""
    *module, leaf = torch_name.split(".")
    if leaf == "weight":
        # conv / linear weights are kernels; PowerSGD only ever compresses those (>= 2-D)
        leaf = "kernel"
    return ".".join(module + [leaf])


# ----------------------------------------------------------------------------- inputs

def torch_model(cfg: ParityConfig):
    """The torch-initialised model (float32, CPU): its family's torch init under ``manual_seed(seed)``."""
    import torch

    from torch_ref.models import create_model

    torch.manual_seed(cfg.seed)
    return create_model(cfg.model, num_classes=cfg.num_classes, **cfg.model_options())


def init_state_dict(cfg: ParityConfig) -> Dict[str, np.ndarray]:
    """{torch name: numpy} of the torch-initialised model, in the run's dtype."""
    import torch

    dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
    model = torch_model(cfg).to(dtype)
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def torch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """DistributedSampler's shuffle: ``randperm(n)`` from a generator seeded ``seed + epoch``."""
    import torch

    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).numpy()


def make_batches(cfg: ParityConfig) -> List[Tuple[np.ndarray, np.ndarray]]:
    """``cfg.steps`` global batches: images (N, b, S, S, 3) NHWC, labels (N, b) int32.

    Row r is rank r's batch (DistributedSampler partition of torch's permutation, with
    the shared augmentation), epochs following one another as a training run would."""
    from jaxdp.data import epoch_batches, make_synthetic

    n, b = cfg.devices, cfg.batch_per_device
    train, _ = make_synthetic(cfg.dataset_size, 16, seed=cfg.seed)
    dtype = np.float64 if cfg.dtype == "float64" else np.float32
    s, o = cfg.image_size, (32 - cfg.image_size) // 2
    out: List[Tuple[np.ndarray, np.ndarray]] = []
    epoch = 0
    while len(out) < cfg.steps:
        perm = torch_permutation(len(train), cfg.seed, epoch)
        for batch in epoch_batches(train, num_replicas=n, batch_per_replica=b, epoch=epoch,
                                   seed=cfg.seed, permutation=perm):
            images = np.ascontiguousarray(batch.images[:, :, o:o + s, o:o + s, :]).astype(dtype)
            out.append((images, batch.labels.astype(np.int32)))
            if len(out) == cfg.steps:
                break
        epoch += 1
    return out


def full_batch_order(images: np.ndarray, labels: np.ndarray, accum: int):
    """(N, b, ...) per-device batches -> (1, N*b, ...) for one torch process, ordered so that
    its k-th micro-batch (``chunk(accum)``) is the union of every device's k-th micro-batch:
    what a SyncBN step with accumulation normalises over."""
    n, b = labels.shape
    m = b // accum
    img = images.reshape(n, accum, m, *images.shape[2:]).swapaxes(0, 1).reshape(1, n * b, *images.shape[2:])
    lab = labels.reshape(n, accum, m).swapaxes(0, 1).reshape(1, n * b)
    return np.ascontiguousarray(img), np.ascontiguousarray(lab)


# ----------------------------------------------------------------------------- the two sides

def configure_precision(cuda: bool) -> None:
    """XLA's highest matmul precision on GPUs (no TF32) for the jaxdp side.

    The torch side turns TF32 off inside each rank (``torch_ref.launcher.no_tf32``):
    the ranks are forked from a forkserver that may have started earlier, with another
    environment, so neither this process's torch flags nor its environment reach them.
    (float64 never uses TF32; on CPU this changes nothing.)"""
    import jax

    if cuda or jax.default_backend() == "gpu":
        os.environ["NVIDIA_TF32_OVERRIDE"] = "0"  # read by cuBLAS/cuDNN when XLA first loads them
        jax.config.update("jax_default_matmul_precision", "highest")


def jax_strategy(p: Plan, variables=None):
    """The jaxdp strategy for the plan (model, classifier task, optimizer, mesh), ``return_grads=True``.
    zero3/hsdp shard per FSDP unit, the model's own (``fsdp_units``: residual or encoder blocks), as
    torch_ref's FSDP2 twin ``fully_shard``s every block and then the root."""
    from jaxdp.mesh import make_mesh
    from jaxdp.models import create_model, fsdp_units
    from jaxdp.optim import make_optimizer, make_schedule
    from jaxdp.strategies import create_strategy
    from jaxdp.task import classifier

    cfg = p.cfg
    model = create_model(cfg.model, num_classes=cfg.num_classes, dtype=cfg.dtype, **cfg.model_options())
    lr = (cfg.lr if cfg.schedule == "constant" and cfg.warmup_steps == 0 else
          make_schedule(cfg.schedule, cfg.lr, p.torch_config["total_steps"], warmup_steps=cfg.warmup_steps))
    tx = make_optimizer(cfg.optimizer, lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                        weight_decay=cfg.weight_decay, betas=tuple(cfg.betas), eps=cfg.eps)
    units = {"units": fsdp_units(model)} if cfg.strategy in ("zero3", "hsdp") else {}
    return create_strategy(cfg.strategy, model, classifier(model), tx, make_mesh(cfg.devices),
                           accum_steps=cfg.accum, sync_bn=cfg.sync_bn, return_grads=True, **units,
                           **p.jax_options)


def run_jax(p: Plan, state_dict: Mapping[str, np.ndarray],
            batches: Sequence[Tuple[np.ndarray, np.ndarray]]) -> List[dict]:
    """K jaxdp steps; one record per step in torch_ref's format (torch names and layouts).
    64-bit types exist only in a float64 run: a float32 run traces with x64 off, as a user's
    float32 program would (int32 indices, float32 constants), whatever the caller's setting."""
    import jax

    with jax.enable_x64(p.cfg.dtype == "float64"):
        p.jax_x64 = bool(jax.config.jax_enable_x64)
        return _jax_steps(p, state_dict, batches)


def _jax_steps(p: Plan, state_dict: Mapping[str, np.ndarray],
               batches: Sequence[Tuple[np.ndarray, np.ndarray]]) -> List[dict]:
    import jax

    from jaxdp.interop import tree_to_torch_names, variables_from_state_dict
    from jaxdp.optim import torch_optimizer_state

    # bfloat16 is mixed precision: float32 params (the master weights), bf16 compute.
    variables = variables_from_state_dict(state_dict, dtype="float32" if p.cfg.dtype == "bfloat16" else p.cfg.dtype)
    strategy = jax_strategy(p)
    state = strategy.init_state(variables)
    records = []
    for images, labels in batches:
        flat_images = images.reshape(-1, *images.shape[2:])
        batch = strategy.shard_batch({"image": flat_images, "label": labels.reshape(-1)})
        state, metrics = strategy.step(state, batch)
        metrics = jax.device_get(metrics)
        canon = jax.device_get(strategy.canonical(state))
        opt = torch_optimizer_state(p.cfg.optimizer, canon.opt_state)
        opt_named: Dict[str, Dict[str, np.ndarray]] = {}
        for key, tree in opt.items():
            if key == "step":
                continue
            for name, value in tree_to_torch_names(tree).items():
                opt_named.setdefault(name, {})[key] = value
        if "step" in opt:
            for name in opt_named:
                opt_named[name]["step"] = np.asarray(float(opt["step"]))
        records.append({
            "loss": float(metrics["loss"]),
            "loss_per_rank": [float(x) for x in np.asarray(metrics["loss_per_device"])],
            "grads": tree_to_torch_names(metrics["grads"]),
            "params": tree_to_torch_names(canon.params),
            "buffers": tree_to_torch_names(canon.model_state.get("batch_stats", {}), "batch_stats"),
            "optimizer_state": opt_named,
        })
        comm = powersgd_state(canon.extra)
        if comm is not None:
            records[-1]["comm_state"] = comm
    return records


def powersgd_state(extra) -> Optional[Dict[str, Dict[str, np.ndarray]]]:
    """jaxdp's PowerSGD state (``extra``: per-device error, Q by leaf name) in the torch
    record's form: {torch name: {"error": (devices, *torch shape), "q": (m, r)}}."""
    import jax

    from jaxdp.interop import tree_to_torch_names

    if not isinstance(extra, dict) or "error" not in extra:
        return None
    errors = extra["error"]
    devices = jax.tree_util.tree_leaves(errors)[0].shape[0]
    per_device = [tree_to_torch_names(jax.tree_util.tree_map(lambda e: e[d], errors)) for d in range(devices)]
    out = {name: {"error": np.stack([named[name] for named in per_device])} for name in per_device[0]}
    torch_name = {_leaf(name): name for name in out}
    for leaf, q in (extra.get("q") or {}).items():
        out[torch_name[leaf]]["q"] = np.asarray(q)
    return out


def run_torch(p: Plan, state_dict: Mapping[str, np.ndarray],
              batches: Sequence[Tuple[np.ndarray, np.ndarray]]) -> List[dict]:
    """K torch_ref steps on ``p.world`` ranks (``torch_ref.launcher.run_steps``)."""
    from torch_ref.launcher import run_steps

    if p.full_batch or p.world == 1:
        feed = [full_batch_order(x, y, p.cfg.accum) for x, y in batches]
    else:
        feed = list(batches)
    info: Dict[str, Any] = {}
    records = run_steps(p.world, p.torch_config, dict(state_dict), feed, timeout_s=p.cfg.timeout_s,
                        backend=p.backend, info=info)
    p.torch_ranks = _TORCH_RANKS[torch_cache_key(p)] = info["ranks"]
    return records


def torch_ranks(p: Plan) -> Optional[List[dict]]:
    """Each torch rank's device, backend and TF32 flags (``torch_ref.launcher.rank_info``),
    also when the records came from an earlier identical run (``reuse_torch``)."""
    return p.torch_ranks or _TORCH_RANKS.get(torch_cache_key(p))


def torch_cache_key(p: Plan) -> str:
    """Runs with equal keys give equal torch results: tests share one launch between pairs
    whose twins are the same torch computation (e.g. ddp, dp, ring and async vs DDP)."""
    c = p.cfg
    tc = {k: (sorted((n, v.tobytes()) for n, v in val.items()) if k == "powersgd_q" else val)
          for k, val in p.torch_config.items()}
    return repr((p.world, p.full_batch, sorted(tc.items(), key=lambda kv: kv[0]), c.devices,
                 c.batch_per_device, c.image_size, c.dataset_size, c.seed, c.steps, p.backend))


# ----------------------------------------------------------------------------- one run

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

        return {"config": _jsonable(self.plan.cfg.to_json()), "plan": self.plan.to_json(),
                "passed": self.passed, "injected_bug": self.bug, "message": self.message(),
                "seconds": self.seconds,
                "environment": environment(self.plan.cuda, self.plan),
                "comparison": self.comparison.to_json()}


def bounds_for(p: Plan):
    """float64 or float32 bounds (``compare.DEFAULT_BOUNDS``); with a bf16/fp16 hook, those
    adapted to the wire's rounding on ``p.world`` ranks (``compare.low_precision_wire``)."""
    from parity_tests import compare

    base = compare.DEFAULT_BOUNDS[p.cfg.dtype]
    if p.cfg.dtype == "bfloat16":
        from jaxdp.models import family

        base = compare.BFLOAT16_BN if family(p.cfg.model) == "resnet" else compare.BFLOAT16
    if p.cfg.compress in compare.UNIT_ROUNDOFF:
        return compare.low_precision_wire(base, p.cfg.compress, p.world)
    return base


_TORCH_RUNS: Dict[Any, List[dict]] = {}  # torch_cache_key, or (key, steps) for a prefix
_TORCH_RANKS: Dict[str, List[dict]] = {}  # torch_cache_key -> the ranks' rank_info


def run_parity(cfg: ParityConfig, *, reuse_torch: bool = False, bounds=None,
               jax_steps: Optional[int] = None, bug: Optional[str] = None) -> ParityResult:
    """Run both sides and compare them step by step.

    ``reuse_torch``: take the torch records from an earlier identical torch run in this
    process (``torch_cache_key``), e.g. when several jaxdp pairs share one twin, or the
    injected bugs share the clean run's. ``jax_steps``: run only that many jaxdp steps and
    compare that prefix. ``bug``: a ``parity_tests.bugs.BUGS`` name, injected into jaxdp
    for this run only."""
    from parity_tests import bugs, compare

    p = plan(cfg)
    # Refused before anything runs: a bug that cannot apply would only "pass".
    injected = bugs.injection(bug, cfg) if bug is not None else contextlib.nullcontext()
    configure_precision(p.cuda)
    t0 = time.perf_counter()
    sd = init_state_dict(cfg)
    batches = make_batches(cfg)
    t1 = time.perf_counter()
    # A comparison of the first ``jax_steps`` needs only those torch steps: the torch config
    # (its lr schedule's length included) stays the full run's, so they are its prefix.
    torch_steps = min(jax_steps or cfg.steps, cfg.steps)
    key = torch_cache_key(p)
    cached = (_TORCH_RUNS.get(key) or _TORCH_RUNS.get((key, torch_steps))) if reuse_torch else None
    if cached is not None:
        torch_records = cached
    else:
        torch_records = run_torch(p, sd, batches[:torch_steps])
        if reuse_torch:
            _TORCH_RUNS[key if torch_steps == cfg.steps else (key, torch_steps)] = torch_records
    t2 = time.perf_counter()
    if bug is not None:
        p.notes.append(f"INJECTED BUG in jaxdp: {bugs.BUGS[bug].what}")
    with injected:
        jax_records = run_jax(p, sd, batches[:jax_steps] if jax_steps else batches)
    t3 = time.perf_counter()
    skip = ("loss_per_rank",) if p.world != cfg.devices else ()
    # Only the prefix asked for; a side that stopped short of it is still a failure.
    torch_records = torch_records[:jax_steps] if jax_steps else torch_records
    comparison = compare.compare_runs(jax_records, torch_records, bounds or bounds_for(p), skip)
    return ParityResult(p, comparison, jax_records, torch_records,
                        {"inputs": t1 - t0, "torch": t2 - t1, "jax": t3 - t2}, bug)


# ----------------------------------------------------------------------------- the command

def _ints(text: str):
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _floats(text: str):
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def add_parity_args(p: argparse.ArgumentParser) -> None:
    """The ``jaxdp parity`` arguments (also ``python -m parity_tests``)."""
    d = ParityConfig()
    g = p.add_argument_group("pair")
    from jaxdp import choices
    from jaxdp.flags import deprecated_alias

    g.add_argument("--strategy", default=d.strategy, metavar=choices.listing(PAIRS), help="jaxdp strategy")
    g.add_argument("--devices", type=int, default=d.devices,
                   help="jaxdp devices = torch ranks (on CPU the devices are simulated)")
    g.add_argument("--accum-steps", dest="accum", type=int, default=d.accum,
                   help="micro-batches per update (torch no_sync)")
    deprecated_alias(g, "--accum", "--accum-steps", dest="accum", type=int)
    g.add_argument("--sync-bn", action="store_true", help="global BN statistics (torch: see the pair table)")
    g.add_argument("--bucket-cap-mb", type=float, default=d.bucket_cap_mb, help="ddp gradient bucket size")
    g.add_argument("--allreduce", default=d.allreduce, metavar=choices.listing(choices.ALLREDUCES), help="ddp, zero1")
    g.add_argument("--compress", default=d.compress, metavar=choices.listing(choices.COMPRESSIONS),
                   help="ddp, zero1 gradient compression (default: none)")
    g.add_argument("--powersgd-rank", type=int, default=d.powersgd_rank, help="powersgd: rank of P and Q")
    g.add_argument("--powersgd-start-iter", type=int, default=d.powersgd_start_iter,
                   help="powersgd: plain all-reduce for the first N steps")
    g.add_argument("--staleness", type=int, default=d.staleness, help="async: only 0 has a torch twin")
    g.add_argument("--mesh-shape", type=_ints, default=d.mesh_shape, help="hsdp: replicas,shards")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=d.model, metavar=choices.listing(choices.MODELS), help="architecture")
    g.add_argument("--width", type=int, default=d.width, help="ResNet: channels of the first stage (64 = torchvision)")
    g.add_argument("--blocks", type=_ints, default=d.blocks, help="ResNet: blocks per stage, e.g. 1,1,1,1 or 2,2,2,2")
    g.add_argument("--stem", default=d.stem, metavar=choices.listing(choices.STEMS), help="ResNet stem")
    for size in ("depth", "dim", "heads", "mlp_dim", "patch"):
        g.add_argument(f"--{size.replace('_', '-')}", type=int, default=None,
                       help=f"ViT: {size} (default: the named model's)")
    g.add_argument("--dtype", default=d.dtype, metavar=choices.listing(choices.DTYPES), help="float64 (tight: 1e-10) | float32 (measured-noise bounds) | bfloat16 (bf16 compute, fp32 master weights; bounds from bf16 rounding)")
    g.add_argument("--steps", type=int, default=d.steps, help="updates compared")
    g.add_argument("--batch-per-device", type=int, default=d.batch_per_device, help="images per device per update")
    g.add_argument("--image-size", type=int, default=d.image_size, help="centre crop S x S of the 32x32 images")
    g.add_argument("--dataset-size", type=int, default=d.dataset_size, help="synthetic training images")
    g.add_argument("--seed", type=int, default=d.seed, help="init and data order")
    g = p.add_argument_group("optimisation")
    g.add_argument("--optimizer", default=d.optimizer, metavar=choices.listing(choices.OPTIMIZERS), help="torch.optim's semantics")
    g.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    g.add_argument("--momentum", type=float, default=d.momentum, help="sgd momentum")
    g.add_argument("--nesterov", action="store_true", help="sgd: Nesterov momentum")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay, help="L2 (sgd, adam) or decoupled (adamw)")
    g.add_argument("--betas", type=_floats, default=d.betas, help="adam, adamw: b1,b2")
    g.add_argument("--eps", type=float, default=d.eps, help="adam, adamw")
    g.add_argument("--schedule", default=d.schedule, metavar=choices.listing(choices.SCHEDULES), help="lr schedule over the updates")
    g.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="warmup_cosine: linear warmup updates")
    g = p.add_argument_group("output")
    g.add_argument("--out", default="runs/parity", help="report.json and parity.png go here")
    g.add_argument("--png", default=None, help="also write the plot to this path (e.g. docs/parity.png)")
    g.add_argument("--timeout", dest="timeout_s", type=float, default=d.timeout_s,
                   help="seconds before the torch ranks are killed")
    g.add_argument("--backend", choices=("auto", "nccl", "gloo"), default=d.backend,  # torch_ref.dist.BACKENDS
                   help="torch side's process group. auto (default): $JAXDP_TORCH_BACKEND if set, else nccl "
                        "when CUDA has a GPU for every torch rank (rank r on cuda:r), else gloo. nccl without "
                        "enough GPUs is an error; gloo keeps torch on the CPU, also on a GPU host")
    g.add_argument("--inject-bug", default=None, metavar="BUG",
                   help="demo: run jaxdp with a deliberate bug (same_padding | biased_var | "
                        "missing_1_over_n | wrong_shard_bn | late_lr_schedule (needs --schedule "
                        "warmup_cosine, --steps >= --warmup-steps + 2) | adam_bias_correction (adam, "
                        "adamw) | shard_grad_perturbation (float64 only sees it) | error_feedback_dropped "
                        "(--compress powersgd, --steps >= --powersgd-start-iter + 2)) and watch the harness "
                        "name it; exit status 1 when it is caught, 3 when it is not (the harness is broken)")
    p.set_defaults(func=cmd_parity)


def config_from_args(args: argparse.Namespace) -> ParityConfig:
    fields = ParityConfig.__dataclass_fields__
    return ParityConfig(**{k: v for k, v in vars(args).items() if k in fields})


def cmd_parity(args: argparse.Namespace) -> int:
    from parity_tests import report

    cfg = config_from_args(args)
    try:
        result = run_parity(cfg, bug=args.inject_bug)
    except ParityError as e:
        print(f"jaxdp parity: error: {e}", file=sys.stderr)
        return 2
    report.print_report(result)
    paths = report.write(result, args.out, extra_png=args.png)
    print("wrote " + ", ".join(paths))
    if result.missed_bug:
        print(f"jaxdp parity: error: {result.message()}", file=sys.stderr)
        return 3
    return 0 if result.passed else 1


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return f"array{tuple(x.shape)}"
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x
