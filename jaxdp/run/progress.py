"""What a training run shows while it runs: images/s that mean something, and progress that
suits where the output goes (a live bar on a terminal, plain lines in a log file).

Shared by jaxdp's and torch_ref's trainers; no jax, no torch.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import deque
from typing import Optional


class Throughput:
    """Images per second, as the median of the last ``window`` step intervals.

    An interval is the time between two consecutive finished steps. The first one after a
    (re)start holds the compile, and the first after an evaluation holds the evaluation:
    neither is a step's time, so ``restart()`` drops it. The median keeps one slow step
    (a checkpoint, a noisy neighbour) from swinging the number.
    """

    def __init__(self, images_per_step: int, window: int = 20):
        self.images_per_step = images_per_step
        self.intervals: deque = deque(maxlen=window)
        self._last: Optional[float] = None

    def restart(self) -> None:
        """The next interval is not a step's (it holds a compile or an evaluation)."""
        self._last = None

    def tick(self) -> Optional[float]:
        """A step finished: the current images/s (None until one real interval is known)."""
        now = time.perf_counter()
        if self._last is not None:
            self.intervals.append(now - self._last)
        self._last = now
        if not self.intervals:
            return None
        return self.images_per_step / max(statistics.median(self.intervals), 1e-9)


class PlainProgress:
    """tqdm's interface (``update``, ``set_postfix``, ``close``) as plain lines: one every
    ``every`` steps and one at the end, for output that is not a terminal (no ``\\r``)."""

    def __init__(self, total: int, initial: int = 0, desc: str = "", every: Optional[int] = None,
                 file=None):
        self.total, self.n, self.desc = total, initial, desc
        self.every = every or max(1, total // 10)
        self.postfix = ""
        self.file = file or sys.stderr
        self._printed_at = initial

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{k} {v}" for k, v in values.items())

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n - self._printed_at >= self.every or self.n == self.total:
            self._print()

    def close(self) -> None:
        if self.n != self._printed_at:
            self._print()

    def _print(self) -> None:
        self._printed_at = self.n
        tail = f" ({self.postfix})" if self.postfix else ""
        print(f"{self.desc}: step {self.n}/{self.total}{tail}", file=self.file, flush=True)


class _Off:
    def update(self, n: int = 1) -> None: ...
    def set_postfix(self, **values) -> None: ...
    def close(self) -> None: ...


def progress_bar(total: int, initial: int, desc: str, enabled: bool):
    """A live tqdm bar when stderr is a terminal, ``PlainProgress`` lines when it is not,
    nothing when ``enabled`` is False."""
    if not enabled:
        return _Off()
    if sys.stderr.isatty():
        from tqdm.auto import tqdm  # only a live bar needs it: ~0.1 s to import

        return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)
    return PlainProgress(total, initial, desc)


def say(text: str) -> None:
    """A line on stdout that does not tear a live bar."""
    if sys.stderr.isatty():
        from tqdm.auto import tqdm  # only a live bar needs it: ~0.1 s to import

        tqdm.write(text)
    else:
        print(text, flush=True)
