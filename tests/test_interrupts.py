"""Ctrl-C during the first compile: a clean exit with one line, never a crash.

Before the fix, a SIGINT that landed while XLA compiled the init raised KeyboardInterrupt
inside ``compile_and_load``, and the interpreter died of SIGSEGV at exit in 3 of 5 tries.
Each run here waits for JAX to hand a program to XLA (``JAX_LOG_COMPILES``: "Finished jaxpr
to MLIR module conversion"), sends SIGINT 0.2 s into the compile, and checks the exit
status and the last line. On the old code that crashed 3 times in 3 (the init's compile
takes ~0.4 s on a 2-core machine).
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from launch_helpers import job_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = ["--width", "4", "--blocks", "1,1,1,1", "--synthetic-size", "64,32", "--global-batch-size", "16",
         "--epochs", "1", "--devices", "2", "--no-progress", "--no-compile-cache"]


def interrupt_during(compile_name: str, out: str):
    """Run ``jaxdp train``; SIGINT while XLA compiles ``compile_name``."""
    env = job_env(JAX_LOG_COMPILES="1")
    proc = subprocess.Popen([sys.executable, "-m", "jaxdp.cli", "train", *SMOKE, "--out", out], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if f"Finished jaxpr to MLIR module conversion jit({compile_name})" in line:
                time.sleep(0.2)
                proc.send_signal(signal.SIGINT)
                break
        lines += proc.stdout.readlines()
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return code, lines


@pytest.mark.slow
@pytest.mark.parametrize("compile_name, message", [
    ("make", "jaxdp: interrupted before the first step: nothing to checkpoint\n"),  # the init (strategy.engine.init)
    ("local_step", "jaxdp: interrupted; step 1 was checkpointed: add --resume to continue\n"),  # the first step
])
def test_ctrl_c_during_the_first_compile_exits_cleanly(tmp_path, compile_name, message):
    code, lines = interrupt_during(compile_name, str(tmp_path / "run"))
    output = "".join(lines)
    assert any(f"conversion jit({compile_name})" in line for line in lines), output[-3000:]
    assert code == 130, f"exit status {code} (-11 is SIGSEGV):\n{output[-3000:]}"
    assert lines[-1] == message, output[-3000:]
    assert "Traceback" not in output and "Fatal Python error" not in output
