"""The ``jaxdp plan`` subcommand (``PLAN``): its options, the run of ``jaxdp.analysis.plan``,
and the table it prints.

    jaxdp plan --model resnet18 --devices 64 --device-memory 80GiB --global-batch-size 8192

Jax-free at import: the parser is built before ``--devices`` sets XLA's simulated device count.
"""

import argparse
import json
import os
import re

from jaxdp import registry
from jaxdp.config import choices
from jaxdp.cli.commands import Command, CommandError
from jaxdp.cli.inspect_command import add_model_args, add_target_flags, at_least_one, target_of
from jaxdp.runtime.target import Target, TargetError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def memory_size(text: str) -> float:
    """``80GiB``, ``16GB``, ``512MiB`` or plain bytes -> bytes (argparse's one-line error otherwise)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 80GiB, 16GB or 512MiB, got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


def add_plan_args(p) -> None:
    p.add_argument("--devices", type=at_least_one, default=8,
                   help="devices N in all (compiled for N simulated CPU devices, or N GPUs of --target)")
    p.add_argument("--device-memory", type=memory_size, default=None,
                   help="memory per device, e.g. 80GiB (default: the --target's, else 80GiB)")
    add_target_flags(p)
    p.add_argument("--global-batch-size", type=int, default=256, help="images per step over all devices")
    add_model_args(p)
    p.add_argument("--strategies", type=lambda text: tuple(text.split(",")), default=None,
                   help=f"a subset of {','.join(registry.names(planned=True))} (default: all)")
    p.add_argument("--staleness", type=int, default=1, help="async's staleness bound k")
    p.add_argument("--accum-steps", type=int, default=1, help="micro-batches per update (each device's batch split)")
    p.add_argument("--accum-reduce", default="each", metavar=choices.listing(choices.ACCUM_REDUCES),
                   help="zero3, hsdp: reduce-scatter each micro-batch, or once per update (the unsharded "
                        "gradients, pΨ more per device)")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip the third compile that checks the largest batch")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args) -> int:
    target = plan_target(args)
    os.environ["JAX_PLATFORMS"] = "cpu"  # simulated CPU devices, also on a GPU host; a target's GPUs are compile-only
    # jax (imported with these) reads $JAX_PLATFORMS when it is imported: after the line above
    from jaxdp.analysis.measure import InspectError
    from jaxdp.analysis.plan import PlanError, plan

    try:
        result = plan(args.model, args.devices, args.device_memory, args.global_batch_size, width=args.width,
                      blocks=args.blocks, stem=args.stem, optimizer=args.optimizer, dtype=args.dtype,
                      image_size=args.image_size, strategies=args.strategies, staleness=args.staleness,
                      verify=args.verify, target=target, accum_steps=args.accum_steps,
                      accum_reduce=args.accum_reduce)
    except (PlanError, InspectError, TargetError) as e:
        raise CommandError(str(e)) from None
    print(json.dumps(result, indent=2) if args.json else format_plan(result))
    return 0


def plan_target(args):
    """``--target`` with ``--devices`` N GPUs in all over ``--hosts`` H (N/H each), or None."""
    hosts = args.hosts or 1
    try:
        if args.target is None:
            return target_of(args)  # --hosts without --target: its one-line refusal
        if args.devices % hosts:
            raise TargetError(f"--devices {args.devices} must split evenly over --hosts {hosts}")
        return Target.parse(args.target, args.devices // hosts, hosts)
    except TargetError as e:
        raise CommandError(str(e)) from None


def _mib(x) -> str:
    return "-" if x is None else f"{x / 2**20:,.1f}"


def format_plan(r: dict) -> str:
    size = f" width {r['width']} blocks {','.join(map(str, r['blocks']))}" if r["blocks"] else ""
    lines = [f"{r['model']}{size} ({r['psi']:,} params), {r['dtype']}, {r['optimizer']}, on {r['devices']} devices "
             f"of {_mib(r['device_memory'])} MiB; global batch {r['global_batch_size']} "
             f"= {r['batch_per_device']} per device",
             "",
             f"{'strategy':<12}{'state MiB':>11}{'temp MiB':>11}{'step MiB':>11}{'fits':>6}"
             f"{'max batch/dev':>15}{'MiB/image':>11}{'traffic MiB/step':>18}"]
    for i, row in enumerate(r["rows"]):
        name = row["strategy"] + (f" {row['mesh_shape'][0]}x{row['mesh_shape'][1]}" if row["mesh_shape"] else "")
        best = " <- recommended" if i == r["recommended"] else ""
        checked = "" if row["verified"] else "?"
        lines.append(f"{name:<12}{_mib(row['state_bytes']):>11}{_mib(row['memory']['temp_bytes']):>11}"
                     f"{_mib(row['memory']['total_bytes']):>11}{'yes' if row['fits'] else 'no':>6}"
                     f"{row['max_batch_per_device']:>14}{checked:1}{_mib(row['bytes_per_image']):>11}"
                     f"{_mib(row['traffic_bytes']):>18}{best}")
    lines += ["",
              f"compiled for {r['compiled_for']}",
              "state: params + optimizer state + extra per device (ZeRO formulas, padded); temp and step: the "
              "compiled step at the asked batch (step = argument + output - alias + temp); "
              "max batch: the line through compiles at b and 2b, checked by a third (? = not confirmed)",
              f"recommended: {r['rule']}" + ("" if r["recommended"] is not None else ": none fits")]
    return "\n".join(lines)


PLAN = Command(summary="which strategy fits a model on N devices: memory per device, largest batch, traffic",
               add_args=add_plan_args, run=run)

