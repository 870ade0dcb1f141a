"""Files that survive a kill, and the seam that proves it.

``write_atomically``: a small file replaced whole (a temporary file beside it, fsync, ``os.replace``,
fsync of the folder), so a reader finds the old text or the new one, never a half-written file,
after any kill or power cut. The temporary file's name is this write's own (two writers never share
one) and it is removed when the write fails (a full disk).

``DiskFull``: a write that found no space (ENOSPC, or a quota), naming what was written and where;
``disk_full(e)`` finds one in an exception's chain (orbax re-raises its thread's errors wrapped).

``fault_point(name)``: a named moment in a run's writes (``POINTS``). A test (or ``make kill-check``)
sets ``JAXDP_FAULT_AT=<point>[:<nth>][:<signal>][@<process>]`` and the process sends itself
``<signal>`` (KILL, TERM or INT; default KILL) the ``<nth>`` time it reaches ``<point>`` (default
1st); ``@<process>``: only in that process of a ``jaxdp launch`` job (``JAXDP_PROCESS_ID``), else in
every process. So a kill lands exactly there, every time, where a sleep would land anywhere.
The variable is read once, at import; unset, a point costs a comparison with None. A value that
does not parse is raised (``FaultSpecError``) by ``check_fault_spec``, which ``jaxdp train`` calls
first (one line), and by the first point, never at import.
"""

import errno
import os
import signal
import sys
import uuid
from typing import Optional

ENV = "JAXDP_FAULT_AT"
POINTS = {  # name: what is on disk when the process dies there
    "step": "a step's update is in hand; nothing of it is written yet",
    "metrics_row": "a row (a step's or an evaluation's) was just appended to metrics.jsonl (by process 0; "
                   "every process of a job passes the point)",
    "sample_row": "a step's row was just appended to sample_ids.p<k>.jsonl",
    "checkpoint_write": "a checkpoint's write has begun and not ended (orbax's temporary folder)",
    "checkpoint_manifest": "a checkpoint is complete under a temporary name, its manifest is not written, it is "
                           "not listed (process 0, in orbax's commit; another process of a job: after the save)",
    "checkpoint_done": "a checkpoint and its manifest are written; the loop has not gone on",
    "log_rewrite": "on resume, a log's kept rows are found; the rows after them are not yet dropped",
    "config": "config.json's new text is in its temporary file, not yet in place",
}
SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM, "INT": signal.SIGINT}


class FaultSpecError(ValueError):
    """A ``JAXDP_FAULT_AT`` that does not parse."""


class _Armed:
    def __init__(self, spec: str):
        where, _, process = spec.partition("@")
        parts = where.split(":")
        point, nth, kind = (parts + ["1", "KILL"][len(parts) - 1:])[:3]
        if len(parts) > 3 or point not in POINTS or not nth.isdigit() or int(nth) < 1 or kind not in SIGNALS or \
                (process and not process.isdigit()):
            raise FaultSpecError(f"{ENV}={spec!r}: expected <point>[:<nth>][:<signal>][@<process>], a point of "
                             f"{', '.join(POINTS)} and a signal of {', '.join(SIGNALS)}")
        self.point, self.nth, self.signal, self.kind = point, int(nth), SIGNALS[kind], kind
        self.here = not process or process == os.environ.get("JAXDP_PROCESS_ID", "0")
        self.hits = 0


def _armed(spec: Optional[str]) -> Optional[_Armed]:
    return _Armed(spec) if spec else None


_ARMED: Optional[_Armed] = None
_UNPARSED: Optional[FaultSpecError] = None  # the variable's error, raised where it is first needed
try:
    _ARMED = _armed(os.environ.get(ENV))
except FaultSpecError as e:
    _UNPARSED = e


def arm(spec: Optional[str]) -> None:
    """Arm a fault as ``JAXDP_FAULT_AT=spec`` would (None: disarm), for a run inside this process."""
    global _ARMED, _UNPARSED
    _ARMED, _UNPARSED = _armed(spec), None


def check_fault_spec() -> None:
    """``FaultSpecError`` if ``JAXDP_FAULT_AT`` does not parse (a command says it in one line)."""
    if _UNPARSED is not None:
        raise _UNPARSED


def fault_point(name: str) -> None:
    """The run passes point ``name`` (one of ``POINTS``): die here if ``JAXDP_FAULT_AT`` says so."""
    if _ARMED is None:
        check_fault_spec()
        return
    if _ARMED.point != name or not _ARMED.here:
        return
    _ARMED.hits += 1
    if _ARMED.hits == _ARMED.nth:
        print(f"jaxdp: {ENV}: SIG{_ARMED.kind} at {name} (time {_ARMED.nth})", file=sys.stderr, flush=True)
        os.kill(os.getpid(), _ARMED.signal)


def write_atomically(path: str, text: str, point: Optional[str] = None) -> None:
    """Replace ``path`` by ``text`` whole; ``point``: the fault point between writing and replacing."""
    tmp = f"{path}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"  # this write's own: never another writer's
    try:
        with open(tmp, "x") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if point is not None:
            fault_point(point)
        os.replace(tmp, path)
    except BaseException as e:
        _remove_quietly(tmp)
        if disk_full(e):
            raise DiskFull(os.path.basename(path), path) from e
        raise
    sync_folder(os.path.dirname(path) or ".")


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass  # never written, or already gone


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class DiskFull(OSError):
    """No space left while writing ``what`` (a phrase) to ``where`` (a path)."""

    def __init__(self, what: str, where: str):
        super().__init__(errno.ENOSPC, f"no space left on the device writing {what} to {where}")
        self.what, self.where = what, where

    def __str__(self) -> str:
        return self.strerror


def disk_full(e: BaseException) -> bool:
    """Whether ``e``, or an exception it was raised from, is a full disk (or quota)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in NO_SPACE or "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def sync_folder(path: str) -> None:
    """fsync a folder, so that a rename or a new file in it survives a power cut, not only a kill."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
