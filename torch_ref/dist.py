"""Process-group plumbing: backend and device choice, init/teardown, small collectives.

One rule for every entry point (torchrun, the launcher, a plain ``python -m``):

- **backend**: ``nccl`` when CUDA is available, else ``gloo``. Chosen, never asked for:
  on this project's CPU machines nothing else works, and on GPU hosts nothing else is fast.
- **device**: ``cuda:LOCAL_RANK`` under CUDA (one GPU per process, as torchrun expects),
  else ``cpu``.
- **world 1 without torchrun**: a process group of one over an in-memory ``HashStore``,
  so DDP, ZeroRedundancyOptimizer and FSDP2 run the same code path as with N ranks
  (their collectives on one rank are copies).
"""

import datetime
import os
from typing import Optional

import torch
import torch.distributed as dist


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init(timeout_s: float = 1800.0, *, init_method: Optional[str] = None,
         rank: Optional[int] = None, world_size: Optional[int] = None) -> None:
    """Initialise the default process group unless one exists.

    With ``init_method`` (e.g. ``file:///tmp/x/store``, as the launcher uses) rank and
    world size are given explicitly; under torchrun they come from the environment;
    otherwise this is a world of one.
    """
    if dist.is_initialized():
        return
    dev = device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = {"device_id": dev} if dev.type == "cuda" else {}
    if init_method is not None:
        dist.init_process_group(backend(), init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timeout, **kwargs)
    elif launched_by_torchrun():
        dist.init_process_group(backend(), timeout=timeout, **kwargs)
    else:
        dist.init_process_group(backend(), store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout, **kwargs)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


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


def all_reduce_sum(values, dev: Optional[torch.device] = None) -> torch.Tensor:
    """Elementwise sum over ranks of a vector of floats (float64, returned on CPU)."""
    t = torch.as_tensor(values, dtype=torch.float64, device=dev or device()).reshape(-1).clone()
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.cpu()
