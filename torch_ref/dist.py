"""Process-group plumbing: backend and device choice, init/teardown, small collectives.

One rule for every entry point (torchrun, the launcher, ``jaxdp launch``, a plain
``python -m``):

- **backend**: ``resolve_backend(requested)``. ``requested`` is ``auto`` (the default),
  ``nccl`` or ``gloo``: an explicit ``nccl``/``gloo`` (``--backend``) wins; with ``auto``
  the environment variable ``JAXDP_TORCH_BACKEND`` (``auto|nccl|gloo``) decides if set;
  otherwise ``auto`` picks ``nccl`` when CUDA is available AND there is a GPU for every
  rank on this host (``LOCAL_WORLD_SIZE``), else ``gloo``. ``nccl`` without enough GPUs
  is refused in one line (``BackendError``).
- **device**: follows the backend. ``nccl``: ``cuda:LOCAL_RANK`` (one GPU per process, as
  torchrun sets ``LOCAL_RANK``; refused if ``LOCAL_RANK`` >= the visible GPU count).
  ``gloo``: ``cpu``, also on a GPU host: gloo is the CPU path, so a CPU test suite runs
  unchanged on a GPU host with ``JAXDP_TORCH_BACKEND=gloo``.
- **world 1 without torchrun**: a process group of one over an in-memory ``HashStore``,
  so DDP, ZeroRedundancyOptimizer and FSDP2 run the same code path as with N ranks
  (their collectives on one rank are copies).
"""

import datetime
import os
from typing import Mapping, Optional

import torch
import torch.distributed as dist

BACKEND_ENV = "JAXDP_TORCH_BACKEND"
BACKENDS = ("auto", "nccl", "gloo")

_active: Optional[str] = None  # the backend of the group init() created


class BackendError(RuntimeError):
    """A backend or device that cannot be used here; the message is one line saying why."""


def cuda_device_count() -> int:
    """Visible CUDA GPUs (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_rank(environ: Optional[Mapping[str, str]] = None) -> int:
    env = os.environ if environ is None else environ
    return int(env.get("LOCAL_RANK", 0))


def local_world_size(environ: Optional[Mapping[str, str]] = None) -> int:
    """Ranks on this host: torchrun's ``LOCAL_WORLD_SIZE``, else ``WORLD_SIZE``, else 1."""
    env = os.environ if environ is None else environ
    return int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", 1)))


def resolve_backend(requested: Optional[str] = None, local_world: Optional[int] = None, *,
                    environ: Optional[Mapping[str, str]] = None, gpus: Optional[int] = None) -> str:
    """``nccl`` or ``gloo`` for ``requested`` (None or ``auto``: ``JAXDP_TORCH_BACKEND`` if
    set, else detect) with ``local_world`` ranks on this host (default: the environment's) and
    ``gpus`` CUDA GPUs (default: this host's)."""
    env = os.environ if environ is None else environ
    choice, source = (requested or "auto").strip().lower(), "--backend"
    if choice == "auto" and env.get(BACKEND_ENV, "").strip():
        choice, source = env[BACKEND_ENV].strip().lower(), BACKEND_ENV
    if choice not in BACKENDS:
        raise BackendError(f"{source} must be one of {', '.join(BACKENDS)}, got {choice!r}")
    ranks = max(1, local_world if local_world is not None else local_world_size(env))
    gpus = cuda_device_count() if gpus is None else gpus
    if choice == "auto":
        return "nccl" if gpus >= ranks else "gloo"
    if choice == "nccl" and gpus < ranks:
        why = "CUDA is not available" if gpus == 0 else f"only {gpus} GPU(s) are visible"
        fix = "use --backend gloo (or auto)" if source == "--backend" else f"set {BACKEND_ENV}=gloo (or unset it)"
        raise BackendError(f"backend nccl ({source}) needs one CUDA GPU per rank on this host: "
                           f"{ranks} rank(s), but {why}; {fix}")
    return choice


def backend() -> str:
    """The backend in use: the initialised group's, else what ``init`` would pick now."""
    if _active is not None and dist.is_initialized():
        return _active
    if dist.is_initialized():
        return str(dist.get_backend())
    return resolve_backend()


def device(backend_name: Optional[str] = None) -> torch.device:
    """``cuda:LOCAL_RANK`` for nccl, ``cpu`` for gloo (see the module docstring)."""
    name = backend_name or backend()
    if name != "nccl":
        return torch.device("cpu")
    rank, gpus = local_rank(), cuda_device_count()
    if rank >= gpus:
        raise BackendError(f"LOCAL_RANK={rank} but only {gpus} CUDA GPU(s) are visible: one GPU per "
                           f"rank needs at most {gpus} rank(s) on this host (or --backend gloo)")
    return torch.device("cuda", rank)


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init(timeout_s: float = 1800.0, *, init_method: Optional[str] = None,
         rank: Optional[int] = None, world_size: Optional[int] = None,
         backend: Optional[str] = None) -> None:
    """Initialise the default process group unless one exists.

    With ``init_method`` (e.g. ``file:///tmp/x/store``, as the launcher uses) rank and
    world size are given explicitly; under torchrun they come from the environment;
    otherwise this is a world of one. ``backend``: ``auto`` (default) | ``nccl`` | ``gloo``,
    resolved by ``resolve_backend``.
    """
    global _active
    if dist.is_initialized():
        return
    alone = init_method is None and not launched_by_torchrun()
    name = resolve_backend(backend, 1 if alone else None)
    dev = device(name)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = {"device_id": dev} if dev.type == "cuda" else {}
    if init_method is not None:
        dist.init_process_group(name, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timeout, **kwargs)
    elif not alone:
        dist.init_process_group(name, timeout=timeout, **kwargs)
    else:
        dist.init_process_group(name, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout, **kwargs)
    _active = name


def shutdown() -> None:
    global _active
    if dist.is_initialized():
        dist.destroy_process_group()
    _active = None


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_gather_floats(values, dev: Optional[torch.device] = None) -> torch.Tensor:
    """Every rank's vector of floats, as a (world, len) float64 tensor on every rank."""
    t = torch.as_tensor(values, dtype=torch.float64, device=dev or device()).reshape(-1)
    if not dist.is_initialized():  # one process without a group (e.g. dp in a test)
        return t.reshape(1, -1).cpu()
    out = [torch.empty_like(t) for _ in range(world_size())]
    dist.all_gather(out, t)
    return torch.stack(out).cpu()


def all_gather_tensor(t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` (same shape and dtype everywhere), stacked: (world, *shape), on CPU."""
    if not dist.is_initialized():
        return t.detach().reshape(1, *t.shape).cpu()
    t = t.detach().contiguous()
    out = [torch.empty_like(t) for _ in range(world_size())]
    dist.all_gather(out, t)
    return torch.stack(out).cpu()


def all_reduce_sum(values, dev: Optional[torch.device] = None) -> torch.Tensor:
    """Elementwise sum over ranks of a vector of floats (float64, returned on CPU)."""
    t = torch.as_tensor(values, dtype=torch.float64, device=dev or device()).reshape(-1).clone()
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.cpu()
