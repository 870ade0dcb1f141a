"""The kill campaign, ``make kill-check`` (not part of the suite: ~15 min on 2 busy cores).

A tiny float64 ``jaxdp train`` (2 epochs of 8 steps, a checkpoint every 5 steps, an evaluation
every 3, sample ids logged) is killed at every named write point (``jaxdp.runtime.durable.POINTS``,
through ``JAXDP_FAULT_AT``) and at random moments, in one process on 2 devices and in a 2-process
``jaxdp launch`` job, by SIGKILL, SIGTERM and SIGINT; each trial resumes (``--resume OUT``) until
the run is done and is compared with a run never killed (``run_dirs.differences``: final params,
optimizer state and BatchNorm statistics bit for bit; every metrics row, every step's sample ids
and every TensorBoard scalar exactly once, with the same numbers). One line per trial, then a
table (docs/checkpoints-and-faults.md shows the last one), also in OUT/kill-check.md.

    .venv/bin/python tests/kill_campaign.py [--out runs/kill-check] [--random 8] [--seed 0]
        [--only KILL,1p]     # trials whose line has these words

Exit status: 0 when every trial was exact, 1 otherwise.
"""

import argparse
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # launch_helpers, run_dirs
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this process only reads the runs back

import jax  # noqa: E402

from jaxdp.run.rundir import latest_orbax_step  # noqa: E402
from jaxdp.runtime.durable import ENV, POINTS  # noqa: E402
from jaxdp.runtime.startup import xla_accepts  # noqa: E402
from launch_helpers import Job, jaxdp, job_env  # noqa: E402
from run_dirs import differences  # noqa: E402

ARGS = ["--width", "4", "--blocks", "1,1,1,1", "--synthetic-size", "256,32", "--global-batch-size", "32",
        "--epochs", "2", "--lr", "0.05", "--dtype", "float64", "--no-progress", "--log-sample-ids",
        "--checkpoint-every", "5", "--eval-every", "3"]
# Evaluations after steps 3, 6, 8 (an epoch's end), 9, 12, 15, 16; checkpoints after 5, 8, 10, 15, 16.
# Where each point's kill lands (the nth time a process passes it), mid-run. config and
# log_rewrite happen as a run starts: their trials first kill a run after its first checkpoint.
LANDS = {"step": "7", "metrics_row": "9", "sample_row": "11", "checkpoint_write": "2", "checkpoint_manifest": "3",
         "checkpoint_done": "1", "config": "1", "log_rewrite": "2"}
FIRST = "checkpoint_done:2"  # checkpoints 5 and 8 written: something to resume
TOPOLOGY = {1: ["--devices", "2"], 2: []}  # 2 processes: --devices-per-proc 1 each
TIMEOUT = 300
# conftest.py's, those XLA takes (jaxlib 0.12 has no older emitters to choose)
SUITE_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


class Trial:
    def __init__(self, kind: str, processes: int, kills: list):
        self.kind, self.processes, self.kills = kind, processes, kills  # a kill: a JAXDP_FAULT_AT or "random"

    def title(self) -> str:
        what = ", then ".join("a random kill" if k == "random" else k for k in self.kills)
        return f"{self.processes}p  {self.kind:<6} {what}"


def named_trials() -> list:
    """Each point: SIGKILL in 1 process and in 2, SIGTERM in 1, SIGINT in 2 to one process (a job
    stops all together): process 1, or process 0 where only it writes (config.json; process 1's
    only log to cut on resume is its sample-id log, its first)."""
    trials = []
    for point in POINTS:
        setup = [FIRST] if point in ("config", "log_rewrite") else []
        spec = f"{point}:{LANDS[point]}"
        in_job = {"config": f"{spec}:INT@0", "log_rewrite": f"{point}:1:INT@1"}.get(point, f"{spec}:INT@1")
        trials += [Trial("KILL", 1, setup + [spec]), Trial("KILL", 2, setup + [spec]),
                   Trial("TERM", 1, setup + [f"{spec}:TERM"]), Trial("INT", 2, setup + [in_job])]
    return trials


def random_trials(count: int, rng: random.Random) -> list:
    """Kills at random moments, start-up included; half of them kill the resumed run again."""
    return [Trial("random", rng.choice((1, 2)), ["random"] * rng.choice((1, 2))) for _ in range(count)]


class Campaign:
    def __init__(self, out: str, rng: random.Random):
        self.out, self.rng = out, rng
        # Compiled as the suite compiles (conftest.py), so the runs load the suite's cached programs:
        # a 2-process job whose processes compile for long on a busy machine timed out in gloo's
        # rendezvous (30 s) before its first step.
        self.env = {**{k: v for k, v in job_env().items() if k != ENV},
                    "XLA_FLAGS": " ".join(f for f in SUITE_XLA_FLAGS if xla_accepts(f)),
                    "JAXDP_COMPILER_OPTIONS": "xla_backend_optimization_level=2",
                    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
        self.reference, self.seconds = {}, {}

    def command(self, run_dir: str, first: bool, processes: int) -> list:
        return jaxdp("train", *(ARGS + ["--out", run_dir] + TOPOLOGY[processes] if first else ["--resume", run_dir]))

    def start(self, run_dir: str, first: bool, processes: int, fault=None):
        env = self.env if fault is None else {**self.env, ENV: fault}
        command = self.command(run_dir, first, processes)
        if processes == 1:
            return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return Job(["--nprocs", "2", "--devices-per-proc", "1"], command, env=env)

    def references(self) -> None:
        """The runs never killed, one per topology (they agree bit for bit: a sum over 2 devices
        rounds alike in one process and in two)."""
        for processes in (1, 2):
            run_dir = os.path.join(self.out, f"reference-{processes}p")
            t = time.monotonic()
            code, output = finish(self.start(run_dir, True, processes))
            if code != 0:
                raise SystemExit(f"the reference run ({processes}p) failed:\n{output[-3000:]}")
            self.reference[processes], self.seconds[processes] = run_dir, time.monotonic() - t
        same = differences(self.reference[2], self.reference[1])
        print(f"references: 1 process {self.seconds[1]:.0f} s, 2 processes {self.seconds[2]:.0f} s; "
              f"{'the same run' if not same else 'they differ: ' + '; '.join(same)}", flush=True)

    def run(self, trial: Trial, run_dir: str) -> tuple:
        """(what each stage ended with, what the resumes said, the differences from the reference)."""
        shutil.rmtree(run_dir, ignore_errors=True)
        ends, said = [], []
        for kill in [*trial.kills, None]:
            fault = None if kill in (None, "random") else kill
            # A run stopped before its first checkpoint has nothing to resume: it starts again.
            stage = self.start(run_dir, latest_orbax_step(run_dir) is None, trial.processes, fault)
            if kill == "random":
                ends.append(self.kill_at_random(stage, trial.processes))
            code, output = finish(stage)
            said += [line for line in output.splitlines() if line.startswith("jaxdp: resuming from step")]
            # Done: it ended, or it had (a kill that landed after the run's last save: --resume says so).
            done = code == 0 or (code == 2 and "already finished its" in output)
            if kill is None and not done:
                return ends, said, [f"the last run failed (exit {code}): {output.strip().splitlines()[-1:]}"]
            if kill not in (None, "random"):
                ends.append(f"exit {code}" if code else "exit 0: the run ended before the kill landed")
            if done:
                break
        return ends, said, differences(run_dir, self.reference[trial.processes])

    def kill_at_random(self, stage, processes: int) -> str:
        """A random signal to a random process of the stage, at a random moment within most of a
        whole run's time (a resumed run is shorter)."""
        wait = self.rng.uniform(0.5, 0.7 * self.seconds[processes])
        kind = self.rng.choice(("KILL", "KILL", "TERM", "INT"))
        pids = [stage.pid] if processes == 1 else stage.pids()
        pid = self.rng.choice(pids)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and running(stage):
            time.sleep(0.05)
        if not running(stage):
            return f"SIG{kind} after {wait:.1f} s: the run had ended"
        try:
            os.kill(pid, getattr(signal, f"SIG{kind}"))
        except ProcessLookupError:
            return f"SIG{kind} after {wait:.1f} s: the process had ended"
        return f"SIG{kind} to process {pids.index(pid)} after {wait:.1f} s"


def running(stage) -> bool:
    return (stage.poll() if isinstance(stage, subprocess.Popen) else stage.proc.poll()) is None


def finish(stage) -> tuple:
    """(exit status, output) of a stage, killed if it overruns."""
    if isinstance(stage, subprocess.Popen):
        try:
            output, _ = stage.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            stage.kill()
            output, _ = stage.communicate()
            return -1, output + f"\n(killed after {TIMEOUT} s)"
        return stage.returncode, output
    try:
        return stage.wait(TIMEOUT), stage.output
    except AssertionError as e:  # launch_helpers.Job: still running after the timeout (killed)
        return -1, str(e)


def table(results: list) -> str:
    """The summary: per kind of trial, how many and how many exact."""
    groups = {}
    for trial, kills, exact in results:
        key = (trial.kind, trial.processes)
        row = groups.setdefault(key, [0, 0, 0])
        row[0] += 1
        row[1] += kills
        row[2] += exact
    names = {"KILL": "SIGKILL at each named point", "TERM": "SIGTERM at each named point",
             "INT": "SIGINT at each named point (to one process)", "random": "a random signal at a random moment"}
    lines = ["| trials | processes | kills | runs exact |", "|---|---|---|---|"]
    for (kind, processes), (count, kills, exact) in sorted(groups.items(), key=lambda kv: (list(names).index(kv[0][0]),
                                                                                              kv[0][1])):
        lines.append(f"| {names[kind]} | {processes} | {kills} | {exact} of {count} |")
    count = len(results)
    lines.append(f"| all | | {sum(k for _, k, _ in results)} | {sum(e for _, _, e in results)} of {count} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/kill-check")
    parser.add_argument("--random", type=int, default=8, help="trials killed at random moments")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=None, help="comma-separated words a trial's line must hold, e.g. KILL,2p")
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_x64", True)  # the runs' float64 arrays, read back whole
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax, reading a checkpoint's state folder alone
    rng = random.Random(args.seed)
    trials = named_trials() + random_trials(args.random, rng)
    if args.only:
        trials = [t for t in trials if all(word in t.title() for word in args.only.split(","))]
    os.makedirs(args.out, exist_ok=True)
    t_start = time.monotonic()
    campaign = Campaign(args.out, rng)
    campaign.references()
    results = []
    for n, trial in enumerate(trials, 1):
        t = time.monotonic()
        ends, said, problems = campaign.run(trial, os.path.join(args.out, f"trial-{n:02d}"))
        kills = sum(1 for e in ends if "ended" not in e)
        results.append((trial, kills, not problems))
        verdict = "exact" if not problems else "NOT EXACT: " + "; ".join(problems)
        print(f"{n:3d}/{len(trials)}  {trial.title():<58} {'; '.join(ends)}; {len(said)} resume(s); "
              f"{time.monotonic() - t:4.0f} s  {verdict}", flush=True)
        for line in said:
            print(f"        {line}", flush=True)
    minutes = (time.monotonic() - t_start) / 60
    summary = table(results) + f"\n\n{len(results)} trials in {minutes:.1f} min (jax {jax.__version__}, CPU)"
    print("\n" + summary)
    with open(os.path.join(args.out, "kill-check.md"), "w") as f:
        f.write(summary + "\n")
    return 0 if all(exact for _, _, exact in results) else 1


if __name__ == "__main__":
    sys.exit(main())
