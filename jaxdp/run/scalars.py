"""TensorBoard scalars beside ``metrics.jsonl``: every number of every record, under
``<kind>/<name>`` (``train/loss``, ``train/images_per_sec``, ``eval/accuracy``, ...) at the
record's step. ``tensorboard --logdir OUT/tensorboard`` shows them (and a
``--profile-steps`` trace, which is written there too).

Written with tensorboardX (pure Python, an optional dependency: ``pip install
jaxdp[tensorboard]``); without it the run says once that scalars are off and goes on.
"""

import math
import sys
from typing import Optional

NOT_SCALARS = ("kind", "step", "epoch")  # the record's coordinates, not values to plot

_said_off = [False]


def _summary_writer_class():
    """tensorboardX's SummaryWriter, loaded without torch: tensorboardX.writer imports torch
    whenever it is installed, only to accept torch tensors (jaxdp writes floats), and that
    import was ~3 s of every run's start-up. ``sys.modules["torch"] = None`` makes that one
    ``import torch`` fail while tensorboardX loads; a process that has torch already keeps it."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class ScalarWriter:
    def __init__(self, writer_class, logdir: str, purge_step: Optional[int]):
        # purge_step: TensorBoard hides what an interrupted run logged past the checkpoint,
        # as metrics.jsonl drops those records.
        self._writer = writer_class(logdir, purge_step=purge_step)

    def write(self, record: dict) -> None:
        for name, value in record.items():
            if name in NOT_SCALARS or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue  # None (not measured yet), strings
            if math.isfinite(value):
                self._writer.add_scalar(f"{record['kind']}/{name}", value, record["step"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def open_scalar_writer(logdir: str, keep_through_step: int = 0) -> Optional[ScalarWriter]:
    """A writer, or None (with one line, once per process) when tensorboardX is missing."""
    try:
        writer_class = _summary_writer_class()
    except ImportError:
        if not _said_off[0]:
            _said_off[0] = True
            print("jaxdp: TensorBoard scalars are off (pip install tensorboardX, or jaxdp[tensorboard]); "
                  "metrics.jsonl has every number", file=sys.stderr, flush=True)
        return None
    return ScalarWriter(writer_class, logdir, purge_step=keep_through_step + 1 if keep_through_step else None)
