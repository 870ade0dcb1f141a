"""The ``jaxdp inspect`` subcommand (``INSPECT``): its options, and the run that prints the report
of ``jaxdp.analysis``.

Jax-free at import, as the whole parser: ``run`` imports ``jaxdp.analysis`` (and so jax) once the
arguments are parsed and ``--devices`` has set XLA's device count.
"""

import argparse
import dataclasses
import json
import math
import sys
import types

from jaxdp.cli.commands import Command
from jaxdp.config import choices
from jaxdp.config.flags import VIT_SIZES, add_arguments, add_mesh_flag, add_vit_flags, comma_ints
from jaxdp.config.step import StrategyOptions, options_where
from jaxdp.names import ChoiceError
from jaxdp.runtime.mesh import MeshError, mesh_sizes, simulate_cpu_devices
from jaxdp.runtime.target import GPUS, Target, TargetError

DEFAULT_DEVICES = 8
FLAGS = options_where(inspect=True)  # the strategy options whose fields say inspect takes them
STRATEGY_OPTIONS = tuple(n for n in FLAGS if n != "mesh_shape")  # passed on; mesh_shape is inspect's own argument

def at_least_one(text: str) -> int:
    """A count such as ``--devices``: a whole number >= 1 (argparse's one line naming the flag otherwise;
    ``--devices 0`` fell back to the default 8, ``plan --devices -4`` blamed --global-batch-size)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def add_inspect_args(p) -> None:
    p.add_argument("--strategy", default="zero3", metavar=choices.listing(choices.STRATEGIES), help="data-parallel strategy")
    p.add_argument("--devices", type=int, default=None,  # checked in run (one line; with --target, by Target)
                   help=f"devices (simulated on CPU; default {DEFAULT_DEVICES}); with --target, GPUs per host")
    add_target_flags(p)
    add_mesh_flag(p, what="the strategy on the data axis, tensor parallelism on model; adds memory and traffic per "
                          "axis")
    # The strategy options train and parity take (their one declaration, StrategyOptions); None: the strategy's default.
    add_arguments(p, StrategyOptions, FLAGS, defaults=types.SimpleNamespace(**dict.fromkeys(FLAGS)),
                  compress="ddp/zero1 gradient compression (async: bf16, fp16)")
    add_model_args(p)
    p.add_argument("--batch-per-device", type=int, default=None,
                   help="images per device per step (default 1; with --trainer, its example batch's rows per device)")
    p.add_argument("--accum-steps", type=at_least_one, default=1,
                   help="micro-batches per update: the step compiled accumulating (each device's batch split)")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="model-state bytes only (no compiled memory or HLO)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--schedule", action="store_true",
                   help="also print the compiled step's collectives and convolutions/matmuls in execution order")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="with --target: draw the estimated step (kernels, each collective's window, exposed time)")
    p.add_argument("--trainer", default=None, metavar="MODULE:FUNCTION",
                   help="with --target: inspect your own jaxdp.Trainer: FUNCTION() returns (trainer, example_batch); "
                        "the model options above are then unused")


def add_model_args(p) -> None:
    """The model, its input and its optimizer: what ``inspect`` and ``plan`` build."""
    p.add_argument("--model", default="resnet18", metavar=choices.listing(choices.MODELS), help="architecture")
    p.add_argument("--width", type=int, default=64, help="ResNet: channels of the first stage (64 = torchvision)")
    p.add_argument("--blocks", type=comma_ints, default=None, help="ResNet: blocks per stage, e.g. 1,1,1,1 (default: the model's)")
    add_vit_flags(p)
    p.add_argument("--stem", default="cifar", metavar=choices.listing(choices.STEMS), help="ResNet stem")
    p.add_argument("--optimizer", default="sgd", metavar=choices.listing(choices.OPTIMIZERS), help="sgd with momentum 0.9")
    p.add_argument("--dtype", default="float32", metavar=choices.listing(choices.DTYPES), help="params and compute")
    p.add_argument("--image-size", type=int, default=32, help="square input images of this side")


def add_target_flags(p) -> None:
    """``--target``/``--hosts``: compile for GPUs that are not there (``jaxdp.runtime.target``)."""
    p.add_argument("--target", default=None, metavar="|".join(GPUS),
                   help="compile for this GPU, without one (compile-only devices: jaxdp.runtime.target); "
                        "--devices is then GPUs per host")
    p.add_argument("--hosts", type=at_least_one, default=None,
                   help="with --target: hosts of --devices GPUs each (default 1)")


def target_of(args):
    """The ``Target`` that ``--target``/``--devices``/``--hosts`` name, or None; TargetError for a bad one."""
    if args.target is None:
        if args.hosts is not None:
            raise TargetError("--hosts needs --target (it counts hosts of compile-only GPUs)")
        return None
    return Target.parse(args.target, args.devices, args.hosts)


def _mesh_and_devices(args, target=None):
    """(named mesh sizes or None, device count): ``--mesh`` or ``--devices`` (default 8), simulated
    on CPU before jax starts; with a ``target``, its compile-only GPUs (``--mesh`` must hold them all)."""
    if target is not None:
        mesh = mesh_sizes(args.mesh, target.devices) if args.mesh else None
        return mesh, target.devices
    if args.devices is not None and args.devices < 1:  # was: 0 fell back to the default
        raise ValueError(f"--devices must be >= 1 (omit it for {DEFAULT_DEVICES}), got {args.devices}")
    mesh = mesh_sizes(args.mesh, args.devices) if args.mesh else None
    devices = math.prod(mesh.values()) if mesh else args.devices or DEFAULT_DEVICES
    simulate_cpu_devices(devices)  # a no-op once jax runs or XLA_FLAGS fixes the count
    return mesh, devices


def run(args) -> int:
    try:
        target = target_of(args)
        _check_trainer_and_plot(args, target)
        mesh, devices = _mesh_and_devices(args, target)
    except (TargetError, MeshError, ValueError) as e:
        print(f"jaxdp: error: {e}", file=sys.stderr)
        return 2
    from jaxdp.analysis.measure import InspectError, inspect_strategy  # jax starts here, after the flags
    from jaxdp.analysis.options import InspectOptions
    from jaxdp.analysis.plot import PlotError
    from jaxdp.analysis.report import format_report
    from jaxdp.models import ModelError
    from jaxdp.strategies import StrategyError

    options = {k: getattr(args, k) for k in STRATEGY_OPTIONS if getattr(args, k) is not None}
    if args.accum_steps != 1:
        options["accum_steps"] = args.accum_steps
    parsed = dict(target=target, mesh=mesh, options=options,  # the options the flags spell otherwise; the rest by name
                  vit={k: getattr(args, k) for k in VIT_SIZES if getattr(args, k) is not None})
    how = InspectOptions(**parsed, **{f.name: getattr(args, f.name) for f in dataclasses.fields(InspectOptions)
                                      if f.name not in parsed and hasattr(args, f.name)})
    try:
        report = _inspect_trainer(args.trainer, how) if args.trainer else inspect_strategy(args.strategy, devices, how)
    except (InspectError, StrategyError, MeshError, ModelError, ChoiceError, TargetError, PlotError) as e:  # one line
        print(f"jaxdp: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    if args.schedule and not args.json:
        print_schedule(report)
    if args.plot and not args.json:
        print(f"\nschedule drawn: {args.plot}")
    return 0


def _check_trainer_and_plot(args, target) -> None:
    """One line for --trainer or --plot without --target, or a --trainer that is not MODULE:FUNCTION."""
    if args.plot and target is None:
        raise ValueError("--plot draws the estimate of a GPU target's step: add --target (e.g. --target h100)")
    if args.trainer is not None:
        if target is None:
            raise ValueError("--trainer compiles your Trainer's step for a GPU target: add --target (e.g. --target h100)")
        if args.trainer.count(":") != 1 or not all(args.trainer.split(":")):
            raise ValueError(f"--trainer takes MODULE:FUNCTION (e.g. mypkg.train:make_trainer), got {args.trainer!r}")


def _inspect_trainer(spec: str, how) -> dict:
    """``FUNCTION()`` of ``MODULE:FUNCTION`` gives (trainer, example_batch): its ``inspect`` report."""
    import importlib  # the user's module, imported once jax has started

    module, _, function = spec.partition(":")
    try:
        made = getattr(importlib.import_module(module), function)()
    except (ImportError, AttributeError) as e:
        raise TargetError(f"--trainer {spec}: {e}") from None
    if not (isinstance(made, tuple) and len(made) == 2 and hasattr(made[0], "inspect")):
        raise TargetError(f"--trainer {spec}: {function}() must return (jaxdp.Trainer, example_batch), "
                          f"got {type(made).__name__}")
    from jaxdp.analysis.trainer_inspect import TRAINER_FIELDS  # with jax, as inspect_strategy

    trainer, batch = made
    return trainer.inspect(batch, how.target, **{f: getattr(how, f) for f in TRAINER_FIELDS})


def print_schedule(report: dict) -> None:
    from jaxdp.analysis.schedule import Op, format_schedule

    if "schedule" not in report:
        print("\nno schedule: --no-compile")
        return
    print(f"\nschedule of the compiled step (entry computation, in execution order; {report['backend']}):")
    print(format_schedule([Op(**op) for op in report["schedule"]], report["backend"]))


INSPECT = Command(summary="per-device memory and collective traffic of a strategy vs the ZeRO formulas",
                  add_args=add_inspect_args, run=run)
