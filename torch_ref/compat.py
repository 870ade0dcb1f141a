"""The torch APIs that differ across the torch releases torch_ref supports, in one place.

Supported: torch 2.6 (the first release with the public ``torch.distributed.fsdp.fully_shard``,
``MixedPrecisionPolicy`` and ``FSDPModule``; ``DeviceMesh`` and ``torch.distributed.tensor``
came earlier) up to the newest 2.x. Each shim detects the feature (a keyword in a signature),
never the version string, so a backport or a nightly gets what it actually has, and each keeps
the newer API's semantics exactly on the older torch:

- ``ddp_buffer_sync``: DDP's keyword for "rank 0's buffers at construction and before every
  forward" (``forward_sync_buffers=True`` from torch 2.13, ``broadcast_buffers=True`` before).
- ``gpipe``: ``ScheduleGPipe`` averaging the gradients over micro-batches (``scale_grads=True``
  from torch 2.7; before, the schedule sums them and the caller divides).
- ``fsdp_cpu_problem``: FSDP2 on CPU (gloo) needs torch 2.7's CPU ``Stream.record_event``; on
  torch 2.6 zero2/zero3/hsdp run on CUDA only, and say so in one line instead of failing
  inside FSDP2 with ``'Stream' object has no attribute 'record_event'``.

Everything else torch_ref uses has one shape over that range. torch-only: no jax here.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Optional, Tuple


def takes_keyword(fn: Callable, name: str) -> bool:
    """Whether ``fn`` names the parameter ``name`` (a bare ``**kwargs`` does not count: it
    would accept the keyword and fail or ignore it further down)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: assume the old shape
        return False


def ddp_buffer_sync(ddp_class: Optional[type] = None) -> Dict[str, bool]:
    """The ``DistributedDataParallel`` keyword that broadcasts rank 0's buffers (BN running
    stats) once at construction and again before every forward.

    torch >= 2.13 spells it ``forward_sync_buffers=True``; it deprecated ``broadcast_buffers``
    (a FutureWarning). Its own mapping (``distributed.py``): ``broadcast_buffers=True`` sets
    ``forward_sync_buffers = True`` and syncs buffers at init, exactly what
    ``forward_sync_buffers=True`` does, so older torch gets ``broadcast_buffers=True``. (The
    two names part only for False: ``forward_sync_buffers=False`` still syncs at init,
    ``broadcast_buffers=False`` does not; torch_ref never turns buffer sync off.)"""
    if ddp_class is None:
        from torch.nn.parallel import DistributedDataParallel as ddp_class
    if takes_keyword(ddp_class.__init__, "forward_sync_buffers"):
        return {"forward_sync_buffers": True}
    return {"broadcast_buffers": True}


def gpipe(stage: Any, n_microbatches: int, loss_fn: Callable,
          schedule_class: Optional[type] = None) -> Tuple[Any, int]:
    """``(schedule, divisor)``: a GPipe schedule over ``stage``, and what the caller must still
    divide each gradient by, after ``schedule.step``, for the mean over micro-batches.

    torch >= 2.7 divides by the micro-batch count itself (``scale_grads=True``, its default,
    named here so a later default cannot change it): divisor 1. Before, the schedule sums the
    micro-batches' gradients of their unscaled losses: divisor ``n_microbatches``."""
    if schedule_class is None:
        from torch.distributed.pipelining import ScheduleGPipe as schedule_class
    if takes_keyword(schedule_class.__init__, "scale_grads"):
        return schedule_class(stage, n_microbatches, loss_fn=loss_fn, scale_grads=True), 1
    return schedule_class(stage, n_microbatches, loss_fn=loss_fn), n_microbatches


def fsdp_cpu_problem(stream_class: Optional[type] = None) -> Optional[str]:
    """Why FSDP2 cannot run on this torch's CPU (None: it can). FSDP2 records an event on its
    all-gather stream; CPU streams gained ``record_event`` (a no-op) in torch 2.7."""
    if stream_class is None:
        import torch

        stream_class = torch.cpu.Stream
    if hasattr(stream_class, "record_event"):
        return None
    import torch

    return (f"FSDP2 (zero2, zero3, hsdp) on CPU needs torch >= 2.7: torch {torch.__version__}'s CPU streams "
            "have no record_event, which fully_shard calls. Run these strategies on CUDA (--backend nccl) "
            "or install a newer torch")
