"""The ``jaxdp inspect`` subcommand: its options, and the run that prints the report.

Jax-free at import: the parser is built before ``--devices`` sets XLA's device count.
"""

import json
import sys

from jaxdp.analysis.measure import InspectError, inspect_strategy
from jaxdp.analysis.report import format_report
from jaxdp.flags import add_remat_flag, comma_ints

def add_inspect_args(p) -> None:
    from jaxdp import choices

    p.add_argument("--strategy", default="zero3", metavar=choices.listing(choices.STRATEGIES), help="data-parallel strategy")
    p.add_argument("--devices", type=int, default=8, help="devices (simulated on CPU)")
    p.add_argument("--mesh-shape", type=comma_ints, default=None, help="hsdp: replicas,shards")
    p.add_argument("--allreduce", default=None, metavar=choices.listing(choices.ALLREDUCES), help="ddp/async/zero1")
    p.add_argument("--compress", default=None, metavar=choices.listing(choices.COMPRESSIONS), help="ddp/zero1 (async: bf16, fp16)")
    p.add_argument("--powersgd-rank", type=int, default=None, help="ddp/zero1 --compress powersgd: matrix rank r")
    p.add_argument("--staleness", type=int, default=None, help="async: staleness bound k")
    add_remat_flag(p, default=None)
    p.add_argument("--model", default="resnet18", metavar=choices.listing(choices.MODELS), help="architecture")
    p.add_argument("--width", type=int, default=64, help="ResNet: channels of the first stage (64 = torchvision)")
    p.add_argument("--blocks", type=comma_ints, default=None, help="ResNet: blocks per stage, e.g. 1,1,1,1 (default: the model's)")
    p.add_argument("--stem", default="cifar", metavar=choices.listing(choices.STEMS), help="ResNet stem")
    p.add_argument("--optimizer", default="sgd", metavar=choices.listing(choices.OPTIMIZERS), help="sgd with momentum 0.9")
    p.add_argument("--dtype", default="float32", metavar=choices.listing(choices.DTYPES), help="params and compute")
    p.add_argument("--batch-per-device", type=int, default=1, help="images per device per step")
    p.add_argument("--image-size", type=int, default=32, help="square input images of this side")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="model-state bytes only (no compiled memory or HLO)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--schedule", action="store_true",
                   help="also print the compiled step's collectives and convolutions/matmuls in execution order")


def run(args) -> int:
    from jaxdp.strategies import StrategyError

    options = {k: getattr(args, k) for k in ("allreduce", "compress", "powersgd_rank", "staleness", "remat")
               if getattr(args, k) is not None}
    try:
        report = inspect_strategy(
            args.strategy, args.devices, model=args.model, width=args.width, blocks=args.blocks, stem=args.stem,
            optimizer=args.optimizer, dtype=args.dtype, batch_per_device=args.batch_per_device,
            image_size=args.image_size, mesh_shape=args.mesh_shape, options=options, compile=args.compile,
            schedule=args.schedule,
        )
    except (InspectError, StrategyError) as e:  # e.g. --compress on zero2/3: one line, exit 2
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
