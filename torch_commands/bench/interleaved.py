"""Compiled steps timed in alternating rounds in one process: what RESULTS.md's speed ratios come from.

    python -m torch_commands.bench.interleaved options resnet18 --width 64 --strategy ddp --devices 1 --batch 16,32
    python -m torch_commands.bench.interleaved bare resnet18 --width 16 --batch 32 --rounds 5
    python -m torch_commands.bench.interleaved remat resnet18 --width 64 --devices 2 --rounds 9 --steps 1
    python -m torch_commands.bench.interleaved buckets resnet18 --width 16 --devices 2 --rounds 25 --steps 1

``options``: the strategy's step with XLA's own compile options against jaxdp's CPU default
(``jaxdp.runtime.compile_options.YNN_DOTS_AND_REDUCES``). ``bare``: the plain jitted step
(``bare.bare_jax_step``) against jaxdp's ddp at N = 1. ``remat``: ddp, zero3 ``remat="unit"``
and zero3 ``remat="none"``. ``buckets``: ddp at bucket caps of 1, 5, 25 and 100 MiB and one
bucket. Each round runs ``--steps`` steps of each variant in turn; the medians, each one's
ratio to the first variant and the first ratio per round (the spread) are printed. On a
shared machine, separate runs drift with the load; alternating rounds see the same load.
Pinned to N cores (``jax_side.cores_for``), no Eigen intra-op pool, as the bench.
"""

import argparse
import os
import statistics
import sys
import time

from jaxdp.config.flags import comma_ints


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m torch_commands.bench.interleaved", description=__doc__.splitlines()[0])
    p.add_argument("compare", choices=("options", "bare", "remat", "buckets"))
    p.add_argument("model", help="resnet18, vit-tiny, ...")
    p.add_argument("--width", type=int, default=64, help="ResNet width")
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--batch", type=comma_ints, default=(16,), help="per-device batches, e.g. 16,32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    args = p.parse_args(argv)
    from torch_commands.bench.jax_side import prepare_jax

    os.environ["JAXDP_COMPILER_OPTIONS"] = "none"  # each variant names its options
    prepare_jax(args.devices)
    for b in args.batch:
        print(compare(args, b), flush=True)
    return 0


def compare(args, b: int) -> str:
    import jax
    import numpy as np

    from torch_commands.bench.jax_side import cores_for

    rng = np.random.default_rng(0)
    host = {"image": rng.normal(size=(b * args.devices, 32, 32, 3)).astype(np.float32),
            "label": rng.integers(0, 10, b * args.devices).astype(np.int32)}
    with cores_for(args.devices):
        variants = _variants(args, host)
        times = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, step in variants.items():
                for _ in range(args.steps):
                    t = time.perf_counter()
                    jax.block_until_ready(step())
                    times[name].append(time.perf_counter() - t)
    (first, a), *others = times.items()
    k, base = args.steps, statistics.median(a)
    spread = [statistics.median(others[0][1][i:i + k]) / statistics.median(a[i:i + k]) for i in range(0, len(a), k)]
    ratios = ", ".join(f"{name} {statistics.median(t):.4f} s ({statistics.median(t) / base:.3f}x)" for name, t in others)
    return (f"{args.model} width {args.width} {args.strategy} N={args.devices} batch {b}: {first} {base:.4f} s, "
            f"{ratios} (first ratio per round {', '.join(f'{r:.3f}' for r in spread)}); "
            f"load {', '.join(f'{x:.1f}' for x in os.getloadavg())}")


def _variants(args, host) -> dict:
    """name -> a function running one step (state carried inside), each compiled and run once."""
    import jax

    from jaxdp.analysis.measure import build_strategy
    from jaxdp.runtime.mesh import make_mesh
    from jaxdp.models import create_model
    from torch_commands.bench.bare import bare_jax_step

    net = create_model(args.model, width=args.width)
    plans = _plans(args.compare, args.strategy)
    variants = {}
    for name, (strategy_name, options) in plans.items():
        if name == "bare":
            cfg = dict(model=args.model, width=args.width, blocks=None, dtype="float32", optimizer="sgd")
            run, state, batch = bare_jax_step(cfg, host["image"], host["label"])
            variants[name] = _carried(lambda s, run=run, batch=batch: run(*s, *batch)[:3], state)
        else:
            strategy = build_strategy(strategy_name, make_mesh(args.devices), net, "sgd",
                                      {"compiler_options": "none", **options})
            state, batch = strategy.engine.init(jax.random.key(0), host), strategy.engine.shard_batch(host)
            run = strategy.engine.lower_step(state, batch).compile()
            variants[name] = _carried(lambda s, run=run, batch=batch: run(s, batch)[0], state)
        variants[name]()  # warm-up
    return variants


def _plans(compare: str, strategy: str) -> dict:
    """variant name -> (strategy, its options); the first variant is the one the others are divided by."""
    from jaxdp.runtime.compile_options import YNN_DOTS_AND_REDUCES

    if compare == "options":
        return {"default": (strategy, {}), "ynn_dots_reduces": (strategy, {"compiler_options": YNN_DOTS_AND_REDUCES})}
    if compare == "bare":
        return {"bare": (None, {}), "jaxdp": ("ddp", {})}
    if compare == "remat":
        return {"ddp": ("ddp", {}), "zero3 remat=unit": ("zero3", {"remat": "unit"}),
                "zero3 remat=none": ("zero3", {"remat": "none"})}
    caps = {"1": 1.0, "5": 5.0, "25": 25.0, "100": 100.0, "one bucket": float("inf")}
    return {f"ddp bucket {name}": ("ddp", {"bucket_cap_mb": cap}) for name, cap in caps.items()}


def _carried(step, state):
    """A no-argument step that carries its (donated) state from call to call."""
    box = [state]

    def run():
        box[0] = step(box[0])
        return box[0]
    return run


if __name__ == "__main__":
    sys.exit(main())
