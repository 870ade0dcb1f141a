"""The ``jaxdp`` command: train, launch, inspect, plan; parity, bench and export with the [torch] extra.

Every subcommand is a ``Command`` (``jaxdp.cli.commands``): jaxdp's own are ``BUILT_IN`` below
(inspect's and plan's in inspect_command.py and plan_command.py); the torch side's are
registered by entry point (``jaxdp.commands``) and loaded only when they, or the full help, are
asked for: ``jaxdp train`` never imports the torch side.

The parser is built from jax-free modules (the configuration tree, ``jaxdp.config.tree``), so
that ``main`` can set ``--devices N`` as XLA's simulated-device flag (``jaxdp.runtime.startup``)
before a command's own modules, which import jax, are loaded.
"""

import argparse
import contextlib
import functools
import sys
import warnings
from typing import List, Optional

from jaxdp import __version__
from jaxdp.names import ChoiceError
from jaxdp.config import files as config_file
from jaxdp.runtime import durable, startup
from jaxdp.cli.commands import Command, CommandError, registered
from jaxdp.cli.inspect_command import INSPECT
from jaxdp.cli.plan_command import PLAN
from jaxdp.config.tree import SECTIONS, SHARED, TrainConfig, TrainError, check_config
from jaxdp.runtime.distributed import distributed_env
from jaxdp.config.flags import PARSER_OPTIONS, add_arguments
from jaxdp.run.interrupts import exit_status, interrupted_message
from jaxdp.cli.launch import LaunchError, launch
from jaxdp.runtime.mesh import MeshDims, MeshError


def add_train_args(p: argparse.ArgumentParser) -> None:
    """The flags both trainers take (torch_ref.train shares these): the tree's shared sections."""
    _add_sections(p, SHARED)


def _add_sections(p: argparse.ArgumentParser, titles) -> None:
    for title in titles:
        add_arguments(p.add_argument_group(title), SECTIONS[title])


def config_from_args(args: argparse.Namespace):
    fields = TrainConfig.__dataclass_fields__
    values = {k: v for k, v in vars(args).items() if k in fields}
    if isinstance(values.get("resume"), str):  # --resume RUN_DIR: that run's directory is --out
        values.update(out=values["resume"], resume=True)
    return TrainConfig(**values)


def cmd_train(args: argparse.Namespace) -> int:
    from jaxdp.run.train import train

    cfg = config_from_args(args)
    summary = train(cfg)
    ev = summary.get("eval") or {}
    if summary.get("process_index", 0) == 0:  # one line per job, not per process
        rate = summary.get("images_per_sec")
        speed = f" ({rate:,.0f} img/s, median step)" if rate else ""
        print(f"done: {summary['steps']} steps in {summary.get('seconds', 0):.1f}s{speed}; "
              f"eval accuracy {ev.get('accuracy', float('nan')):.4f}; run in {cfg.out}")
    return 0


def add_job_args(p: argparse.ArgumentParser) -> None:
    """jaxdp train's own flags (torch_ref.train shares add_train_args, not these)."""
    _add_sections(p, [title for title in SECTIONS if title not in SHARED])
    g = p.add_argument_group("config file")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="options from a .toml, .json or .yaml file (keys: the flags' names, e.g. "
                        "global_batch_size = 256); flags given here override it")


def cmd_launch(args: argparse.Namespace) -> int:
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    return launch(command, nprocs=args.nprocs, devices_per_proc=args.devices_per_proc,
                  coordinator=args.coordinator, num_processes=args.num_processes,
                  process_id=args.process_id, grace_period=args.grace_period,
                  coordinator_bind=args.coordinator_bind)


def add_launch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nprocs", type=int, default=None, help="processes to start on this host (default 1)")
    p.add_argument("--devices-per-proc", type=int, default=None,
                   help="devices per process: simulated CPU devices, or this many GPUs each")
    p.add_argument("--coordinator", default=None, help="HOST:PORT of process 0 (several hosts; default: SLURM's"
                   " first node, else a free port on 127.0.0.1)")
    p.add_argument("--coordinator-bind", default="auto", metavar="auto|all|ADDRESS",
                   help="where process 0's coordinator listens: auto (default): the address --coordinator's host has "
                        "on process 0's host (loopback for a one-host launch); all: every interface; or an address. "
                        "It is unauthenticated: launch across hosts on a trusted network only")
    p.add_argument("--num-processes", type=int, default=None, help="processes in the whole job (several hosts)")
    p.add_argument("--process-id", type=int, default=None, help="id of this host's first process (several hosts)")
    p.add_argument("--grace-period", type=float, default=1.0,
                   help="seconds between SIGTERM and SIGKILL when stopping the others after a failure"
                        " (JAX processes ignore SIGTERM: its preemption handler catches it)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the command each process runs")


def _user_errors():
    """Exceptions that mean 'the user asked for something impossible': one line, no traceback."""
    from jaxdp.checkpoint import CheckpointError
    from jaxdp.data import DatasetError  # not for --help: the data package adds ~30 ms to its start
    from jaxdp.models import ModelError
    from jaxdp.optim import ConfigError
    from jaxdp.strategies import StrategyError

    return (CommandError, LaunchError, CheckpointError, DatasetError, MeshError, ModelError, ChoiceError, ConfigError,
            StrategyError, TrainError, durable.FaultSpecError)


def add_train_command_args(p: argparse.ArgumentParser) -> None:
    add_train_args(p)
    add_job_args(p)


TRAIN = Command(summary="train a model with a data-parallel strategy", add_args=add_train_command_args, run=cmd_train)
LAUNCH = Command(summary="start a multi-process job: jaxdp launch --nprocs 2 -- jaxdp train ...",
                 add_args=add_launch_args, run=cmd_launch)
BUILT_IN = {"train": TRAIN, "launch": LAUNCH, "inspect": INSPECT, "plan": PLAN}  # jaxdp's own commands


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """The parser; with ``command`` one of ``BUILT_IN``, without the registered commands."""
    parser = argparse.ArgumentParser(prog="jaxdp", description=__doc__.splitlines()[0], **PARSER_OPTIONS)
    parser.add_argument("--version", action="version", version=f"jaxdp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    others = {} if command in BUILT_IN else registered(skip=BUILT_IN)  # the torch side's: parity, bench, export
    for name, each in {**BUILT_IN, **others}.items():
        p = sub.add_parser(name, help=each.summary, description=each.summary, **PARSER_OPTIONS)
        each.add_args(p)  # jax- and torch-free: the parser works without the extra
        p.set_defaults(func=functools.partial(_run_command, name, each))
    return parser


def _run_command(name: str, command: Command, args: argparse.Namespace) -> int:
    if command.missing():
        raise CommandError(command.install_hint(name))
    return command.run(args)


def with_file_options(parser: argparse.ArgumentParser, argv: Optional[List[str]], args: argparse.Namespace):
    """``jaxdp train``'s arguments again, with ``--resume RUN_DIR``'s config.json and then
    ``--config FILE`` as the defaults: what the command line says wins."""
    values = {}
    if isinstance(args.resume, str):
        values.update(config_file.run_config(args.resume))
    if args.config:
        values.update(config_file.load(args.config, drop=config_file.NOT_INHERITED if args.resume else ()))
    if isinstance(args.resume, str) and args.out not in (TrainConfig().out, args.resume):
        raise TrainError(f"--resume {args.resume} continues the run in that directory: drop --out {args.out}")
    if not values:
        return args
    train_parser = parser._subparsers._group_actions[0].choices["train"]
    train_parser.set_defaults(**values)
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    with one_line_warnings():
        return _main(argv)


@contextlib.contextmanager
def one_line_warnings():
    """While the command runs, a warning reaches its user as one line, ``jaxdp: warning: ...``,
    without the source path and code line Python adds for a program's author. Only the command
    line: a library user of jaxdp keeps Python's format (restored on the way out)."""
    before = warnings.formatwarning
    warnings.formatwarning = lambda message, *_, **__: f"jaxdp: warning: {' '.join(str(message).split())}\n"
    try:
        yield
    finally:
        warnings.formatwarning = before


def _main(argv: Optional[List[str]]) -> int:
    words = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
    parser = build_parser(words[0] if words else None)
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            durable.check_fault_spec()  # a bad JAXDP_FAULT_AT: said now, not at the first write
            args = with_file_options(parser, argv, args)
            check_config(config_from_args(args))  # e.g. --devices 0 before it reaches XLA
        _simulate_devices(args)
        return args.func(args)
    except _user_errors() as e:
        print(f"jaxdp: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"jaxdp: {interrupted_message(e)}", file=sys.stderr)
        return exit_status(e)


def _simulate_devices(args: argparse.Namespace) -> None:
    """--devices N on CPU: ask XLA for N devices, before jax starts (``jaxdp.runtime.startup``)."""
    devices = getattr(args, "devices", None)
    if isinstance(getattr(args, "mesh", None), str):  # --mesh in train, inspect, parity
        try:
            devices = devices or MeshDims.parse(args.mesh).devices
        except MeshError:
            pass  # the command's own check says what is wrong with it, in one line
    job = distributed_env() if devices and args.command == "train" else None  # --devices is the job's total
    startup.configure(devices, job.num_processes if job else 1)


if __name__ == "__main__":
    sys.exit(main())
