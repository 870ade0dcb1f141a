"""TensorBoard scalars beside ``metrics.jsonl``: every number of every record, under
``<kind>/<name>`` (``train/loss``, ``train/images_per_sec``, ``eval/accuracy``, ...) at the
record's step. ``tensorboard --logdir OUT/tensorboard`` shows them (and a
``--profile-steps`` trace, which is written there too).

Written with tensorboardX's event protos and record framing (pure Python, an optional dependency:
``pip install jaxdp[tensorboard]``); without it the run says once that scalars are off and goes on.

Each record is one event, handed to the OS before ``write`` returns, and ``sync`` puts them on disk
before a checkpoint, so a kill loses no row a checkpoint covers. (tensorboardX's ``SummaryWriter``
queues events for a thread of its own, and its ``flush`` does not wait for the queue: a process
killed after a checkpoint lost rows that checkpoint covered.) Every writer starts its own events
file; on resume its first event tells TensorBoard to hide what earlier files logged from the
checkpoint's next step on (``purge_step``), as metrics.jsonl drops those rows.
"""

import math
import os
import socket
import struct
import sys
import time
from typing import Optional

from jaxdp.runtime.durable import DiskFull, disk_full

NOT_SCALARS = ("kind", "step", "epoch")  # the record's coordinates, not values to plot

_said_off = [False]


def _tensorboardx():
    """tensorboardX's protos and record checksum, loaded without torch: its package imports
    tensorboardX.writer, which imports torch whenever it is installed, only to accept torch
    tensors (jaxdp writes floats), and that import was ~3 s of every run's start-up.
    ``sys.modules["torch"] = None`` makes that one ``import torch`` fail while tensorboardX loads;
    a process that has torch already keeps it."""
    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None
    try:
        from tensorboardX import record_writer
        from tensorboardX.proto import event_pb2, summary_pb2
    finally:
        if blocked:
            del sys.modules["torch"]
    return event_pb2, summary_pb2.Summary, record_writer.masked_crc32c


class ScalarWriter:
    def __init__(self, tensorboardx, logdir: str, purge_step: int):
        self._event_pb2, self._summary, self._crc = tensorboardx
        os.makedirs(logdir, exist_ok=True)
        # TensorBoard reads a folder's files in name order: by the second, then (the same host)
        # by the nanosecond; tensorboardX's own names stop at the second, and a second writer
        # within it truncated the first's file.
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{time.time_ns()}"
        self._file = open(os.path.join(logdir, name), "ab")
        session_log = self._event_pb2.SessionLog
        self._event(step=purge_step, file_version="brain.Event:2")
        self._event(step=purge_step, session_log=session_log(status=session_log.START))

    def _event(self, **fields) -> None:
        """One TFRecord: length, its masked crc32c, the event, its masked crc32c."""
        data = self._event_pb2.Event(wall_time=time.time(), **fields).SerializeToString()
        header = struct.pack("<Q", len(data))
        try:
            self._file.write(header + struct.pack("<I", self._crc(header)) + data + struct.pack("<I", self._crc(data)))
            self._file.flush()
        except OSError as e:  # a torn last event: TensorBoard skips it
            if disk_full(e):
                raise DiskFull("a TensorBoard event", self._file.name) from e
            raise

    def write(self, record: dict) -> None:
        values = [self._summary.Value(tag=f"{record['kind']}/{name}", simple_value=value)
                  for name, value in record.items()
                  if name not in NOT_SCALARS and not isinstance(value, bool) and isinstance(value, (int, float))
                  and math.isfinite(value)]  # not None (not measured yet), strings, nan
        if values:
            self._event(step=record["step"], summary=self._summary(value=values))

    def sync(self) -> None:
        os.fsync(self._file.fileno())

    def close(self) -> None:
        try:
            self._file.close()
        except OSError:  # what a full disk left buffered: the error was raised where it was written
            pass


def open_scalar_writer(logdir: str, keep_through_step: int = 0) -> Optional[ScalarWriter]:
    """A writer, or None (with one line, once per process) when tensorboardX is missing.
    ``keep_through_step``: the checkpoint's step (0: a fresh run, which hides any earlier events)."""
    try:
        tensorboardx = _tensorboardx()
    except ImportError:
        if not _said_off[0]:
            _said_off[0] = True
            print("jaxdp: TensorBoard scalars are off (pip install tensorboardX, or jaxdp[tensorboard]); "
                  "metrics.jsonl has every number", file=sys.stderr, flush=True)
        return None
    return ScalarWriter(tensorboardx, logdir, purge_step=keep_through_step + 1)
