"""A run directory with more than one process around it, or that is not all jaxdp's: one writer
(the lock), a folder of someone's own files refused, --overwrite that removes only what a run
writes, a full disk in one line, and a stop during the last evaluation that is not "finished".

Readers during a save and checkpoints without a manifest: test_checkpoint.py."""

import errno
import json
import logging
import os
import subprocess
import sys
import time

import pytest

from jaxdp.cli.command import main
from jaxdp.config.tree import TrainError
from jaxdp.run import lock as run_lock
from jaxdp.run import rundir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One epoch of 4 steps of 16 images over 2 devices (test_train's SMOKE: its compiled step is shared).
SMOKE = ["--width", "4", "--blocks", "1,1,1,1", "--synthetic-size", "64,32", "--global-batch-size", "16",
         "--epochs", "1", "--no-progress", "--devices", "2", "--no-tensorboard"]


def rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_steps(out):
    return [r["step"] for r in rows(out) if r["kind"] == "train"]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("jaxdp: error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0][len("jaxdp: error: "):]


# ----------------------------------------------------------------------------- one writer

def test_two_runs_started_on_one_out_one_trains_the_other_refuses_naming_it(tmp_path):
    """Two real ``jaxdp train`` processes: the second starts while the first holds the lock."""
    out = str(tmp_path / "run")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    command = [sys.executable, "-m", "jaxdp.cli", "train", *SMOKE, "--epochs", "2", "--out", out]
    first = subprocess.Popen(command + ["--seed", "1"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(out, run_lock.NAME)) and first.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    second = subprocess.run(command + ["--seed", "2"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    _, first_err = first.communicate(timeout=240)
    assert first.returncode == 0, first_err
    assert second.returncode == 2
    assert second.stderr.count("\n") == 1, second.stderr
    assert second.stderr.startswith(f"jaxdp: error: {out} is being written by another run (host ")
    assert f", pid {first.pid}, started " in second.stderr
    assert train_steps(out) == list(range(1, 9))  # one run's rows, whole, in order
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["seed"] == 1
    assert not os.path.exists(os.path.join(out, run_lock.NAME))  # released as the run ended


def test_a_lock_whose_holder_is_gone_is_taken_over_in_one_line(tmp_path, capsys):
    gone = {"host": "node7", "pid": 4242, "started": "2026-01-01T00:00:00+00:00"}
    (tmp_path / run_lock.NAME).write_text(json.dumps(gone) + "\n")  # a killed run's: no flock on it
    held = run_lock.RunLock(str(tmp_path))
    assert capsys.readouterr().err == (f"jaxdp: took over the lock on {tmp_path} from a run that is gone (host node7, "
                                       f"pid 4242, started 2026-01-01T00:00:00+00:00)\n")
    with pytest.raises(run_lock.RunDirInUse, match=rf"\(host .*, pid {os.getpid()}, started "):
        run_lock.RunLock(str(tmp_path))  # flock: a second open file description conflicts, even in one process
    held.release()
    assert os.listdir(tmp_path) == []
    run_lock.RunLock(str(tmp_path)).release()
    assert capsys.readouterr().err == ""


# ----------------------------------------------------------------------------- what --out may destroy

def foreign_dir(path):
    path.mkdir()
    (path / "config.json").write_text('{"experiment": "mine"}')
    (path / "metrics.jsonl").write_text('{"accuracy": 0.9}\n')
    return sorted(os.listdir(path))


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_a_fresh_run_refuses_a_folder_that_is_no_run(tmp_path, capsys, overwrite):
    out = tmp_path / "mine"
    before = foreign_dir(out)
    assert main(["train", *SMOKE, "--out", str(out), *overwrite]) == 2
    assert one_line_error(capsys) == (f"--out {out} is not empty and holds no jaxdp run (no config.json of one): "
                                      f"jaxdp writes runs into new or empty directories only; pick another --out")
    assert sorted(os.listdir(out)) == before and (out / "metrics.jsonl").read_text() == '{"accuracy": 0.9}\n'


def test_overwrite_removes_a_checkpoints_symlink_not_what_it_points_to(tmp_path):
    old = tmp_path / "old-checkpoints"
    (old / "7").mkdir(parents=True)  # another run's checkpoint, as orbax names it
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").symlink_to(old)
    assert main(["train", *SMOKE, "--max-steps", "1", "--out", str(out), "--overwrite"]) == 0
    assert os.listdir(old) == ["7"]  # the target is untouched
    assert not os.path.islink(out / "checkpoints") and os.listdir(out / "checkpoints") == ["1"]
    assert train_steps(out) == [1]


def test_overwrite_that_cannot_remove_a_file_stops_in_one_line(tmp_path, monkeypatch):
    out = tmp_path / "run"
    (out / "checkpoints" / "3").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("{}\n")
    real = os.remove

    def refuse(path, *args, **kwargs):
        if str(path).endswith("metrics.jsonl"):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "remove", refuse)
    with pytest.raises(TrainError, match=rf"^--overwrite: cannot remove {out}/metrics.jsonl \(Permission denied\); "
                                         r"the earlier run in .* is partly removed"):
        rundir.remove_run_files(str(out))
    assert (out / "metrics.jsonl").exists()


# ----------------------------------------------------------------------------- a full disk

class FullAfter:
    """A metrics.jsonl whose disk fills during its ``rows``-th row: half of the row lands."""

    def __init__(self, path, rows):
        self.file, self.left = open(path, "a"), rows

    def write(self, text):
        self.left -= 1
        if self.left == 0:
            self.file.write(text[:len(text) // 2])
            self.file.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.file.write(text)

    def __getattr__(self, name):
        return getattr(self.file, name)


def test_a_full_disk_during_a_metrics_row_is_one_line_and_leaves_whole_rows(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    monkeypatch.setattr(rundir, "_open_append", lambda path: FullAfter(path, 4))  # step 4's row
    assert main(["train", *SMOKE, "--checkpoint-every", "2", "--out", str(out)]) == 2
    assert one_line_error(capsys) == (f"no space left on the device writing a row of metrics.jsonl to "
                                      f"{out}/metrics.jsonl; the newest complete checkpoint: step 2 in "
                                      f"{out}/checkpoints")
    assert train_steps(out) == [1, 2, 3]  # whole rows only: the torn one is cut
    assert not os.path.exists(out / run_lock.NAME)


def test_a_full_disk_during_a_checkpoint_is_one_line_and_leaves_nothing_a_resume_reads(tmp_path, monkeypatch,
                                                                                        capsys, caplog):
    from jaxdp.checkpoint import store

    out = tmp_path / "run"
    real, saves = store.write_manifest, []

    def full(root):  # the manifest of the second checkpoint finds the disk full
        saves.append(root)
        if len(saves) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(root, store.MANIFEST))
        real(root)

    monkeypatch.setattr(store, "write_manifest", full)
    assert main(["train", *SMOKE, "--checkpoint-every", "2", "--out", str(out)]) == 2
    assert one_line_error(capsys) == (f"no space left on the device writing checkpoint 4 to {out}/checkpoints/4; "
                                      f"the newest complete checkpoint: step 2 in {out}/checkpoints")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []  # orbax's tracebacks
    assert [n for n in os.listdir(out / "checkpoints") if n.isdigit()] == ["2"]
    monkeypatch.setattr(store, "write_manifest", real)
    assert main(["train", *SMOKE, "--checkpoint-every", "2", "--resume", str(out)]) == 0
    assert "removed 1 partial save(s)" in capsys.readouterr().err
    assert sorted(os.listdir(out / "checkpoints")) == ["2", "4"] and train_steps(out) == [1, 2, 3, 4]


# ----------------------------------------------------------------------------- a stop in the last evaluation

def test_a_run_stopped_in_its_last_evaluation_is_not_finished_on_resume(tmp_path, monkeypatch, capsys):
    """Its state at the last step is checkpointed before the evaluation (the step in hand), so
    the resume is left with the evaluation alone: it runs it, and says nothing is finished."""
    from jaxdp.run import train as train_module

    out = tmp_path / "run"
    real = train_module.evaluate

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # as SIGINT/SIGTERM would land, while the job's launcher goes on to SIGKILL

    monkeypatch.setattr(train_module, "evaluate", interrupted)
    assert main(["train", *SMOKE, "--out", str(out)]) == 130
    assert os.listdir(out / "checkpoints") == ["4"] and [r["kind"] for r in rows(out)] == ["train"] * 4
    monkeypatch.setattr(train_module, "evaluate", real)
    capsys.readouterr()
    assert main(["train", "--resume", str(out)]) == 0
    assert "already finished" not in capsys.readouterr().err
    assert [(r["kind"], r["step"]) for r in rows(out)] == [("train", s) for s in range(1, 5)] + [("eval", 4)]
    assert main(["train", "--resume", str(out)]) == 2  # now it is
    assert "already finished its 1 epoch(s) (step 4)" in one_line_error(capsys)
