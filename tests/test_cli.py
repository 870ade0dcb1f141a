"""The command line as a user meets it: help, version, abbreviations, and one-line errors
where a traceback used to be."""

import os
import re
import subprocess
import sys
import tomllib

import pytest

import jaxdp
from jaxdp.config import choices
from jaxdp.cli.command import build_parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "jaxdp.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_choices_are_the_libraries_own_lists():
    """The parser's jax-free lists (jaxdp.config.choices) name exactly what the library accepts."""
    import jaxdp.models
    import jaxdp.strategies
    from jaxdp.strategies.sync.ring import ALL_REDUCES
    from jaxdp.strategies.sync.allreduce import COMPRESSORS
    from jaxdp.data.datasets import DATASETS
    from jaxdp.optim import OPTIMIZERS, SCHEDULES

    assert choices.STRATEGIES == jaxdp.strategies.STRATEGIES
    assert choices.MODELS == jaxdp.models.MODELS
    assert choices.STEMS == jaxdp.models.STEMS
    assert choices.DTYPES == tuple(jaxdp.models.DTYPES)
    assert choices.DATASETS == DATASETS
    assert (choices.OPTIMIZERS, choices.SCHEDULES) == (OPTIMIZERS, SCHEDULES)
    assert choices.COMPRESSIONS == tuple(c for c in COMPRESSORS if c)
    assert choices.ALLREDUCES == tuple(ALL_REDUCES)


def test_version_is_the_package_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert "version" in project.get("dynamic", []) or project["version"] == jaxdp.__version__
    assert capsys.readouterr().out == f"jaxdp {jaxdp.__version__}\n"


def test_train_help_lists_every_choice_with_its_default():
    text = " ".join(build_parser()._subparsers._group_actions[0].choices["train"].format_help().split())
    for name in choices.STRATEGIES + choices.MODELS + choices.OPTIMIZERS + choices.SCHEDULES:
        assert name in text, name
    for shown in ("(default: ddp)", "(default: resnet18)", "(default: 0.1)", "(default: float32)",
                  "(default: 128)", "(default: runs/default)"):
        assert shown in text, shown


@pytest.mark.parametrize("command", ["train", "parity", "bench", "inspect", "launch"])
def test_abbreviated_options_are_refused(command, capsys):
    """argparse takes any unique prefix by default: --epoch would silently mean --epochs."""
    flag = {"train": "--epoch", "parity": "--step", "bench": "--global-batc", "inspect": "--strat",
            "launch": "--nproc"}[command]
    with pytest.raises(SystemExit) as done:
        main([command, flag, "2"])
    assert done.value.code == 2
    assert f"unrecognized arguments: {flag}" in capsys.readouterr().err


def test_unknown_choice_names_the_choices_in_one_line(capsys):
    assert main(["train", "--strategy", "zero4", "--out", os.devnull]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxdp: error: unknown strategy 'zero4'; choose one of ddp, zero1, zero2, zero3, ")
    assert err.count("\n") == 1


def test_launching_a_missing_program_is_one_line():
    done = run_cli("launch", "--nprocs", "1", "--", "no-such-program-jaxdp")
    assert done.returncode == 2, done.stderr
    assert done.stderr == "jaxdp: error: cannot start 'no-such-program-jaxdp': No such file or directory\n"


# Process 1 kills itself; process 0 notices (as a gloo peer would) and aborts a few ms later.
_PEER_DIES = """
import os, signal, sys, time
flag = sys.argv[1]
if os.environ["RANK"] == "1":
    open(flag, "w").close()
    os.kill(os.getpid(), signal.SIGKILL)
while not os.path.exists(flag):
    time.sleep(0.001)
time.sleep(0.005)
os.abort()
"""


def test_launch_names_the_process_that_died_first_not_the_peer_it_took_down(tmp_path):
    """A killed worker takes its peers down within milliseconds (a broken gloo connection
    aborts them). A 50 ms poll saw both dead and blamed process 0's SIGABRT; the launcher
    must name process 1's SIGKILL, the cause."""
    for attempt in range(3):
        flag = tmp_path / f"dead-{attempt}"
        done = run_cli("launch", "--nprocs", "2", "--", sys.executable, "-c", _PEER_DIES, str(flag))
        assert done.returncode == 128 + 9, done.stderr
        assert "failed: process 1 was killed by SIGKILL" in done.stderr, done.stderr


def test_launch_blames_the_real_failure_when_a_peers_abort_is_reaped_first():
    """On a loaded machine the peer's waiting thread can run first (seen under load 9)."""
    import queue
    import signal

    from jaxdp.cli import launch

    exits = queue.Queue()
    exits.put((1, -signal.SIGKILL))  # reaped a moment after process 0's collateral abort
    running = {1: object(), 2: object()}
    assert launch._cause(0, -signal.SIGABRT, exits, running) == (1, -signal.SIGKILL)
    assert list(running) == [2]
    assert launch._cause(2, -signal.SIGABRT, queue.Queue(), {}) == (2, -signal.SIGABRT)  # nothing better: the first


@pytest.mark.parametrize("argv, message", [
    (["inspect", "--devices", "0"], "jaxdp: error: --devices must be >= 1 (omit it for 8), got 0"),  # was: 8 used
    (["plan", "--devices", "-4"], "jaxdp plan: error: argument --devices: must be >= 1, got -4"),  # blamed the batch
])
def test_a_device_count_below_one_is_refused_naming_its_flag(argv, message, capsys):
    try:
        code = main(argv)
    except SystemExit as done:  # argparse's refusal
        code = done.code
    assert code == 2
    assert capsys.readouterr().err.splitlines()[-1] == message


def test_bad_job_variables_are_one_line(tmp_path, monkeypatch, capsys):
    """JAXDP_LOCAL_RANK=x was int()'s traceback; JAXDP_FAULT_AT=bogus was raised at import."""
    for k, v in {"JAXDP_COORDINATOR": "127.0.0.1:1", "JAXDP_NUM_PROCESSES": "2", "JAXDP_PROCESS_ID": "0",
                 "JAXDP_LOCAL_RANK": "x"}.items():
        monkeypatch.setenv(k, v)
    assert main(["train", "--out", str(tmp_path / "a")]) == 2
    assert capsys.readouterr().err == "jaxdp: error: JAXDP_LOCAL_RANK='x' is not an integer\n"
    done = subprocess.run([sys.executable, "-m", "jaxdp.cli", "train", "--out", str(tmp_path / "b")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, JAX_PLATFORMS="cpu", JAXDP_FAULT_AT="bogus"))
    assert done.returncode == 2
    assert done.stderr.startswith("jaxdp: error: JAXDP_FAULT_AT='bogus': expected <point>") and \
        done.stderr.count("\n") == 1, done.stderr
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")


def test_bench_with_nothing_to_run_says_why():
    done = run_cli("bench", "--devices", "3", "--global-batch-size", "8", "--no-torch", "--out", os.devnull)
    assert done.returncode == 2, done.stderr
    assert re.fullmatch(r"jaxdp: error: nothing to benchmark: every N in \[3\] was skipped \(only \d+ devices, "
                        r"or global batch 8 not divisible by N\)", done.stderr.strip().splitlines()[-1]), done.stderr


def test_parity_report_without_matplotlib_writes_the_json_and_says_so(tmp_path, monkeypatch, capsys):
    from parity_tests import report

    class Result:
        def to_json(self):
            return {"passed": True}

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails, as when not installed
    paths = report.write(Result(), str(tmp_path))
    assert paths == [str(tmp_path / "report.json")] and os.path.exists(paths[0])
    assert "no plot: matplotlib is not installed" in capsys.readouterr().err


# ----------------------------------------------------------------------------- config files

def train_config(argv):
    """The TrainConfig that ``jaxdp train`` would run for ``argv`` (nothing trained)."""
    from jaxdp.cli.command import config_from_args, with_file_options

    parser = build_parser()
    return config_from_args(with_file_options(parser, argv, parser.parse_args(argv)))


@pytest.mark.parametrize("ext", [".toml", ".json"])
def test_a_config_file_sets_options_and_flags_override_it(tmp_path, ext):
    path = tmp_path / f"run{ext}"
    if ext == ".toml":
        path.write_text('strategy = "zero3"\nwidth = 8\nblocks = [1, 1, 1, 1]\nglobal-batch-size = 64\nepochs = 3\n')
    else:
        path.write_text('{"strategy": "zero3", "width": 8, "blocks": [1, 1, 1, 1], "global_batch_size": 64, '
                        '"epochs": 3}')
    cfg = train_config(["train", "--config", str(path), "--epochs", "5"])
    assert (cfg.strategy, cfg.width, cfg.blocks, cfg.global_batch_size, cfg.epochs) == ("zero3", 8, (1, 1, 1, 1), 64, 5)
    assert cfg.lr == 0.1  # what neither says: the default


def test_a_run_directory_is_resumed_with_its_own_options(tmp_path):
    from jaxdp.config.tree import TrainConfig

    run = tmp_path / "r18"
    run.mkdir()
    (run / "config.json").write_text(TrainConfig(width=8, epochs=4, out="elsewhere", devices=2).to_json())
    cfg = train_config(["train", "--resume", str(run), "--devices", "4"])
    assert (cfg.out, cfg.resume, cfg.width, cfg.epochs, cfg.devices) == (str(run), True, 8, 4, 4)


@pytest.mark.parametrize("content, ext, message", [
    ("widht = 8\n", ".toml", "unknown option 'widht'; known: accept_unverified, accum_reduce, accum_steps, allreduce,"),
    ("width = \n", ".toml", "TOMLDecodeError"),
    ("width: 8\n", ".ini", "unknown format .ini; use .toml, .json or .yaml"),
    (None, ".toml", "no such file"),
])
def test_config_file_mistakes_are_one_line(tmp_path, capsys, content, ext, message):
    path = tmp_path / f"run{ext}"
    if content is not None:
        path.write_text(content)
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jaxdp: error: --config {path}: ") and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("line, expected", [
    ('tensorboard = "no"', 'tensorboard = "no": expected true or false'),
    ("width = 4.7", "width = 4.7: expected an integer"),
    ("max-steps = 4.0", "max-steps = 4.0: expected an integer"),
    ("blocks = [1, 1, 1]", 'blocks = [1, 1, 1]: expected a list of 4 integers (or the flag\'s text, e.g. "1,1,1,1")'),
    ("mesh = 4", "mesh = 4: expected a string"),
])
def test_a_config_value_of_the_wrong_type_is_one_line_naming_file_key_and_value(tmp_path, capsys, line, expected):
    """Typed as the flag is: before, a non-empty string was a true switch and 4.7 reached flax."""
    path = tmp_path / "run.toml"
    path.write_text(line + "\n")
    assert main(["train", "--config", str(path), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"jaxdp: error: --config {path}: {expected}\n"
    assert not (tmp_path / "out").exists()


def test_a_config_value_is_parsed_as_its_flag_text_would_be(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('overwrite = "false"\nprogress = false\nblocks = "1,2,1,1"\nlr = 1\nwidth = "8"\n'
                    'profile-steps = "2:4"\n')
    cfg = train_config(["train", "--config", str(path)])
    assert (cfg.overwrite, cfg.progress, cfg.blocks, cfg.lr, cfg.width, cfg.profile_steps) == (
        False, False, (1, 2, 1, 1), 1.0, 8, (2, 4))


def test_overwrite_false_in_a_config_file_never_deletes_a_run(tmp_path, capsys):
    from jaxdp.config.tree import TrainConfig

    out = tmp_path / "run"
    (out / "checkpoints" / "12").mkdir(parents=True)  # a finished run, as far as the refusal looks
    (out / "config.json").write_text(TrainConfig(out=str(out)).to_json())
    (out / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    path = tmp_path / "run.toml"
    path.write_text('overwrite = "false"\nwidth = 4\nblocks = [1, 1, 1, 1]\nsynthetic-size = [64, 32]\n'
                    'global-batch-size = 32\nmax-steps = 1\nprogress = false\n')
    assert main(["train", "--config", str(path), "--out", str(out)]) == 2
    assert "already holds checkpoints of an earlier run (latest step 12): pass --resume" in capsys.readouterr().err
    assert (out / "checkpoints" / "12").is_dir() and (out / "metrics.jsonl").read_text().count("\n") == 1


def test_resume_of_a_directory_that_is_no_run_is_one_line(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"jaxdp: error: --resume {tmp_path}: has no config.json (not a jaxdp run directory)\n"
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    assert main(["train", "--resume", str(run), "--out", str(tmp_path / "other")]) == 2
    assert f"--resume {run} continues the run in that directory: drop --out" in capsys.readouterr().err
