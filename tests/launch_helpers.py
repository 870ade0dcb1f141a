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



# A process that starts two grandchildren, one in its own group and one in a new session (as a
# daemon would), writes "its pid, theirs" to ARGV[1] + its process id, and sleeps: a process tree
# for the launcher tests that costs no training. Process 1 exits with 3 after writing when ARGV[2]
# is "fail".
TREE = ("import os, subprocess, sys, time\n"
        "kids = [subprocess.Popen(['sleep', '120']), subprocess.Popen(['sleep', '120'], start_new_session=True)]\n"
        "path = sys.argv[1] + os.environ['JAXDP_PROCESS_ID']\n"
        "with open(path + '.tmp', 'w') as f:\n"
        "    f.write(' '.join(str(p) for p in [os.getpid()] + [k.pid for k in kids]))\n"
        "os.replace(path + '.tmp', path)\n"
        "if sys.argv[2:] == ['fail'] and os.environ['JAXDP_PROCESS_ID'] == '1':\n"
        "    sys.exit(3)\n"
        "time.sleep(120)\n")


def wait_for_files(paths, timeout: float = 60.0):
    """The text of each of ``paths``, once all exist (each written whole: a rename)."""
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            raise AssertionError(f"not written within {timeout} s: {[str(p) for p in paths if not os.path.exists(p)]}")
        time.sleep(0.02)
    texts = []
    for p in paths:
        with open(p) as f:
            texts.append(f.read())
    return texts


def tree_pids(prefix: str, processes: int, timeout: float = 60.0):
    """The pids TREE's processes wrote: [process 0's three, process 1's three, ...]."""
    texts = wait_for_files([f"{prefix}{k}" for k in range(processes)], timeout)
    return [int(x) for text in texts for x in text.split()]


def gone_within(pids, seconds: float):
    """The pids still alive after waiting up to ``seconds`` for all of them to end."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def kill_all(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def sleep_in_rank(path: str) -> None:
    """A torch_ref rank's work for the launcher test: say its pid (in ``path`` + rank), then sleep."""
    rank = os.environ["RANK"]
    with open(f"{path}{rank}.tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(f"{path}{rank}.tmp", f"{path}{rank}")
    time.sleep(120)


def _hex_address(text: str) -> str:
    """/proc/net/tcp{,6}'s hex address -> its IP text (IPv4: one little-endian word; IPv6: four;
    an IPv4-mapped IPv6 address as its IPv4 address)."""
    import ipaddress

    raw = bytes.fromhex(text)
    ip = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
    return str(getattr(ip, "ipv4_mapped", None) or ip)


def listening(port: int):
    """The addresses this host listens on at TCP ``port`` (from /proc/net/tcp and tcp6, no tool)."""
    found = []
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/net/{name}") as f:
                rows = [line.split() for line in list(f)[1:]]
        except OSError:
            continue
        for row in rows:
            address, hex_port = row[1].split(":")
            if row[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(_hex_address(address))
    return found


# A 2-process job's process, one device each: it joins the job, builds a tiny run's state and the
# header a run prints (jax 0.10.2 could not list the shards of its step counter), and process 0,
# which runs the coordinator, prints where this host listens on the coordinator's port.
BUILD_AND_LISTEN = ("import os, sys\n"
                    "from jaxdp.config.tree import TrainConfig\n"
                    "from jaxdp.run.setup import build, example_batch, startup_header\n"
                    "import jax\n"
                    "sys.path.insert(0, sys.argv[1])\n"
                    "from launch_helpers import listening\n"
                    "cfg = TrainConfig(width=4, blocks=(1, 1, 1, 1), synthetic_size=(16, 8), global_batch_size=4)\n"
                    "setup = build(cfg)\n"
                    "state = setup.trainer.init(jax.random.key(0), example_batch(setup.strategy.model))\n"
                    "sys.stdout.write('HEADER ' + startup_header(cfg, setup.strategy, state, setup.per_device)"
                    ".splitlines()[-1] + '\\n')\n"
                    "if jax.process_index() == 0:\n"
                    "    port = int(os.environ['JAXDP_COORDINATOR'].rsplit(':', 1)[1])\n"
                    "    sys.stdout.write('LISTENING ' + (' '.join(listening(port)) or 'nothing') + '\\n')\n")
