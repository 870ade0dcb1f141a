"""Running real multi-process jobs from the tests: ``jaxdp launch`` in a subprocess, with a
timeout, and no process left behind whatever happens."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np

_DEVICE_COUNT = "--xla_force_host_platform_device_count"
TINY_ARGS = ["--width", "4", "--blocks", "1,1,1,1", "--no-progress", "--lr", "0.05"]


def job_env(**extra):
    """The test process's environment minus its 8 simulated devices (each process gets its own)
    and any job variables (JAXDP_*, SLURM_*); the torch backend choice, conftest's
    compile-time XLA flags and its compile-cache threshold are kept, so a job's processes
    load their programs from jaxdp's persistent cache (its 2-process directory for the
    2-process jobs) across sessions, as a user's reruns do."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS",) and (not k.startswith(("JAXDP_", "SLURM_")) or k == "JAXDP_TORCH_BACKEND")}
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT)]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **extra)
    return env


def jaxdp(*args):
    return [sys.executable, "-m", "jaxdp.cli", *args]


class Job:
    """``jaxdp launch`` running in the background; its stderr is collected line by line."""

    def __init__(self, launch_args, command, env=None):
        self.proc = subprocess.Popen(jaxdp("launch", *launch_args, "--", *command), env=env or job_env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def pids(self, timeout=60.0):
        """The pids of the processes the launcher started, from its first line."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(r"pids ([\d ]+)\n", self.output)
            if m:
                return [int(p) for p in m.group(1).split()]
            time.sleep(0.02)
        raise AssertionError(f"the launcher named no pids:\n{self.output}")

    def wait(self, timeout):
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"job still running after {timeout} s (killed):\n{self.output[-5000:]}")
        self._reader.join(timeout=5)
        return code

    def kill(self):
        """Kill the launcher's session and every process it started (by pid)."""
        pids = []
        try:
            pids = self.pids(timeout=0)
        except AssertionError:
            pass
        for pid in [self.proc.pid, *pids]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait()


def run_job(launch_args, command, timeout, env=None):
    job = Job(launch_args, command, env)
    try:
        code = job.wait(timeout)
    finally:
        if job.proc.poll() is None:
            job.kill()
    return code, job.output


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def records(out, kind="train"):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def sample_records(out):
    """Every process's ``--log-sample-ids`` records, one list."""
    recs = []
    for name in sorted(os.listdir(out)):
        if name.startswith("sample_ids.p"):
            with open(os.path.join(out, name)) as f:
                recs += [dict(json.loads(line), file=name) for line in f if line.strip()]
    return recs


def epoch_ids(out, epoch):
    """All ids the run fed in ``epoch`` (a sorted array, repeats kept)."""
    ids = [np.asarray(r["ids"]).ravel() for r in sample_records(out) if r["epoch"] == epoch]
    return np.sort(np.concatenate(ids)) if ids else np.zeros(0, np.int64)

