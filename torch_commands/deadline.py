"""A run's hard stop, shared by gpu-check and the GPU bench: what is not started by the deadline
does not run (it is reported NOT RUN, and the verdict is INCOMPLETE), and what runs gets at most
the time that is left."""

from __future__ import annotations

import time
from typing import Optional


class Deadline:
    """``seconds`` from now (None or 0: no deadline)."""

    def __init__(self, seconds: Optional[float]):
        self.seconds = seconds or 0.0
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> Optional[float]:
        """Seconds left (may be <= 0), or None without a deadline."""
        return self.seconds - self.elapsed() if self.seconds else None

    def passed(self) -> bool:
        left = self.left()
        return left is not None and left <= 0

    def timeout(self, cap: float) -> float:
        """A step's timeout: ``cap``, or less when the deadline is nearer (never below a second)."""
        left = self.left()
        return cap if left is None else max(1.0, min(cap, left))

    def why(self) -> str:
        """The NOT RUN reason."""
        return f"deadline: {self.elapsed():.0f} s spent of the {self.seconds:.0f} s the run may take"
