"""Run a few ``step_api`` steps on N gloo ranks from one Python call (no torchrun).

    results = run_steps(2, config, init_state_dict, [(images, labels), ...])

``images`` is (world, b, 32, 32, 3) float NHWC and ``labels`` (world, b): row r is rank r's
batch, the layout of ``jaxdp.data.epoch_batches``. Returns rank 0's per-step dicts (see
``torch_ref.step_api``). Call it from pytest, a module, or under
``if __name__ == "__main__":`` in a script: like ``spawn``, the ranks re-import the
caller's main script, and an unguarded call there would launch again.

How: N processes from a ``forkserver`` (fresh processes like ``spawn``, so nothing of the
caller's torch state, threads or CUDA context leaks in; but forked from a server that has
imported torch, FSDP2, DTensor and torch._dynamo once, which saves each rank ~4 s of
imports after the first launch), one thread each. They meet through a ``FileStore`` in a
private temporary directory rather than a TCP port: no free-port race when several
launches (or pytest workers) start at once. Rank 0 pickles its results to a file, written
to a temporary name and renamed, so a half-written file is never read. A rank that raises
writes its traceback next to it; the parent then stops the others (which would otherwise
wait in a collective until the process-group timeout) and raises ``LaunchError`` with the
traceback. A run that exceeds ``timeout_s`` is killed the same way, after each straggler
has dumped its Python stacks into the error (``faulthandler`` on SIGUSR1): a hang names
the line it hangs on. Ranks leave with ``os._exit`` once their results are written (see
``_worker`` for the torch teardown deadlock this avoids).
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

Collect = Union[str, Iterable[int]]


class LaunchError(RuntimeError):
    """A rank failed or the run timed out; the message holds the failing rank's traceback."""


def _collect_steps(collect: Collect, n: int) -> set:
    if collect == "all":
        return set(range(n))
    if collect == "last":
        return {n - 1}
    if collect == "loss":
        return set()
    return {int(i) % n for i in collect}


def _worker(rank: int, world: int, workdir: str, config: Mapping[str, Any],
            init_state_dict: Optional[Mapping[str, Any]], batches: List[Tuple[np.ndarray, np.ndarray]],
            collect: Sequence[int], timeout_s: float) -> None:
    code = 1
    stacks = open(os.path.join(workdir, f"rank{rank}.stacks"), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # for _wait on a hang
    try:
        import torch

        torch.set_num_threads(1)
        from torch_ref import dist as tdist
        from torch_ref.step_api import build

        no_tf32(tdist.device())
        tdist.init(timeout_s, init_method="file://" + os.path.join(workdir, "store"),
                   rank=rank, world_size=world)
        runner = build(config, init_state_dict)
        results = [runner.step(images, labels, collect=(i in collect))
                   for i, (images, labels) in enumerate(batches)]
        if rank == 0:
            tmp = os.path.join(workdir, "results.pkl.tmp")
            with open(tmp, "wb") as f:
                pickle.dump(results, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, os.path.join(workdir, "results.pkl"))
        torch.distributed.barrier()  # nobody leaves while another still communicates
        code = 0
    except BaseException:
        with open(os.path.join(workdir, f"rank{rank}.error"), "w") as f:
            f.write(traceback.format_exc())
    finally:
        # Exit without tearing anything down. Freeing the DDP Reducer (or the last
        # reference to the group) destroys ProcessGroupGloo while holding the GIL, and its
        # destructor joins gloo's worker threads; a worker still releasing the tensors of
        # the last collective needs the GIL to do so: a deadlock, seen here in ~1 of 8
        # launches (torch 2.13; pytorch/pytorch#56297). Everything is written already.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def no_tf32(device) -> bool:
    """Full float32 matmuls and convolutions in this rank when it computes on CUDA (parity
    compares against XLA at its highest precision). Returns whether it changed anything.

    Set here, in the rank, not by the caller: ranks fork from a forkserver that may have
    started before the caller set anything, and inherit its environment and flags, not
    the caller's. ``NVIDIA_TF32_OVERRIDE`` also covers libraries that read it when their
    first handle is created; the torch flags are what torch itself consults."""
    import torch

    if torch.device(device).type != "cuda":
        return False
    os.environ["NVIDIA_TF32_OVERRIDE"] = "0"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return True


def run_steps(world_size: int, config: Mapping[str, Any], init_state_dict: Optional[Mapping[str, Any]],
              batches_per_step: Sequence[Tuple[np.ndarray, np.ndarray]], *, timeout_s: float = 300.0,
              collect: Collect = "all") -> List[dict]:
    """Spawn ``world_size`` gloo ranks, run one ``Runner.step`` per batch, return rank 0's dicts.

    ``batches_per_step``: a sequence of ``(images, labels)`` with images
    (world, b, 32, 32, 3) and labels (world, b); each rank receives only its own rows.
    ``collect``: "all" (full record every step), "last", "loss" (losses, accuracy and lr
    only, no gathers) or an iterable of step indices to record in full.
    Raises ``LaunchError`` (with the failing rank's traceback) on failure or timeout.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    per_rank = [[] for _ in range(world_size)]
    for i, (images, labels) in enumerate(batches_per_step):
        images, labels = np.asarray(images), np.asarray(labels)
        if images.ndim != 5 or images.shape[0] != world_size or labels.shape != images.shape[:2]:
            raise ValueError(f"step {i}: expected images (world={world_size}, b, H, W, C) and labels "
                             f"(world, b), got {images.shape} and {labels.shape}")
        for r in range(world_size):
            per_rank[r].append((images[r], labels[r]))
    steps = _collect_steps(collect, len(batches_per_step))

    ctx = _context()
    workdir = tempfile.mkdtemp(prefix="torch_ref_launch_")
    procs = []
    try:
        for r in range(world_size):
            p = ctx.Process(target=_worker, name=f"torch_ref-rank{r}", daemon=True,
                            args=(r, world_size, workdir, dict(config), init_state_dict,
                                  per_rank[r], steps, timeout_s))
            p.start()
            procs.append(p)
        _wait(procs, workdir, timeout_s)
        with open(os.path.join(workdir, "results.pkl"), "rb") as f:
            return pickle.load(f)
    finally:
        _stop(procs)
        shutil.rmtree(workdir, ignore_errors=True)


# Imported once by the fork server, inherited by every rank it forks. torch._dynamo comes
# with the first torch.optim step (~1.5 s); FSDP2/DTensor with fully_shard (~1.7 s).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.fsdp",
           "torch.distributed.optim", "torch.distributed.checkpoint.state_dict",
           "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook", "torch_ref.step_api"]


def _context():
    """The forkserver context, preloading ``PRELOAD`` (if the server is not running yet;
    a running one is reused as it is). ``spawn`` where forkserver does not exist."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _errors(workdir: str, world: int) -> dict:
    """{rank: traceback}, the earliest written first: that rank is usually the cause, the
    later ones often only report the connection it broke."""
    found = []
    for r in range(world):
        path = os.path.join(workdir, f"rank{r}.error")
        if os.path.exists(path):
            with open(path) as f:
                found.append((os.path.getmtime(path), r, f.read()))
    return {r: tb for _, r, tb in sorted(found)}


def _wait(procs, workdir: str, timeout_s: float, grace_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    failed_at = None
    while True:
        codes = [p.exitcode for p in procs]
        if all(c == 0 for c in codes):
            return
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()  # let the others write their own tracebacks briefly
        now = time.monotonic()
        if (failed_at is not None and (now - failed_at > grace_s or all(c is not None for c in codes))) \
                or now > deadline:
            break
        time.sleep(0.02)
    codes = [p.exitcode for p in procs]
    hung = [r for r, c in enumerate(codes) if c is None]
    for r in hung:  # ask each straggler where it is stuck (faulthandler, see _worker)
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except OSError:
            pass
    time.sleep(0.5 if hung else 0)
    errors = _errors(workdir, len(procs))
    for r in hung:
        path = os.path.join(workdir, f"rank{r}.stacks")
        if r not in errors and os.path.exists(path) and os.path.getsize(path):
            with open(path) as f:
                errors[r] = "(still running; its Python stacks:)\n" + f.read()
    if failed_at is None:
        head = f"torch_ref launcher: timed out after {timeout_s:.0f}s; ranks still running: {hung}"
    else:
        bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
        head = f"torch_ref launcher: rank(s) {bad} failed (exit codes {codes})"
    detail = "".join(f"\n--- rank {r} traceback ---\n{tb}" for r, tb in errors.items())
    raise LaunchError(head + (detail or "\n(no traceback was written; killed by a signal?)"))


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
