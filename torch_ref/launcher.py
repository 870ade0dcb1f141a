"""Run a few ``step_api`` steps on N ranks from one Python call (no torchrun).

    results = run_steps(2, config, init_state_dict, [(images, labels), ...])
    results = run_steps(2, ..., backend="gloo")     # auto (default) | nccl | gloo

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
launches (or pytest workers) start at once. Each rank pickles its result to a file, written
to a temporary name and renamed, so a half-written file is never read. A rank that raises
writes its traceback next to it; the parent then stops the others (which would otherwise
wait in a collective until the process-group timeout) and raises ``LaunchError`` with the
traceback. A run that exceeds ``timeout_s`` is killed the same way, after each straggler
has dumped its Python stacks into the error (``faulthandler`` on SIGUSR1): a hang names
the line it hangs on. Ranks leave with ``os._exit`` once their results are written (see
``_worker`` for the torch teardown deadlock this avoids). The ranks are the fork server's
children, not the caller's, so a caller killed outright (SIGKILL, an OOM killer) cannot stop them:
each rank watches the caller (``_end_with_caller``) and, once it is gone, removes the temporary
directory and exits, within a fraction of a second.

Devices and backend: rank r gets torchrun's variables, ``RANK=r``, ``WORLD_SIZE=N``,
``LOCAL_RANK=r``, ``LOCAL_WORLD_SIZE=N`` (``rank_env``), so on nccl it computes on
``cuda:r`` (``torch_ref.dist.device``); ``CUDA_VISIBLE_DEVICES`` is left alone (every rank
sees every GPU, as under torchrun). The backend is resolved once, here in the caller
(``torch_ref.dist.resolve_backend``: ``backend`` argument, else ``JAXDP_TORCH_BACKEND``,
else nccl with a GPU per rank, else gloo) and handed to every rank with the variables:
a forkserver started earlier would not pass on this process's environment. Each rank
turns TF32 off itself on CUDA (``no_tf32``) and reports what it ran on (``rank_info``;
``run_steps(..., info={})`` collects every rank's).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

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


def rank_env(rank: int, world: int, backend: str) -> dict:
    """What rank ``rank`` of ``world`` on this host gets in its environment: torchrun's
    variables (the device is ``cuda:LOCAL_RANK`` on nccl) and the resolved backend."""
    from torch_ref.dist import BACKEND_ENV

    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world), BACKEND_ENV: backend}


def rank_info() -> dict:
    """What this rank runs on (call it inside an initialised rank): its variables, device,
    backend and TF32 flags. ``run_ranks`` records it for every rank."""
    import torch

    from torch_ref import dist as tdist

    dev = tdist.device()
    return {"rank": tdist.rank(), "world_size": tdist.world_size(),
            "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                   "CUDA_VISIBLE_DEVICES", "NVIDIA_TF32_OVERRIDE")},
            "backend": tdist.backend(), "device": str(dev),
            "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
            "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
            "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
            "cudnn_enabled": bool(torch.backends.cudnn.enabled),
            "tf32_off": dev.type != "cuda" or not (torch.backends.cuda.matmul.allow_tf32
                                                   or torch.backends.cudnn.allow_tf32)}


def _end_with_caller(caller: int, workdir: str) -> None:
    """In a rank: once process ``caller`` (the one in ``run_ranks``) is gone, however it died,
    remove ``workdir`` and end this rank, from a thread (the main one may be in a collective)."""
    def watch():
        try:
            handle = os.pidfd_open(caller)  # readable when the process exits: no pid-reuse race
        except ProcessLookupError:
            handle = None  # gone already
        except (OSError, AttributeError):  # no pidfd (not Linux, an old kernel): poll
            handle = None
            while _alive(caller):
                time.sleep(0.2)
        if handle is not None:
            select.select([handle], [], [])
        shutil.rmtree(workdir, ignore_errors=True)
        os._exit(1)

    threading.Thread(target=watch, name="torch_ref-caller-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _worker(rank: int, world: int, workdir: str, backend: str, timeout_s: float,
            fn: Callable[..., Any], args: tuple, rank_setup: Optional[Callable[[Any], None]] = None,
            caller: Optional[int] = None) -> None:
    """One rank: torchrun's variables, TF32 off on CUDA, ``rank_setup(device)`` if given, the
    process group, ``fn(*args)``; its return value and ``rank_info()`` are pickled to
    ``result<rank>.pkl``. It ends, and removes ``workdir``, when process ``caller`` does."""
    if caller is not None:
        _end_with_caller(caller, workdir)
    code = 1
    stacks = open(os.path.join(workdir, f"rank{rank}.stacks"), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # for _wait on a hang
    try:
        os.environ.update(rank_env(rank, world, backend))
        import torch

        torch.set_num_threads(1)
        from torch_ref import dist as tdist

        no_tf32(tdist.device(backend))
        if rank_setup is not None:
            rank_setup(tdist.device(backend))
        tdist.init(timeout_s, init_method="file://" + os.path.join(workdir, "store"),
                   rank=rank, world_size=world, backend=backend)
        info = rank_info()
        value = fn(*args)
        tmp = os.path.join(workdir, f"result{rank}.pkl.tmp")
        with open(tmp, "wb") as f:
            pickle.dump((value, info), f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, os.path.join(workdir, f"result{rank}.pkl"))
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


def _steps(config: Mapping[str, Any], init_state_dict: Optional[Mapping[str, Any]],
           batches: List[Tuple[np.ndarray, np.ndarray]], collect: Sequence[int]) -> Optional[List[dict]]:
    """``run_steps``' work in one rank: rank 0's per-step dicts, None on the others."""
    from torch_ref import dist as tdist
    from torch_ref.step_api import build

    runner = build(config, init_state_dict)
    results = [runner.step(images, labels, collect=(i in collect)) for i, (images, labels) in enumerate(batches)]
    return results if tdist.rank() == 0 else None


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


def run_ranks(world_size: int, fn: Callable[..., Any], rank_args: Optional[Sequence[tuple]] = None, *,
              backend: Optional[str] = None, timeout_s: float = 300.0,
              info: Optional[dict] = None, rank_setup: Optional[Callable[[Any], None]] = None) -> List[Any]:
    """Start ``world_size`` ranks, run ``fn(*rank_args[r])`` in rank r inside the process
    group, return every rank's return value (rank order). ``fn`` must be picklable (a
    module-level function). ``backend``: auto (default) | nccl | gloo, resolved here
    (``torch_ref.dist.resolve_backend``; ``BackendError`` in one line if impossible).
    ``info``: if given, filled with ``backend`` and ``ranks`` (each rank's ``rank_info``).
    ``rank_setup``: a picklable ``f(device)`` each rank calls before its process group starts
    (parity's cuDNN settings: ``parity_tests.parity_mode.torch_rank_setup``).
    Raises ``LaunchError`` (with the failing rank's traceback) on failure or timeout."""
    from torch_ref.dist import resolve_backend

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    rank_args = [()] * world_size if rank_args is None else list(rank_args)
    if len(rank_args) != world_size:
        raise ValueError(f"rank_args has {len(rank_args)} entries for {world_size} ranks")
    name = resolve_backend(backend, world_size)
    ctx = _context()
    workdir = tempfile.mkdtemp(prefix="torch_ref_launch_")
    procs = []
    try:
        with _socket_sized_tempdir():
            for r in range(world_size):
                p = ctx.Process(target=_worker, name=f"torch_ref-rank{r}", daemon=True,
                                args=(r, world_size, workdir, name, timeout_s, fn, tuple(rank_args[r]), rank_setup,
                                      os.getpid()))
                p.start()
                procs.append(p)
        _wait(procs, workdir, timeout_s)
        out = []
        for r in range(world_size):
            with open(os.path.join(workdir, f"result{r}.pkl"), "rb") as f:
                out.append(pickle.load(f))
    finally:
        _stop(procs)
        shutil.rmtree(workdir, ignore_errors=True)
    if info is not None:
        info.update(backend=name, ranks=[i for _, i in out])
    return [v for v, _ in out]


def run_steps(world_size: int, config: Mapping[str, Any], init_state_dict: Optional[Mapping[str, Any]],
              batches_per_step: Sequence[Tuple[np.ndarray, np.ndarray]], *, timeout_s: float = 300.0,
              collect: Collect = "all", backend: Optional[str] = None,
              info: Optional[dict] = None, rank_setup: Optional[Callable[[Any], None]] = None) -> List[dict]:
    """Spawn ``world_size`` ranks, run one ``Runner.step`` per batch, return rank 0's dicts.

    ``batches_per_step``: a sequence of ``(images, labels)`` with images
    (world, b, 32, 32, 3) and labels (world, b); each rank receives only its own rows.
    ``collect``: "all" (full record every step), "last", "loss" (losses, accuracy and lr
    only, no gathers) or an iterable of step indices to record in full.
    ``backend``, ``info``, ``rank_setup``: as ``run_ranks``.
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
    state = dict(config), init_state_dict
    results = run_ranks(world_size, _steps, [(*state, per_rank[r], steps) for r in range(world_size)],
                        backend=backend, timeout_s=timeout_s, info=info, rank_setup=rank_setup)
    return results[0]


# Imported once by the fork server, inherited by every rank it forks. torch._dynamo comes
# with the first torch.optim step (~1.5 s); FSDP2/DTensor with fully_shard (~1.7 s).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.fsdp",
           "torch.distributed.optim", "torch.distributed.checkpoint.state_dict",
           "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook", "torch_ref.step_api"]


# A Unix socket's path holds at most 107 bytes on Linux (108 with its NUL).
_SUN_PATH_MAX = 107


@contextlib.contextmanager
def _socket_sized_tempdir():
    """While the ranks start, a temporary directory short enough for the fork server's socket.

    Python before 3.13 puts that socket at ``$TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX``; under
    a long ``TMPDIR`` (pytest's, a scheduler's job directory) the path is too long and the
    first start fails with "AF_UNIX path too long". Python 3.13 falls back to ``/tmp`` there,
    and so does this. Only the socket's directory moves: the launch directory was made before.
    """
    socket_path = os.path.join(tempfile.gettempdir(), "pymp-12345678", "listener-12345678")
    if len(os.fsencode(socket_path)) <= _SUN_PATH_MAX or not os.path.isdir("/tmp"):
        yield
        return
    saved = tempfile.tempdir
    tempfile.tempdir = "/tmp"
    try:
        yield
    finally:
        tempfile.tempdir = saved


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
