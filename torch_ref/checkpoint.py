"""Checkpoints in one strategy-independent layout, written atomically by rank 0.

A checkpoint is one ``torch.save`` file, ``<dir>/step_<global step>.pt``, holding

- ``model``: the full ``state_dict`` (torch names, rank 0's BN buffers);
- ``optimizer``: the full optimizer state keyed by parameter *name*:
  ``{"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}``;
- ``scheduler``: ``LambdaLR.state_dict()``; ``meta``: epoch, step in epoch, global step,
  config fingerprint.

It is gathered with ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` /
``get_optimizer_state_dict`` (``full_state_dict=True, cpu_offload=True``: rank 0 receives
full CPU tensors, FSDP2 shards are all-gathered) and restored with the matching
``set_*_state_dict``, which re-shards for FSDP2. ZeroRedundancyOptimizer is the exception
these APIs do not cover: its state is consolidated on rank 0 and renamed from its integer
indices to parameter names. Because the layout is the same for every strategy, a run
saved under one strategy or world size can resume under another, as in jaxdp.

Rank 0 writes to a temporary file in the same directory, fsyncs it, ``os.replace``-s it and
fsyncs the directory, so neither a kill nor a power cut leaves a truncated checkpoint under
the final name; the older ones it replaces go only after that. Restoring reads the file on
every rank (one host, or a shared file system, as jaxdp's orbax checkpoints need too); a
resume whose newest file cannot be read (damaged since) says so in one line and takes the
one before (``restore_newest``).
"""

from __future__ import annotations

import glob
import os
import pickle
import re
from typing import Optional

import torch
import torch.distributed as dist

from jaxdp.runtime.durable import sync_folder
from torch_ref import dist as tdist

KEEP = 3
_NAME = re.compile(r"step_(\d+)\.pt$")


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that does not match the run."""


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_state(parallel, optimizer) -> tuple:
    """(model state_dict, name-keyed optimizer state_dict) on rank 0; ({}, {}) elsewhere.
    Collective: call on every rank."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model_sd = get_model_state_dict(parallel.module, options=_options(cpu_offload=True))
    if parallel.twin.zero_optimizer:
        optimizer.consolidate_state_dict(to=0)
        optim_sd = _zero_to_names(parallel, optimizer.state_dict()) if tdist.rank() == 0 else {}
    else:
        optim_sd = get_optimizer_state_dict(parallel.module, optimizer, options=_options(cpu_offload=True))
    return model_sd, optim_sd


def load_full_state(parallel, optimizer, model_sd: dict, optim_sd: dict) -> None:
    """Inverse of ``full_state``; every rank passes the full dicts."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(parallel.module, model_sd, options=_options())
    if parallel.twin.zero_optimizer:
        optimizer.load_state_dict(_zero_from_names(parallel, optim_sd))
    else:
        set_optimizer_state_dict(parallel.module, optimizer, optim_sd, options=_options())


def _zero_to_names(parallel, sd: dict) -> dict:
    names = [n for n, _ in parallel.module.named_parameters()]
    groups = [dict(g, params=[names[i] for i in g["params"]]) for g in sd["param_groups"]]
    state = {names[i]: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()}
             for i, s in sd["state"].items()}
    return {"state": state, "param_groups": groups}


def _zero_from_names(parallel, sd: dict) -> dict:
    index = {n: i for i, (n, _) in enumerate(parallel.module.named_parameters())}
    groups = [dict(g, params=[index[n] for n in g["params"]]) for g in sd["param_groups"]]
    return {"state": {index[n]: dict(s) for n, s in sd["state"].items()}, "param_groups": groups}


def checkpoints(directory: str) -> list:
    """(global step, path) of every complete checkpoint, oldest first."""
    found = []
    for path in glob.glob(os.path.join(directory, "step_*.pt")):
        m = _NAME.search(path)
        if m:
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest(directory: str) -> Optional[str]:
    found = checkpoints(directory)
    return found[-1][1] if found else None


def save(directory: str, global_step: int, parallel, optimizer, scheduler, meta: dict, keep: int = KEEP) -> None:
    """Gather (collective) and write on rank 0; keeps the newest ``keep`` checkpoints."""
    model_sd, optim_sd = full_state(parallel, optimizer)
    if tdist.rank() == 0:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"step_{global_step:08d}.pt")
        write_durably(path, {"model": model_sd, "optimizer": optim_sd, "scheduler": scheduler.state_dict(),
                             "meta": meta})
        for _, old in checkpoints(directory)[:-keep]:
            os.remove(old)
    if dist.is_initialized():
        dist.barrier()  # nobody reads a checkpoint before it is complete


def write_durably(path: str, state: dict) -> None:
    """``torch.save`` ``state`` to ``path``, whole or not at all, and on disk when this returns:
    a temporary file in the same directory, fsynced, renamed over ``path``, the directory fsynced.
    A temporary file a killed writer left behind goes too (rank 0 is the only writer)."""
    directory = os.path.dirname(path)
    for stale in glob.glob(os.path.join(glob.escape(directory), "step_*.pt.tmp*")):
        os.remove(stale)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    sync_folder(directory)


def _read(path: str) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"checkpoint {path} cannot be read: {first}") from e


def restore_newest(directory: str, parallel, optimizer, scheduler, check=None, say=None):
    """``restore`` the newest checkpoint in ``directory`` that can be read: (its path, its meta),
    or None when there is none. One that cannot be read (damaged since it was written) is named
    in one line through ``say`` and the one before is tried; CheckpointError if none can be read.
    ``check(meta, path)``: as ``restore``'s, told which file."""
    found = checkpoints(directory)
    for _, path in reversed(found):
        try:
            ckpt = _read(path)
        except CheckpointError as e:
            if say is not None:
                say(f"{e}; trying the one before")
            continue
        return path, _restore(path, ckpt, parallel, optimizer, scheduler,
                              None if check is None else (lambda meta, path=path: check(meta, path)))
    if found:
        raise CheckpointError(f"none of the {len(found)} checkpoint(s) in {directory} can be read")
    return None


def restore(path: str, parallel, optimizer, scheduler, check=None) -> dict:
    """Load ``path`` into the wrapped model, optimizer and scheduler; returns its meta.
    ``check(meta)`` runs first, so a mismatched config is reported as such, not as a
    shape error from deep inside ``set_state_dict``."""
    return _restore(path, _read(path), parallel, optimizer, scheduler, check)


def _restore(path: str, ckpt: dict, parallel, optimizer, scheduler, check=None) -> dict:
    if check is not None:
        check(ckpt.get("meta", {}))
    try:
        load_full_state(parallel, optimizer, ckpt["model"], ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
    except (KeyError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} cannot be restored: {str(e).splitlines()[0]}") from e
    return ckpt["meta"]
