"""A run killed at each named write point (``jaxdp.runtime.durable.POINTS``) and resumed is the
run that was never killed: params, optimizer state and BatchNorm statistics bit for bit, and every
train and eval row of metrics.jsonl, every step's sample ids and every TensorBoard scalar exactly
once, with the same numbers, against an uninterrupted float64 run.

The kills are chained: each stage resumes what the one before left and dies at the next point
(``JAXDP_FAULT_AT``), so one run visits every point, and later stages resume from what a kill at
an earlier point left. SIGKILL: ``jaxdp train`` in a subprocess, and a 2-process ``jaxdp launch``
job; SIGTERM and SIGINT: ``train`` in this process (the same deferred stop as the command's).
``make kill-check`` (tests/kill_campaign.py) kills at every point in both topologies, with all three
signals, and at random moments.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxdp.config.tree import TrainConfig
from jaxdp.runtime import durable
from jaxdp.run.rundir import JsonLines, checkpoint_covers
from jaxdp.run.train import train
from launch_helpers import jaxdp, job_env, run_job
from run_dirs import differences

pytestmark = pytest.mark.float64

# 3 epochs of 4 steps; evaluations after steps 2, 4, 6, 8, 10, 12 (4, 8 and 12 end an epoch);
# checkpoints after 3, 4, 6, 8, 9 and 12.
RUN = dict(width=4, blocks=(1, 1, 1, 1), synthetic_size=(128, 32), global_batch_size=32, epochs=3, lr=0.05,
           dtype="float64", progress=False, log_sample_ids=True, checkpoint_every=3, eval_every=2)
ARGS = ["--width", "4", "--blocks", "1,1,1,1", "--synthetic-size", "128,32", "--global-batch-size", "32",
        "--epochs", "3", "--lr", "0.05", "--dtype", "float64", "--no-progress", "--log-sample-ids",
        "--checkpoint-every", "3", "--eval-every", "2"]  # RUN on the command line

# Where each stage dies: JAXDP_FAULT_AT without the signal. What the stage before left: comments
# (step s = after step s).
KILLS = [
    "checkpoint_done:1",  # checkpoint 3 complete: is row 3 on disk?
    "config:1",  # resuming from 3: config.json half replaced (the next stage resumes from it alone)
    "log_rewrite:1",  # resuming from 3: metrics.jsonl being cut back to the rows checkpoint 3 covers
    "log_rewrite:2",  # resuming from 3: the same for sample_ids.p0.jsonl
    "step:2",  # steps 4 (evaluated, checkpointed) and 5 done; 5 has no row yet
    "metrics_row:2",  # from 4: rows 5 and 6 written, not 6's evaluation
    "checkpoint_write:1",  # from 4: checkpoint 6 half written
    "checkpoint_manifest:1",  # from 4 (6's leftover removed): checkpoint 6 complete under a temporary name
    "sample_row:3",  # from 4 (6 never listed, removed): steps 5, 6 and 7's sample ids written
]
# In a 2-process job, where the second process adds something: orbax's commit waits for both;
# process 1 writes its own sample-id log (@1: process 1 alone dies there, and the launcher stops
# process 0 wherever it is); a SIGTERM to one process stops both at one agreed step, also while a
# resumed job starts. (make kill-check kills a job at every point.)
JOB_KILLS = [
    "checkpoint_write:2",  # checkpoint 3 written, 4 (an epoch's end) half written
    "config:1:TERM@0",  # resuming from 3: both stop after this run's first step, 4, checkpointed
    "sample_row:6@1",  # from 4: steps 5, 6 (checkpointed), 7, 8 (checkpointed), 9, 10's ids in process 1's log
]
# SIGTERM and SIGINT stop the run at the step's end (or the epoch's end), checkpointed; the last
# one lands in the run's last step, which then ends the run as if nothing had been asked.
STOPS = [
    "step:2",  # stops after step 2
    "config:1",  # resuming from 2: stops before its first step
    "log_rewrite:2",  # the same, at the sample-id log
    "metrics_row:1",  # from 2: row 3, during checkpoint 3's save
    "checkpoint_write:1",  # from 3: in checkpoint 4 (an epoch's end, after its evaluation)
    "checkpoint_manifest:1",  # from 4: in checkpoint 6
    "checkpoint_done:1",  # from 6: after checkpoint 8
    "sample_row:2",  # from 8: steps 9 and 10, stopping after 10's evaluation
    "step:2",  # from 10: in step 12, the last
]


def test_the_chains_visit_every_point():
    def points(chain):
        return sorted({spec.split(":")[0] for spec in chain})
    assert points(KILLS) == sorted(durable.POINTS) == points(STOPS)


def test_a_fault_spec_is_checked_and_arms_only_its_point():
    with pytest.raises(ValueError, match=r"JAXDP_FAULT_AT='chekpoint_write:2': expected <point>\[:<nth>\]"):
        durable.arm("chekpoint_write:2")
    try:
        durable.arm("step:2:TERM@1")  # process 1 of a job only: not this one
        assert not durable._ARMED.here
        durable.arm("step:3:TERM")  # the 3rd step: two pass, other points do not count
        for point in ("step", "metrics_row", "step", "metrics_row"):
            durable.fault_point(point)
        assert durable._ARMED.hits == 2
    finally:
        durable.arm(None)
    assert durable._ARMED is None


def test_a_resume_keeps_the_covered_rows_in_place_and_cuts_the_rest(tmp_path):
    """The rows of steps up to the checkpoint's stay byte for byte where they are (no rewrite); the
    rows after them, a torn last one included, go; an evaluation of the checkpoint's step goes
    too when the resumed run evaluates that step again."""
    rows = [{"kind": "train", "step": 1}, {"kind": "train", "step": 2}, {"kind": "eval", "step": 2},
            {"kind": "train", "step": 3}, {"kind": "eval", "step": 3}, {"kind": "train", "step": 4}]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "tra'  # cut short by a power cut
    for evaluates_again, kept in ((False, 5), (True, 4)):
        path = tmp_path / f"metrics{evaluates_again}.jsonl"
        path.write_text(text)
        inode = path.stat().st_ino
        log = JsonLines(str(path), True, checkpoint_covers(3, evaluates_again))
        log.write({"kind": "train", "step": 4})
        log.close()
        written = "".join(json.dumps(r) + "\n" for r in rows[:kept])
        assert (log.kept, log.dropped) == (kept, len(rows) + 1 - kept)
        assert path.read_text() == written + '{"kind": "train", "step": 4}\n' and path.stat().st_ino == inode
        assert log.resumed() == f"{path.name} kept {kept} row(s), dropped {len(rows) + 1 - kept}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    cfg = TrainConfig(out=str(tmp_path_factory.mktemp("whole")), devices=2, **RUN)
    return cfg, train(cfg)


# ----------------------------------------------------------------------------- SIGKILL

@pytest.mark.slow
def test_sigkill_at_every_point_then_resume_is_the_uninterrupted_run(tmp_path, uninterrupted):
    """``jaxdp train`` on 2 devices, SIGKILLed at each point in turn (``KILLS``); each next stage
    resumes with ``--resume OUT`` alone, so it reads the config.json the kill left."""
    outputs = kill_chain(str(tmp_path / "run"), KILLS, job=False)
    assert_same_run(str(tmp_path / "run"), uninterrupted[0].out)
    said = resume_lines(outputs)
    assert len(said) == len(KILLS) - 3  # the stages killed at config and log_rewrite died before saying it
    # From 4 after the kill at row 6 (rows 1, 2, its evaluation, 3, 4, its evaluation kept; 5 and 6
    # dropped), then after the kill in checkpoint 6's write (and 6's evaluation dropped too).
    assert said[2] == ("jaxdp: resuming from step 4 (epoch 2, sample 0 of 128); metrics.jsonl kept 6 row(s), "
                       "dropped 2; sample_ids.p0.jsonl kept 4 row(s), dropped 2"), said
    assert said[3] == ("jaxdp: resuming from step 4 (epoch 2, sample 0 of 128); removed 1 partial save(s) "
                       "(6.orbax-checkpoint-tmp); metrics.jsonl kept 6 row(s), dropped 3; sample_ids.p0.jsonl "
                       "kept 4 row(s), dropped 2"), said


@pytest.mark.slow
def test_kills_in_a_two_process_job_then_resume_is_the_uninterrupted_run(tmp_path, uninterrupted):
    """``jaxdp launch``, 2 processes of 1 device (a sum over 2 devices rounds alike in one process
    and in two: the same bits as the reference), killed or stopped at ``JOB_KILLS``."""
    outputs = kill_chain(str(tmp_path / "run"), JOB_KILLS, job=True)
    assert_same_run(str(tmp_path / "run"), uninterrupted[0].out)
    said = resume_lines(outputs)
    assert said[0].startswith("jaxdp: resuming from step 3 (epoch 1, sample 96 of 128); removed 1 partial save(s) "
                              "(4.orbax-checkpoint-tmp)"), said
    # The SIGTERM while the resumed job started: both stopped after step 4 and its evaluation.
    assert said[1].startswith("jaxdp: resuming from step 4 (epoch 2, sample 0 of 128); metrics.jsonl kept 6 row(s), "
                              "dropped 0"), said


def kill_chain(out, kills, job: bool) -> list:
    """Run stage after stage, each stopped where ``kills`` says (SIGKILL unless it names another
    signal), then one to the end; their output."""
    env = job_env(JAXDP_COMPILER_OPTIONS=os.environ["JAXDP_COMPILER_OPTIONS"])  # the reference's step program
    outputs = []
    for i, spec in enumerate([*kills, None]):
        command = jaxdp("train", *(ARGS + ["--out", out] + ([] if job else ["--devices", "2"]) if i == 0
                                   else ["--resume", out]))
        stage_env = env if spec is None else {**env, durable.ENV: spec}
        point, nth, kind = (spec.split("@")[0].split(":") + ["KILL"])[:3] if spec else (None,) * 3
        if job:
            code, output = run_job(["--nprocs", "2", "--devices-per-proc", "1"], command, timeout=240, env=stage_env)
        else:
            done = subprocess.run(command, env=stage_env, capture_output=True, text=True, timeout=240)
            code, output = done.returncode, done.stdout + done.stderr
        outputs.append(output)
        if spec is None:
            assert code == 0, output[-5000:]
        else:  # killed there (the launcher exits 128 + the signal), or stopped with its own exit status
            stopped = {"KILL": (-9, 137), "TERM": (143,), "INT": (130,)}[kind]
            assert code in stopped and f"SIG{kind} at {point} (time {nth})" in output, (spec, code, output[-5000:])
    # A CLI user reads a warning as one line, without Python's source path and code line.
    assert not [line for o in outputs for line in o.splitlines() if re.search(r"\.py:\d+: \w*Warning", line)]
    return outputs


def resume_lines(outputs) -> list:
    return [line for o in outputs for line in o.splitlines() if line.startswith("jaxdp: resuming from step")]


# ----------------------------------------------------------------------------- SIGTERM, SIGINT

@pytest.mark.parametrize("kind", ["TERM", "INT"])
def test_sigterm_or_sigint_at_every_point_then_resume_is_the_uninterrupted_run(tmp_path, uninterrupted, kind, capsys):
    """The signal at each point (``STOPS``) stops the run at the step's end, checkpointed, with
    ``Preempted`` (SIGTERM) or ``KeyboardInterrupt`` (SIGINT); the next stage resumes from there.
    The last stage's signal lands in the run's last step: the run ends as it would have."""
    cfg = dataclasses.replace(uninterrupted[0], out=str(tmp_path / "run"))
    exception = "Preempted" if kind == "TERM" else "KeyboardInterrupt"
    for i, spec in enumerate(STOPS):
        durable.arm(f"{spec}:{kind}")
        try:
            if i < len(STOPS) - 1:
                with pytest.raises(KeyboardInterrupt) as stopped:
                    train(dataclasses.replace(cfg, resume=i > 0))
                assert type(stopped.value).__name__ == exception and stopped.value.checkpointed_step, spec
            else:
                try:
                    summary = train(dataclasses.replace(cfg, resume=True))
                except KeyboardInterrupt as e:  # raised on, it would stop pytest itself
                    pytest.fail(f"{spec}: a stop asked in the run's last step raised {type(e).__name__}; the "
                                f"run should end as it would have")
        finally:
            durable.arm(None)
        point, nth = spec.split(":")
        assert f"SIG{kind} at {point} (time {nth})" in capsys.readouterr().err
    assert summary["steps"] == 12 and not summary["interrupted"]
    assert_same_run(cfg.out, uninterrupted[0].out)
    for a, b in zip(jax.tree_util.tree_leaves(summary["state"]), jax.tree_util.tree_leaves(uninterrupted[1]["state"]),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ----------------------------------------------------------------------------- the comparison

def assert_same_run(out, whole):
    """The run in ``out`` is the run in ``whole`` (``run_dirs.differences``)."""
    assert differences(out, whole) == []


# ----------------------------------------------------------------------------- warnings

def test_a_warning_is_one_line_for_a_cli_user_and_pythons_for_a_library_user(tmp_path, uninterrupted, monkeypatch,
                                                                              capsys):
    """The newest checkpoint corrupt: ``jaxdp train --resume`` says so in one line and falls back; the
    library's callers get Python's warning, source path included."""
    import shutil
    import warnings

    from jaxdp.checkpoint import remove_partial_saves
    from jaxdp.cli.command import main

    def shown(message, category, filename, lineno, file=None, line=None):  # what a terminal shows (pytest records)
        print(warnings.formatwarning(message, category, filename, lineno, line), end="", file=file or sys.stderr)

    out = str(tmp_path / "run")
    shutil.copytree(uninterrupted[0].out, out)
    shutil.rmtree(os.path.join(out, "checkpoints", "12"))  # as if killed before the last save: 8 and 9 remain
    state = os.path.join(out, "checkpoints", "9", "state")
    garbled = max((os.path.join(d, n) for d, _, names in os.walk(state) for n in names), key=os.path.getsize)
    with open(garbled, "r+b") as f:
        f.truncate(os.path.getsize(garbled) - 1)
    monkeypatch.setattr(warnings, "showwarning", shown)
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert main(["train", "--resume", out]) == 0
        err = capsys.readouterr().err
        assert f"jaxdp: warning: checkpoint {os.path.dirname(state)} is corrupt: file {garbled} has " in err, err
        assert ("; falling back to step 8\njaxdp: resuming from step 8 (epoch 3, sample 0 of 128); metrics.jsonl "
                "kept 12 row(s), dropped 6; sample_ids.p0.jsonl kept 8 row(s), dropped 4\n") in err, err
        assert not re.search(r"\.py:\d+", err), err
        assert warnings.formatwarning is warnings._formatwarning_orig  # put back for whoever runs next
        os.makedirs(os.path.join(out, "checkpoints", "13.orbax-checkpoint-tmp"))
        remove_partial_saves(os.path.join(out, "checkpoints"))  # the library: Python's warning, from where
        err = capsys.readouterr().err
        assert re.search(r"\.py:\d+: PartialSavesRemoved: removed 1 partially written checkpoint\(s\) left by an "
                         r"interrupted save: 13\.orbax-checkpoint-tmp in ", err), err
    assert_same_run(out, uninterrupted[0].out)
