"""The ``jaxdp inspect`` subcommand (``INSPECT``): its options, and the run that prints the report
of ``jaxdp.analysis``.

Jax-free at import, as the whole parser: ``run`` imports ``jaxdp.analysis`` (and so jax) once the
arguments are parsed and ``--devices`` has set XLA's device count.
"""

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

def add_inspect_args(p) -> None:
    p.add_argument("--strategy", default="zero3", metavar=choices.listing(choices.STRATEGIES), help="data-parallel strategy")
    p.add_argument("--devices", type=int, default=None,
                   help=f"devices (simulated on CPU; default {DEFAULT_DEVICES}); with --target, GPUs per host")
    add_target_flags(p)
    add_mesh_flag(p, what="the strategy on the data axis, tensor parallelism on model; adds memory and traffic per "
                          "axis")
    # The strategy options train and parity take (their one declaration, StrategyOptions); None: the strategy's default.
    add_arguments(p, StrategyOptions, FLAGS, defaults=types.SimpleNamespace(**dict.fromkeys(FLAGS)),
                  compress="ddp/zero1 gradient compression (async: bf16, fp16)")
    add_model_args(p)
    p.add_argument("--batch-per-device", type=int, default=1, help="images per device per step")
    p.add_argument("--accum-steps", type=int, default=1,
                   help="micro-batches per update: the step compiled accumulating (each device's batch split)")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="model-state bytes only (no compiled memory or HLO)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--schedule", action="store_true",
                   help="also print the compiled step's collectives and convolutions/matmuls in execution order")


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
    p.add_argument("--hosts", type=int, default=None, help="with --target: hosts of --devices GPUs each (default 1)")


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
    mesh = mesh_sizes(args.mesh, args.devices) if args.mesh else None
    devices = math.prod(mesh.values()) if mesh else args.devices or DEFAULT_DEVICES
    simulate_cpu_devices(devices)  # a no-op once jax runs or XLA_FLAGS fixes the count
    return mesh, devices


def run(args) -> int:
    try:
        target = target_of(args)
        mesh, devices = _mesh_and_devices(args, target)
    except (TargetError, MeshError) as e:
        print(f"jaxdp: error: {e}", file=sys.stderr)
        return 2
    from jaxdp.analysis.measure import InspectError, inspect_strategy  # jax starts here, after the flags
    from jaxdp.analysis.report import format_report
    from jaxdp.models import ModelError
    from jaxdp.strategies import StrategyError

    options = {k: getattr(args, k) for k in STRATEGY_OPTIONS if getattr(args, k) is not None}
    if args.accum_steps != 1:
        options["accum_steps"] = args.accum_steps
    vit = {k: getattr(args, k) for k in VIT_SIZES if getattr(args, k) is not None}
    try:
        report = inspect_strategy(
            args.strategy, devices, model=args.model, width=args.width, blocks=args.blocks, stem=args.stem,
            optimizer=args.optimizer, dtype=args.dtype, batch_per_device=args.batch_per_device,
            image_size=args.image_size, mesh_shape=args.mesh_shape, options=options, compile=args.compile,
            mesh=mesh, vit=vit, schedule=args.schedule, target=target,
        )
    except (InspectError, StrategyError, MeshError, ModelError, ChoiceError, TargetError) as e:  # one line
        print(f"jaxdp: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    if args.schedule and not args.json:
        print_schedule(report)
    return 0


def print_schedule(report: dict) -> None:
    from jaxdp.analysis.schedule import Op, format_schedule

    if "schedule" not in report:
        print("\nno schedule: --no-compile")
        return
    print(f"\nschedule of the compiled step (entry computation, in execution order; {report['backend']}):")
    print(format_schedule([Op(**op) for op in report["schedule"]], report["backend"]))


INSPECT = Command(summary="per-device memory and collective traffic of a strategy vs the ZeRO formulas",
                  add_args=add_inspect_args, run=run)
