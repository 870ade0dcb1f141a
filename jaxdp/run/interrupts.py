"""Ctrl-C and SIGTERM for a training run: stop between steps, checkpoint, exit cleanly.

Shared by jaxdp's and torch_ref's trainers; no jax, no torch.

Why the signals are deferred from the very start of a run, compile included: Python
raises ``KeyboardInterrupt`` in the main thread wherever it stands, and during the first
compile that is inside XLA's ``compile_and_load``. The exception unwinds through XLA while
its compile is half done, and the interpreter then crashed at exit (SIGSEGV in 3 of 5
tries, measured with jax 0.10.2). Deferred, Ctrl-C only sets a flag: the trainer looks at
it between steps (and once the state is built), checkpoints what it has and returns.

A second Ctrl-C ends the process at once (exit status 130), without a checkpoint and
without unwinding through whatever native code is running: an exception there is the
crash above.

In a multi-process job SIGTERM belongs to JAX's preemption sync manager (it catches the
signal in C++, and every process stops at one agreed step: ``jaxdp.runtime.distributed``), so only
Ctrl-C is caught here; it is handed to that same manager as a SIGTERM, so that Ctrl-C, too,
stops every process at one step.
"""

import os
import signal
import sys
import threading

EXIT_ABORTED = 130  # 128 + SIGINT, as the signal's default action would


class Preempted(KeyboardInterrupt):
    """SIGTERM (a scheduler's preemption, ``kill``): the step in hand was checkpointed."""


class DeferredInterrupt:
    """While active, Ctrl-C (SIGINT) and SIGTERM only set ``requested``; the trainer checks
    it between steps, then checkpoints and raises ``exception()`` (``KeyboardInterrupt``, or
    ``Preempted`` for SIGTERM). Raised where the signal lands, the interrupt could split a
    step from its bookkeeping (or hit a step whose input buffers were already donated, or
    an XLA compile), and the checkpoint would not be the step it claims.

    ``job=True`` (a multi-process job): SIGTERM is left to JAX, and Ctrl-C is forwarded to
    it as SIGTERM (see the module docstring). Only installed from the main thread over the
    default handlers: an ignored signal (a background job) or an application's own handler
    is left alone.
    """

    def __init__(self, prog: str, job: bool = False):
        self.prog, self.job = prog, job
        self.requested = False
        self.preempted = False
        main = threading.current_thread() is threading.main_thread()
        wanted = ((signal.SIGINT, signal.default_int_handler),) + (() if job else ((signal.SIGTERM, signal.SIG_DFL),))
        self._signals = [s for s, default in wanted if main and signal.getsignal(s) is default]
        self._previous = {}

    def __enter__(self) -> "DeferredInterrupt":
        for s in self._signals:
            self._previous[s] = signal.signal(s, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def exception(self) -> KeyboardInterrupt:
        return Preempted() if self.preempted else KeyboardInterrupt()

    def preempted_now(self) -> None:
        """The job agreed to stop here (JAX's preemption sync point)."""
        self.requested = True
        self.preempted = self.preempted or not self._ctrl_c

    _ctrl_c = False

    def _say(self, text: str) -> None:
        print(f"\n{self.prog}: {text}", file=sys.stderr, flush=True)

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGTERM:
            self.requested = self.preempted = True
            self._say("SIGTERM: finishing this step, then checkpointing it and exiting")
            return
        if self.requested:
            self._say("Ctrl-C again: aborting without a checkpoint")
            sys.stderr.flush()
            os._exit(EXIT_ABORTED)
        self._ctrl_c = True
        if self.job and _jax_owns_sigterm():
            # JAX's sync manager owns SIGTERM in a job: it makes every process stop at one step.
            os.kill(os.getpid(), signal.SIGTERM)
        else:  # one process, or a job not yet joined (nothing trained: each may stop alone)
            self.requested = True
        self._say("Ctrl-C: finishing this step, then checkpointing it (Ctrl-C again to abort "
                  "without a checkpoint)")


def _jax_owns_sigterm() -> bool:
    """Whether JAX's preemption sync manager runs here (it catches SIGTERM), without importing jax."""
    distributed = sys.modules.get("jax._src.distributed")
    return getattr(getattr(distributed, "global_state", None), "preemption_sync_manager", None) is not None


def interrupted_message(e: KeyboardInterrupt) -> str:
    """What the command line says after ``train`` raised ``e`` (both trainers)."""
    step = getattr(e, "checkpointed_step", None)
    what = "preempted (SIGTERM)" if isinstance(e, Preempted) else "interrupted"
    if step == 0:
        return f"{what} before the first step: nothing to checkpoint"
    if step is not None:
        return f"{what}; step {step} was checkpointed: add --resume to continue"
    return f"{what}; --resume continues from the last checkpoint, if any"


def exit_status(e: KeyboardInterrupt) -> int:
    """128 + the signal, as the signal's default action would have exited."""
    return 128 + signal.SIGTERM if isinstance(e, Preempted) else EXIT_ABORTED
