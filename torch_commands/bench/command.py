"""``jaxdp bench``: its options and the run that writes bench.json, bench.md and the PNG.
Registered with ``jaxdp`` as the entry point ``BENCH`` (``jaxdp.commands``): it needs the
[torch] extra (torch_ref and matplotlib).

Jax- and torch-free at import: the device count and XLA flags are set before jax starts.
"""

from __future__ import annotations

import json
import math
import os
import sys

from jaxdp.cli.commands import Command
from jaxdp.config import choices
from jaxdp.config.flags import VIT_SIZES, add_vit_flags, comma_ints, deprecated_alias
from jaxdp.config.tree import TrainError  # not jaxdp.models: jax must not start before prepare_jax
from jaxdp.runtime.mesh import mesh_sizes
from torch_commands.bench import cuda_host
from torch_commands.bench.bare import bare_markdown
from torch_commands.bench.gpu_preset import quick_markdown, run_preset
from torch_commands.bench.jax_side import prepare_jax
from torch_commands.bench.layouts import layout_markdown, run_layouts
from torch_commands.bench.levers import LEVERS, levers
from torch_commands.bench.report import HEADER, exit_status, markdown, plots, problems_markdown
from torch_commands.bench.runner import BenchError, environment, run_bench
from torch_commands.bench.variants import add_variant_args, axes_from

QUICK = dict(width=8, blocks=(1, 1, 1, 1), global_batch=16, steps=10, warmup=2, n=(1, 2))


def add_bench_args(p) -> None:
    p.add_argument("--strategies", default=None, help="comma list (default: every registered strategy)")
    p.add_argument("--devices", dest="n", type=comma_ints, default=None,
                   help="device counts, e.g. 1,2,4,8 (default 1,2,4,8)")
    deprecated_alias(p, "--n", "--devices", dest="n", type=comma_ints)
    p.add_argument("--model", default="resnet18", metavar=choices.listing(choices.MODELS), help="architecture")
    add_vit_flags(p)
    p.add_argument("--width", type=int, default=None, help="ResNet: channels of the first stage (default 16)")
    p.add_argument("--blocks", type=comma_ints, default=None, help="ResNet: blocks per stage, e.g. 1,1,1,1")
    p.add_argument("--global-batch-size", dest="global_batch", type=int, default=None,
                   help="images per step over all devices (default 32)")
    deprecated_alias(p, "--global-batch", "--global-batch-size", dest="global_batch", type=int)
    p.add_argument("--dtype", default=None, metavar=choices.listing(choices.DTYPES), help="float32 (CPU default) | bfloat16 (GPU default)")
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"), help="sgd (momentum 0.9) | adam")
    p.add_argument("--steps", type=int, default=None, help="timed steps per row (default 10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps after compiling (default 2)")
    p.add_argument("--mesh", dest="meshes", nargs="+", default=None, metavar="AXIS=SIZE,...",
                   help="layouts instead of --devices, e.g. --mesh data=4 data=2,model=2: one jaxdp row per "
                        "strategy and mesh, with traffic per mesh axis (torch_commands.bench.layouts)")
    p.add_argument("--no-torch", dest="torch", action="store_false", help="jaxdp only")
    p.add_argument("--torch-compile", dest="torch_compile", default=None, metavar="BACKEND",
                   help="also time torch_ref's step under torch.compile with this backend (inductor; aot_eager "
                        "or eager to test the path); the jax/best torch ratio takes the faster of eager and "
                        "compiled (default: eager only; --preset gpu: inductor)")
    p.add_argument("--levers", type=levers, default=None,
                   help=f"jaxdp rows per XLA/step lever, e.g. default,autotune-0 ({', '.join(LEVERS)}; "
                        "torch_commands/bench/levers.py); torch_ref is timed on the first lever's rows")
    p.add_argument("--no-bare", dest="bare", action="store_false",
                   help="skip the bare rows (plain jitted / eager torch step at each N's per-device batch)")
    add_variant_args(p)
    p.add_argument("--pipeline-images", type=int, default=4096, help="images in the input-pipeline measurement")
    p.add_argument("--quick", action="store_true",
                   help=f"tiny settings: width {QUICK['width']}, blocks 1,1,1,1, batch {QUICK['global_batch']}, "
                        f"N {','.join(map(str, QUICK['n']))}, {QUICK['steps']} steps; with --preset gpu: the <= 5 "
                        "minute GPU bench (make gpu-bench): one GPU, batch 512, ddp, jaxdp train end to end, torch "
                        "eager and compiled, MFU, host pipeline")
    p.add_argument("--out", default="benchmarks/results", help="folder for bench.json, bench.md and the PNGs")
    p.add_argument("--tag", default="bench", help="file name stem of the outputs")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per torch launch")
    p.add_argument("--preset", default=None, metavar="{gpu}",
                   help="gpu: ResNet-18 bf16 at 256 and 512 per device, every strategy, N = 1 and every GPU, torch "
                        "eager and torch.compile (torch_commands/bench/gpu_preset.py)")
    p.add_argument("--dry-run", action="store_true", help="with --preset: print the rows it would run, run none")
    p.add_argument("--mock-gpus", type=int, default=None, metavar="N",
                   help="with --preset gpu --quick: also compile and run each strategy's N-GPU step on this one GPU "
                        "(JAX's mock topology; jaxdp.analysis.mock_topology): overlap, memory vs formula, step time")
    p.add_argument("--deadline", type=float, default=None,
                   help="with --preset gpu --quick: seconds the whole bench may take; what it leaves no time to start "
                        "is NOT RUN (exit 3) (default 300; 0: none)")


def _resolve(args) -> dict:
    gpu = cuda_host()
    q = QUICK if args.quick else {}
    resnet = not args.model.startswith("vit")  # a ViT keeps its named size: width/blocks are ResNet's
    if not resnet and (args.width or args.blocks):
        raise TrainError(f"--width/--blocks size a ResNet, not {args.model}")
    return {
        "model": args.model,
        "width": args.width or q.get("width", 16) if resnet else 64,  # 64: create_model's default, ignored by a ViT
        "blocks": args.blocks or q.get("blocks") if resnet else None,
        "global_batch": args.global_batch or q.get("global_batch", 32),
        "dtype": args.dtype or ("bfloat16" if gpu else "float32"),
        "optimizer": args.optimizer,
        "steps": args.steps or q.get("steps", 10),
        "warmup": args.warmup if args.warmup is not None else q.get("warmup", 2),
        "n": args.n or q.get("n", (1, 2, 4, 8)),
        "vit": {k: getattr(args, k) for k in VIT_SIZES if getattr(args, k) is not None},
        "bare": args.bare,
        "variants": axes_from(args),
        "torch_compile": args.torch_compile,
        "levers": args.levers,
    }


def run(args) -> int:
    cfg = _resolve(args)
    if args.meshes:
        return run_meshes(args, cfg)
    strategies = [s for s in (args.strategies.split(",") if args.strategies else choices.STRATEGIES) if s]
    unknown = [s for s in strategies if s not in choices.STRATEGIES]
    if unknown:
        from jaxdp.strategies import StrategyError

        raise StrategyError(f"unknown strategy {', '.join(unknown)}; registered: {', '.join(choices.STRATEGIES)}")
    if args.preset is not None or args.dry_run:
        if args.preset != "gpu":
            raise BenchError(f"--preset {args.preset!r}: the one preset is gpu" if args.preset else
                             "--dry-run goes with --preset gpu")
        return run_preset(args, strategies, lambda result: write(result, args))
    prepare_jax(max(cfg["n"]))
    print(HEADER)
    result = run_bench(cfg, strategies, with_torch=args.torch, timeout_s=args.timeout,
                       pipeline_images=args.pipeline_images)
    write(result, args)
    return exit_status(result)


def write(result: dict, args) -> None:
    """bench.json, bench.md and the PNG under ``--out``; the Markdown printed too."""
    os.makedirs(args.out, exist_ok=True)
    md = markdown(result) + bare_markdown(result) + quick_markdown(result) + problems_markdown(result)
    with open(os.path.join(args.out, f"{args.tag}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(args.out, f"{args.tag}.md"), "w") as f:
        f.write(md + "\n")
    paths = plots(result, args.out, args.tag) if _have_matplotlib() else []
    print()
    print(md)
    print(f"\nwrote {os.path.join(args.out, args.tag)}.json, .md{''.join(', ' + p for p in paths)}")


def _have_matplotlib() -> bool:
    """A stock GPU image may lack matplotlib: the JSON and Markdown are the results, the PNG a view."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("jaxdp bench: no plot: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return False
    return True


def run_meshes(args, cfg) -> int:
    """``--mesh``: the layout rows (``layouts``), written as ``--tag``.json and .md."""
    meshes = [mesh_sizes(text) for text in args.meshes]
    prepare_jax(max(math.prod(m.values()) for m in meshes))
    strategies = [s for s in (args.strategies or "ddp").split(",") if s]
    rows = run_layouts(cfg, strategies, meshes)
    result = {"config": cfg, "strategies": strategies, "meshes": meshes, "environment": environment(), "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.tag}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(args.out, f"{args.tag}.md"), "w") as f:
        f.write(layout_markdown(result) + "\n")
    print(f"wrote {os.path.join(args.out, args.tag)}.json, .md")
    return 1 if any("error" in r["jaxdp"] for r in rows) else 0


BENCH = Command("jaxdp vs torch_ref: step time, images/s, memory and traffic per strategy and N", add_bench_args, run,
                requires=("torch",))
