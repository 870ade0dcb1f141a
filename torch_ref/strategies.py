"""The data-parallel strategies, each the stock PyTorch recipe in a few lines.

=========  ===================================================================  =========
strategy   PyTorch                                                              jaxdp
=========  ===================================================================  =========
``dp``     ``nn.DataParallel`` (one process, >= 2 GPUs); otherwise one process  ``dp``
           on the full batch (see ``DP_FALLBACK_NOTE``)
``ddp``    ``DistributedDataParallel(bucket_cap_mb=, forward_sync_buffers=True)``  ``ddp``
           (``broadcast_buffers=True`` before torch 2.13: ``compat``), optional
           comm hook: bf16 / fp16 compression or PowerSGD
``zero1``  DDP + ``ZeroRedundancyOptimizer`` (optimizer state sharded)          ``zero1``
``zero2``  FSDP2 ``fully_shard`` on each residual/encoder block and the root,   ``zero2``
           ``reshard_after_forward=False`` (params stay gathered until backward)
``zero3``  the same with ``reshard_after_forward=True`` (re-gathered in backward)  ``zero3``
``hsdp``   FSDP2 on a 2-D ``DeviceMesh`` ("replicate", "shard")                 ``hsdp``
=========  ===================================================================  =========

``wrap(name, model, ...)`` returns a ``Parallel``: the wrapped model plus the handful of
things a training loop must do differently per strategy (skip gradient sync on
accumulation micro-steps, build the optimizer, gather full tensors out of shards). The
loops in ``train.py`` and ``step_api.py`` never branch on the strategy name.

FSDP2 notes (torch 2.13, CPU/gloo): ``fully_shard`` works on CPU with gloo, FSDP1 does
not. Parameters become ``DTensor`` shards along dim 0 (padded), gradients are
reduce-scattered and averaged over ranks, optimizer states are DTensors too; every
"full" view below is a ``full_tensor()`` all-gather, so every rank must call it. BN
buffers are not sharded and not synchronised: each rank keeps the running stats of its
own batches, as DDP does between its per-forward broadcasts (``sync_buffers`` copies rank
0's before evaluation and checkpoints, which is what DDP's next forward would do).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from jaxdp import names, registry
from jaxdp.runtime.mesh import MeshDims
from torch_ref import compat
from torch_ref import dist as tdist
from torch_ref.models import FSDP_UNITS


class StrategyError(ValueError):
    """A strategy or option that cannot run here; the message says why and what to do."""


DP_FALLBACK_NOTE = """\
torch_ref: strategy 'dp' without >= 2 CUDA GPUs: training in ONE process on the FULL batch.
  Why this is DataParallel's math: nn.DataParallel splits the batch over its GPUs, runs a
  replica of the model on each chunk, gathers the outputs on GPU 0 and computes the loss
  there, on the whole batch. Autograd sums the replicas' gradients back onto GPU 0
  (ReduceAdd), so the gradient is that of the full-batch mean loss: the same gradient one
  process computes on the full batch. (On a machine without GPUs nn.DataParallel itself
  just calls the module, which is what happens here.)
  The exception is BatchNorm: under DataParallel every replica normalises with the
  statistics of its own chunk (like DDP), and only replica 0's running-stat updates
  survive (it shares its buffers with the original module; the other replicas' copies
  are discarded), so the running stats follow chunk 0. Here there is one chunk, so BN
  normalises with full-batch statistics (what SyncBatchNorm would compute) and the running
  stats are the full batch's. With BN removed or in eval mode the two are identical."""

SYNC_BN_CPU_NOTE = (
    "--sync-bn needs CUDA: torch's SyncBatchNorm raises 'SyncBatchNorm expected input tensor "
    "to be on GPU' for CPU tensors in a multi-rank group. On CPU, train without --sync-bn "
    "(per-rank BN statistics, as DDP), or run the jaxdp side, whose sync_bn works on CPU.")


# ----------------------------------------------------------------------------- helpers

def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor holding the whole value: all-gathers a DTensor (collective), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def full_tensors(named: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``full_tensor`` of every value, with ONE all-gather per group of DTensors that share a
    mesh, placements and dtype instead of one per tensor (collective: every rank calls it).

    Why: parity records every param, gradient and optimizer tensor at every step, about 250
    tensors for the test ResNet; one gloo collective each cost most of a torch rank's time
    on a 2-core CI machine. The values are ``full_tensor()``'s, byte for byte: DTensor's
    Shard(0) cuts dim 0 as ``torch.chunk`` does (ceil(n/W) rows per rank, the last ranks
    fewer or none), so each rank's rows are padded to that chunk, gathered, and cut back.
    """
    from torch.distributed.tensor import DTensor, Shard

    groups: Dict[tuple, list] = {}
    out: Dict[str, torch.Tensor] = {}
    for name, t in named.items():
        shard_dims = [i for i, pl in enumerate(t.placements) if pl.is_shard()] if isinstance(t, DTensor) else []
        if len(shard_dims) == 1 and t.placements[shard_dims[0]] == Shard(0) and all(
                pl.is_shard() or pl.is_replicate() for pl in t.placements):
            groups.setdefault((id(t.device_mesh), t.placements, t.dtype), []).append(name)
        else:
            out[name] = full_tensor(t)
    for members in groups.values():
        out.update(_gather_dim0_shards({n: named[n] for n in members}))
    return {n: out[n] for n in named}


def _gather_dim0_shards(named: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    first = next(iter(named.values()))
    mesh_dim = next(i for i, pl in enumerate(first.placements) if pl.is_shard())
    group, world = first.device_mesh.get_group(mesh_dim), first.device_mesh.size(mesh_dim)
    layout = []  # (name, global shape, rows per rank chunk, elements per row)
    for name, t in named.items():
        rows = t.shape[0]
        layout.append((name, tuple(t.shape), -(-rows // world), int(np.prod(t.shape[1:], dtype=np.int64))))
    padded = []
    for (name, _, chunk, row), t in zip(layout, named.values()):
        local = t.to_local().reshape(-1)
        padded.append(torch.nn.functional.pad(local, (0, chunk * row - local.numel())))
    buffer = torch.cat(padded)
    gathered = [torch.empty_like(buffer) for _ in range(world)]
    dist.all_gather(gathered, buffer, group=group)
    out, offset = {}, 0
    for name, shape, chunk, row in layout:
        parts = [g[offset:offset + chunk * row].reshape(chunk, *shape[1:]) for g in gathered]
        out[name] = torch.cat(parts)[:shape[0]].reshape(shape)
        offset += chunk * row
    return out


def fsdp_blocks(model: nn.Module, units: Optional[Sequence[Any]] = None):
    """The modules FSDP2 shards one by one, in ``named_modules`` order. Default: every instance of
    the model family's unit classes (``models.FSDP_UNITS``: a ResNet's residual blocks, a ViT's
    encoder blocks), so this never names a model. ``units``: a model's own, module classes and/or
    fnmatch patterns on the '.'-joined module names (``"blocks.*"``); the outermost match wins, so
    units never nest (jaxdp's ``units``, ``jaxdp.strategies.units``, cut the same way)."""
    if units is None:
        return [m for m in model.modules() if isinstance(m, FSDP_UNITS)]
    import fnmatch

    classes = tuple(u for u in units if isinstance(u, type))
    patterns = [u for u in units if isinstance(u, str)]
    found = []
    for name, module in model.named_modules():
        inside = any(name.startswith(outer + ".") for outer, _ in found)
        if name and not inside and (isinstance(module, classes) or any(fnmatch.fnmatchcase(name, p) for p in patterns)):
            found.append((name, module))
    return [m for _, m in found]




# ----------------------------------------------------------------------------- the strategies

def dp(model: nn.Module, *, device: torch.device, devices: Optional[int] = None,
       announce: bool = True) -> nn.Module:
    """``nn.DataParallel`` over ``devices`` GPUs (default: all), or ``model`` itself on CPU."""
    if tdist.world_size() > 1:
        raise StrategyError("strategy 'dp' is single-process (nn.DataParallel); run it without "
                            "torchrun, or use ddp for one process per device")
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if gpus >= 2:
        ids = list(range(devices or gpus))
        return nn.DataParallel(model, device_ids=ids)
    if announce:
        print(DP_FALLBACK_NOTE, file=sys.stderr, flush=True)
    return model


def ddp(model: nn.Module, *, device: torch.device, bucket_cap_mb: Optional[float] = registry.BUCKET_CAP_MB,
        compress: Optional[str] = None, powersgd_rank: int = 1, powersgd_start_iter: int = 1000,
        powersgd_q: Optional[Mapping[str, Any]] = None, powersgd_seed: int = 0):
    """``DistributedDataParallel`` with rank 0's BN buffers broadcast before every forward.

    ``compress``: None (fp32/fp64 all-reduce of ``g / N``), ``"bf16"`` / ``"fp16"``
    (``default_hooks.bf16_compress_hook`` / ``fp16_compress_hook``: cast, divide by N in low
    precision, sum, cast back) or ``"powersgd"`` (``powerSGD_hook`` with rank
    ``powersgd_rank``, error feedback and warm start). Returns ``(ddp_model, hook_state)``.
    ``bucket_cap_mb`` None: torch's own default, a 1 MiB first bucket then 25 MiB (as jaxdp's).
    """
    from torch.nn.parallel import DistributedDataParallel

    if bucket_cap_mb is not None and bucket_cap_mb <= 0:
        raise StrategyError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
    cap = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}  # None: each torch's own default
    wrapped = DistributedDataParallel(
        model, device_ids=[device] if device.type == "cuda" else None,
        **cap, **compat.ddp_buffer_sync(DistributedDataParallel))
    state = None
    if compress is not None:
        state = register_comm_hook(wrapped, compress, rank=powersgd_rank,
                                   start_iter=powersgd_start_iter, initial_q=powersgd_q,
                                   seed=powersgd_seed)
    return wrapped, state


def zero1(model: nn.Module, **ddp_options):
    """DDP for the gradients; ``make_optimizer`` then shards the optimizer state
    (``ZeroRedundancyOptimizer``: each rank steps the params it owns and broadcasts them)."""
    return ddp(model, **ddp_options)


def fsdp(model: nn.Module, *, reshard_after_forward: bool, mesh=None,
         mixed_precision: bool = False, units: Optional[Sequence[Any]] = None,
         reduce_dtype: Optional[str] = None) -> nn.Module:
    """FSDP2: ``fully_shard`` each block (ResNet residual block, ViT encoder block, or the
    ``units`` a model names: ``fsdp_blocks``), then the root (stem, head and whatever the
    blocks left). ``reshard_after_forward=False``
    keeps each block's gathered params until its backward (ZeRO-2: one all-gather per
    step); ``True`` frees them after the forward and all-gathers again in the backward
    (ZeRO-3). With ``mixed_precision`` (``mixed_precision_policies``) the forward and
    backward run in bf16 around float32 norm layers and gradients are reduced in fp32.
    ``reduce_dtype`` (jaxdp's option of that name): the dtype FSDP2 reduces gradients in
    (``MixedPrecisionPolicy(reduce_dtype=...)``; None: the params' own, fp32 under mixed precision)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: Dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    if mesh is not None:
        kwargs["mesh"] = mesh
    if not mixed_precision:
        if reduce_dtype is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=getattr(torch, reduce_dtype))
        for block in fsdp_blocks(model, units):
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        return model
    norm, body, root = mixed_precision_policies(getattr(torch, reduce_dtype or "float32"))
    for layer in _norm_layers(model):  # first: a module already sharded keeps its own policy
        fully_shard(layer, mp_policy=norm, **kwargs)
    for block in fsdp_blocks(model, units):
        fully_shard(block, mp_policy=body, **kwargs)
    fully_shard(model, mp_policy=root, **kwargs)
    return model


# BatchNorm (and SyncBatchNorm), LayerNorm, GroupNorm: the layers bf16 compute keeps in float32.
NORM_LAYERS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm)


def _norm_layers(model: nn.Module):
    return [m for m in model.modules() if isinstance(m, NORM_LAYERS) and any(True for _ in m.parameters())]


def mixed_precision_policies(reduce_dtype=None):
    """FSDP2 ``MixedPrecisionPolicy``s for bf16 compute with fp32 master weights, as jaxdp's
    ``--dtype bfloat16`` computes: ``(norm layers, blocks, root)``.

    - norm layers: params stay float32 (no ``param_dtype``), bf16 out. A BatchNorm whose
      weight is cast to bf16 beside its fp32 running stats fails in backward on cuDNN
      ('Expected running_mean to have type BFloat16 but got Float') and on CPU; fp32 params
      with a bf16 input is the mix both accept, and it is jaxdp's BatchNorm and LayerNorm:
      statistics, scale and shift in float32 on the bf16 activations, bf16 out. (torch's own
      FSDP2 mixed-precision test shards BatchNorm first with such a policy.)
    - blocks: params all-gathered and computed in bf16, gradients reduced in fp32.
    - root: the same, with fp32 logits out, so the loss is computed in float32 (jaxdp's
      model returns float32 logits).

    ``reduce_dtype``: what every policy reduces gradients in (default fp32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16, fp32 = torch.bfloat16, torch.float32
    reduce = reduce_dtype or fp32
    return (MixedPrecisionPolicy(reduce_dtype=reduce, output_dtype=bf16),
            MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=reduce),
            MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=reduce, output_dtype=fp32))


def zero2(model: nn.Module, *, device: Optional[torch.device] = None, **options) -> nn.Module:
    return fsdp(model, reshard_after_forward=False, **options)


def zero3(model: nn.Module, *, device: Optional[torch.device] = None, **options) -> nn.Module:
    return fsdp(model, reshard_after_forward=True, **options)


def hsdp_mesh_shape(mesh_shape: Optional[Sequence[int]], world: int) -> Tuple[int, int]:
    """(replicas, shards). Default: jaxdp's (``jaxdp.runtime.mesh.MeshDims.hsdp_default``), one shard group per
    node (torchrun's LOCAL_WORLD_SIZE ranks per node)."""
    import os

    if mesh_shape is None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        local = local if local >= 1 and world % local == 0 else world
        return MeshDims.hsdp_default(world, world // local)
    shape = tuple(int(s) for s in mesh_shape)
    if len(shape) != 2 or min(shape) < 1 or shape[0] * shape[1] != world:
        raise StrategyError(f"mesh_shape {tuple(mesh_shape)} must be (replicas, shards) with "
                            f"replicas x shards = world size {world}")
    return shape


def hsdp(model: nn.Module, *, device: torch.device, mesh_shape: Optional[Sequence[int]] = None,
         mixed_precision: bool = False, units: Optional[Sequence[Any]] = None,
         reduce_dtype: Optional[str] = None) -> nn.Module:
    """HSDP: FSDP2 over a 2-D mesh. Params are sharded over "shard" and replicated over
    "replicate"; gradients are reduce-scattered within a shard group, then all-reduced
    across replica groups (ZeRO-3 resharding, as ``zero3``)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = hsdp_mesh_shape(mesh_shape, tdist.world_size())
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))
    return fsdp(model, reshard_after_forward=True, mesh=mesh, mixed_precision=mixed_precision, units=units,
                reduce_dtype=reduce_dtype)


# ----------------------------------------------------------------------------- comm hooks

def powersgd_shapes(model: nn.Module, rank: int, min_compression_rate: float = 2.0) -> Dict[str, Tuple[int, int]]:
    """{param name: shape of its initial Q} for the params PowerSGD compresses
    (``torch_ref.powersgd.q_shapes``)."""
    from torch_ref import powersgd

    return powersgd.q_shapes(model, rank, min_compression_rate)


def register_comm_hook(model, compress: str, *, rank: int = 1, start_iter: int = 1000,
                       initial_q: Optional[Mapping[str, Any]] = None, seed: int = 0):
    """Register a DDP communication hook; returns its state (None for bf16/fp16).

    PowerSGD: vanilla all-reduce until the hook has seen ``start_iter`` calls for bucket 0
    (default 1000, torch's ``PowerSGDState`` default and jaxdp's; torch requires >= 2 with
    warm start or error feedback), then rank-``rank``
    compression with error feedback and warm start. Its initial Q matrices are random
    (``powersgd_seed``); ``initial_q`` ({param name: array shaped as ``powersgd_shapes``
    says}) replaces that draw, e.g. to feed both frameworks the same Q. Returns the
    ``torch_ref.powersgd.Hook``, whose ``named_state()`` reads its error feedback and Qs.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from torch_ref import powersgd

    if compress == "bf16":
        cuda = torch.cuda.is_available()
        model.register_comm_hook(None, default_hooks.bf16_compress_hook if cuda else bf16_compress_hook_gloo)
        return None
    if compress == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if compress != "powersgd":
        raise StrategyError(f"unknown compress {compress!r}; choose one of {', '.join(names.COMPRESSIONS)}")
    try:
        hook = powersgd.Hook(model.module, rank=rank, start_iter=start_iter, seed=seed, initial_q=initial_q)
    except powersgd.PowerSGDError as e:
        raise StrategyError(str(e)) from None
    hook.register(model)
    return hook


def bf16_compress_hook_gloo(process_group, bucket):
    """``default_hooks.bf16_compress_hook`` for gloo: the very same function body
    (``_compress_hook(torch.bfloat16, ...)``) under another name. DDP refuses a hook *named*
    ``bf16_compress_hook`` unless CUDA with NCCL >= 2.10 is present, a guard for NCCL's bf16
    support; gloo all-reduces bf16 fine. (No return annotation: DDP compares it with
    ``Future[Tensor]``, and this module's postponed annotations would make it a string.)"""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)


# ----------------------------------------------------------------------------- the wrapper

@dataclass
class Parallel:
    """A model wrapped by a strategy, and the per-strategy details a loop needs.

    ``model`` is what to call (DDP / DataParallel / the FSDP2 root); ``module`` is the
    ResNet underneath, whose ``named_parameters()`` give the torch names used everywhere.
    """

    name: str
    model: nn.Module
    module: nn.Module
    device: torch.device
    comm_state: Any = None
    autocast_dtype: Optional[torch.dtype] = None  # bf16 compute by autocast (mixed precision)

    @property
    def twin(self) -> "Twin":
        return twin(self.name)

    @property
    def sharded(self) -> bool:
        """FSDP2: params, grads and optimizer states are DTensor shards."""
        return self.twin.fsdp

    @contextlib.contextmanager
    def micro_step(self, sync: bool):
        """Context for one accumulation micro-step; ``sync=False`` keeps gradients local.

        DDP: ``no_sync()`` (grads accumulate in ``.grad``; the all-reduce of their sum runs
        on the last micro-step). FSDP2: ``set_requires_gradient_sync(False)`` (unsharded
        grads accumulate; one reduce-scatter on the last micro-step).
        """
        if sync:
            ctx = contextlib.nullcontext()
        elif hasattr(self.model, "no_sync"):
            ctx = self.model.no_sync()
        elif self.sharded:
            ctx = _fsdp_no_sync(self.model)
        else:
            ctx = contextlib.nullcontext()  # dp: one process, nothing to sync
        with ctx, self.autocast():
            yield

    def autocast(self):
        """``torch.autocast(bf16)`` under mixed precision where no FSDP2 policy casts."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    @contextlib.contextmanager
    def evaluating(self):
        """Eval mode, no grad, rank 0's BN stats everywhere; back to train mode after,
        with FSDP2 params resharded (zero2 would otherwise keep them gathered)."""
        self.sync_buffers()
        self.model.eval()
        try:
            with torch.no_grad(), self.autocast():
                yield self.model
        finally:
            if self.sharded:
                from torch.distributed.fsdp import FSDPModule

                for m in self.module.modules():
                    if isinstance(m, FSDPModule):
                        m.reshard()
            self.model.train()

    def sync_buffers(self) -> None:
        """Give every rank rank 0's BN running stats (what DDP's next forward does).
        FSDP2 leaves buffers per rank; call before evaluation and checkpoints."""
        if tdist.world_size() > 1 and self.sharded:
            for b in self.module.buffers():
                dist.broadcast(b, 0)


@contextlib.contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


@dataclass(frozen=True)
class Twin:
    """One twin torch_ref can build (the ``torch_twin`` of a ``jaxdp.registry`` row): its wrapper,
    the options it takes, and how it runs. Everything a loop, parity or the bench does differently
    per strategy is one of these attributes, never a name:

    - ``wrap(model, *, device, **options)``: DDP-like twins return ``(wrapped, comm hook state)``;
      ``fsdp`` twins (FSDP2: params, grads and optimizer states are DTensor shards, sharded in
      place) also take ``mixed_precision`` and return the model; ``one_process`` twins
      (nn.DataParallel: one process drives every device) also take ``announce``;
    - ``zero_optimizer``: ZeroRedundancyOptimizer (each rank holds its part of the optimizer state);
    - ``on_mesh(model, dp_mesh)``: the twin over the data dim of a 2-D mesh, beside tensor
      parallelism (None: it has no such form).

    A new strategy's twin is a ``Twin`` in a module of its own, named by its registry row as
    ``"module:attr"`` (``twin``); ``TWINS`` are the built-in ones."""

    wrap: Callable
    options: Tuple[str, ...] = ()
    fsdp: bool = False
    one_process: bool = False
    zero_optimizer: bool = False
    on_mesh: Optional[Callable] = None


def _ddp_on_mesh(model: nn.Module, dp_mesh) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_mesh=dp_mesh)


def _zero3_on_mesh(model: nn.Module, dp_mesh) -> nn.Module:
    return fsdp(model, reshard_after_forward=True, mesh=dp_mesh)  # per block, then the root


DDP_OPTIONS = ("bucket_cap_mb", "compress", "powersgd_rank", "powersgd_start_iter", "powersgd_q", "powersgd_seed")
TWINS = {
    "dp": Twin(dp, ("devices",), one_process=True),
    "ddp": Twin(ddp, DDP_OPTIONS, on_mesh=_ddp_on_mesh),
    "zero1": Twin(zero1, DDP_OPTIONS, zero_optimizer=True),
    "zero2": Twin(zero2, fsdp=True),
    "zero3": Twin(zero3, ("reduce_dtype",), fsdp=True, on_mesh=_zero3_on_mesh),
    "hsdp": Twin(hsdp, ("mesh_shape", "reduce_dtype"), fsdp=True),
}
STRATEGIES = tuple(TWINS)


def twin(name: str) -> Twin:
    """The twin called ``name``: one of ``TWINS``, or ``"module:attr"``, a ``Twin`` defined beside a
    new strategy's twin (as a registry row's engine may be ``"module:Class"``). The name travels to
    the torch ranks as a string, and each rank resolves it here."""
    if name in TWINS:
        return TWINS[name]
    module, sep, attr = name.partition(":")
    if sep:
        found = getattr(importlib.import_module(module), attr, None)
        if isinstance(found, Twin):
            return found
        raise StrategyError(f"{name!r} names no torch_ref.strategies.Twin")
    raise StrategyError(f"unknown strategy {name!r}; choose one of {', '.join(TWINS)}")


def wrap(name: str, model: nn.Module, *, device: Optional[torch.device] = None,
         sync_bn: bool = False, mixed_precision: bool = False, announce: bool = True,
         units: Optional[Sequence[Any]] = None, **options) -> Parallel:
    """Wrap ``model`` (already on ``device``, in its final dtype) for strategy ``name``.

    ``options`` are the twin's own (``Twin.options``); any other is an error.
    ``mixed_precision``: FSDP2 ``MixedPrecisionPolicy``s (``mixed_precision_policies``: bf16
    compute, fp32 norm layers and gradient reduction), on CUDA and CPU; for dp/ddp/zero1, ``torch.autocast(bf16)``
    around forward and loss (params and grads stay fp32).
    ``sync_bn``: ``SyncBatchNorm`` (CUDA only). ``units``: the FSDP2 twins' units (``fsdp_blocks``;
    None: the model family's ``FSDP_UNITS``); the other twins have none.
    """
    chosen = twin(name)
    device = device or tdist.device()
    accepted = chosen.options
    unknown = [k for k in options if k not in accepted]
    if unknown:
        raise StrategyError(f"strategy {name!r} takes no option {', '.join(unknown)} "
                            f"(it takes: {', '.join(accepted)})")
    if sync_bn:
        if device.type != "cuda":
            raise StrategyError(SYNC_BN_CPU_NOTE)
        if chosen.one_process:
            raise StrategyError(f"--sync-bn needs one process per GPU (ddp, zero*, hsdp), not {name}")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    comm_state, autocast = None, None
    if chosen.fsdp:
        problem = compat.fsdp_cpu_problem() if device.type == "cpu" else None
        if problem:
            raise StrategyError(problem)
        wrapped = chosen.wrap(model, device=device, mixed_precision=mixed_precision, units=units, **options)
        module = wrapped  # fully_shard works in place: the root is the model
    else:
        autocast = torch.bfloat16 if mixed_precision else None
        if chosen.one_process:
            wrapped = chosen.wrap(model, device=device, announce=announce, **options)
        else:
            wrapped, comm_state = chosen.wrap(model, device=device, **options)
        module = model
    return Parallel(name=name, model=wrapped, module=module, device=device,
                    comm_state=comm_state, autocast_dtype=autocast)


# ----------------------------------------------------------------------------- optimizer

def make_optimizer(parallel: Parallel, name: str, lr: float, *, momentum: float = 0.9,
                   nesterov: bool = False, weight_decay: float = 0.0,
                   betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8) -> torch.optim.Optimizer:
    """``torch.optim.SGD`` / ``Adam`` / ``AdamW`` with every option explicit (AdamW's own
    default weight decay, 1e-2, is never used); ``ZeroRedundancyOptimizer`` for zero1."""
    return optimizer_for(list(parallel.module.parameters()), name, lr, zero1=parallel.twin.zero_optimizer,
                         momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, betas=betas, eps=eps)


def optimizer_for(params, name: str, lr: float, *, zero1: bool = False, momentum: float = 0.9,
                  nesterov: bool = False, weight_decay: float = 0.0, betas: Sequence[float] = (0.9, 0.999),
                  eps: float = 1e-8) -> torch.optim.Optimizer:
    """``make_optimizer`` over given params (a wrapper that swaps its params, e.g. DDP over
    tensor-parallel DTensors, hands over the ones it reduces)."""
    if name == "sgd":
        cls, kw = torch.optim.SGD, dict(momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
    elif name in ("adam", "adamw"):
        cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
        kw = dict(betas=tuple(betas), eps=eps, weight_decay=weight_decay)
    else:
        raise StrategyError(f"unknown optimizer {name!r}; choose one of {', '.join(names.OPTIMIZERS)}")
    try:
        if zero1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(params, optimizer_class=cls, lr=lr, **kw)
        return cls(params, lr=lr, **kw)
    except ValueError as e:  # torch's own refusals (nesterov without momentum, ...)
        raise StrategyError(f"optimizer {name!r}: {e}") from None


def make_scheduler(optimizer, schedule: str, lr: float, total_steps: int, *,
                   warmup_steps: int = 0, milestones=(), gamma: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` with ``jaxdp.optim.torch_lr_lambda``: the lr of the k-th update is the
    same number jaxdp's optax schedule gives (call ``scheduler.step()`` once per update).
    ``constant`` needs no formula, which spares every rank the JAX import."""
    if schedule == "constant" and warmup_steps == 0:
        factor: Callable[[int], float] = _one
    else:
        from jaxdp.optim import ConfigError, torch_lr_lambda

        try:
            factor = torch_lr_lambda(schedule, lr, total_steps, warmup_steps=warmup_steps,
                                     milestones=milestones, gamma=gamma)
        except ConfigError as e:
            raise StrategyError(str(e)) from None
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _one(step: int) -> float:
    return 1.0


# ----------------------------------------------------------------------------- full views

def full_params(parallel: Parallel) -> Dict[str, torch.Tensor]:
    """{name: full param} on every rank (all-gathers FSDP shards)."""
    return full_tensors({n: p.detach() for n, p in parallel.module.named_parameters()})


def full_grads(parallel: Parallel) -> Dict[str, torch.Tensor]:
    """{name: averaged gradient} as the optimizer sees it (after all-reduce/reduce-scatter)."""
    return full_tensors({n: p.grad.detach() for n, p in parallel.module.named_parameters() if p.grad is not None})


def full_optimizer_state(parallel: Parallel, optimizer) -> Optional[Dict[str, Dict[str, torch.Tensor]]]:
    """{param name: {"momentum_buffer" | "exp_avg" | "exp_avg_sq" | "step": tensor}}, on
    rank 0 (None elsewhere). Collective: every rank must call it.

    ZeroRedundancyOptimizer: ``consolidate_state_dict(to=0)`` gathers every rank's shard on
    rank 0. FSDP2: each state is a DTensor shard; ``full_tensor()`` all-gathers it."""
    names = [n for n, _ in parallel.module.named_parameters()]
    if parallel.twin.zero_optimizer:
        optimizer.consolidate_state_dict(to=0)
        if tdist.rank() != 0:
            return None
        state = optimizer.state_dict()["state"]
        return {names[i]: {k: _tensor(v) for k, v in s.items() if v is not None}
                for i, s in state.items()}
    flat = {}  # "name\0key": tensor, so all of them travel in one gather per group
    for name, p in parallel.module.named_parameters():
        s = optimizer.state.get(p, {})
        flat.update({f"{name}\0{k}": _tensor(s[k]) for k in sorted(s) if s[k] is not None})
    out: Dict[str, Dict[str, torch.Tensor]] = {name: {} for name in names}
    for key, t in full_tensors(flat).items():
        name, k = key.split("\0")
        out[name][k] = t
    return out if tdist.rank() == 0 else None


def _tensor(v):
    return v if torch.is_tensor(v) else torch.as_tensor(v)
