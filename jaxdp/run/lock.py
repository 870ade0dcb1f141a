"""A run directory has one writer: the lock ``jaxdp train``'s process 0 holds on ``--out``.

``OUT/jaxdp.lock`` is ``flock``ed (exclusive, not waiting) for the run's life and says who holds
it: host, pid and start time, one JSON line; the run removes it as it ends. A second writer finds
it held and stops in one line naming the holder. The kernel drops a ``flock`` when its process
dies, however it dies, so the file a killed run leaves is taken over, with one line naming the
holder it replaces. Readers (an
evaluation script, ``Trainer.restore``, export) take no lock and change nothing.

On a network filesystem the lock is as good as its ``flock``: NFSv4 (and Linux NFS clients since
2.6.12, through POSIX locks) lock across hosts; some filesystems (older NFS, some FUSE mounts) lock
within one host only, and there the host named in the file is the only clue (docs/checkpoints-and-faults.md).
"""

import datetime
import fcntl
import json
import os
import socket
import sys
from typing import Optional

NAME = "jaxdp.lock"


class RunDirInUse(RuntimeError):
    """Another process writes the run directory."""


class RunLock:
    """Hold ``out``'s lock until ``release`` (or the process ends)."""

    def __init__(self, out: str, made_out: bool = False):
        self.path = os.path.join(out, NAME)
        self.made_out = made_out  # the run made ``out``: it removes it if it ends up writing nothing there
        self._fd: Optional[int] = None
        while self._fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = _read(fd)
                os.close(fd)
                raise RunDirInUse(f"{out} is being written by another run ({describe(holder)}): one run writes a "
                                  f"run directory at a time; wait for it to end, or pick another --out") from None
            if _same_file(fd, self.path):
                self._fd = fd
            else:  # its holder ended and removed it between our open and our lock: lock the path's file
                os.close(fd)
        before = _read(self._fd)
        if before:  # its holder is gone: it never released the lock
            print(f"jaxdp: took over the lock on {out} from a run that is gone ({describe(before)})",
                  file=sys.stderr, flush=True)
        _write(self._fd, {"host": socket.gethostname(), "pid": os.getpid(),
                          "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")})

    def release(self) -> None:
        """Remove the lock file, then unlock (a writer that opened it meanwhile finds it gone and retries)."""
        if self._fd is None:
            return
        try:
            os.remove(self.path)
        except OSError:
            pass  # already gone: a user's cleanup; the kernel's lock goes all the same
        os.close(self._fd)
        self._fd = None


def _same_file(fd: int, path: str) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def describe(holder: Optional[dict]) -> str:
    if not holder:
        return "holder unknown"
    return f"host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started')}"


def _read(fd: int) -> Optional[dict]:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 4096).decode(errors="replace").strip()
    try:
        holder = json.loads(text) if text else None
    except ValueError:
        return {"host": "?", "pid": "?", "started": f"? (the lock file holds {text[:60]!r})"}
    return holder if isinstance(holder, dict) else None


def _write(fd: int, holder: dict) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    os.fsync(fd)
