"""Two compiled steps timed in alternating rounds in one process: what RESULTS.md's speed ratios come from.

    python -m parity_tests.bench.interleaved options resnet18 --width 64 --strategy ddp --devices 1 --batch 16,32
    python -m parity_tests.bench.interleaved bare resnet18 --width 16 --batch 32 --rounds 5

``options``: the strategy's step with XLA's own compile options against jaxdp's CPU default
(``jaxdp.compile_options.YNN_DOTS_AND_REDUCES``). ``bare``: the plain jitted step
(``bare.bare_jax_step``) against jaxdp's ddp at N = 1. Each round runs ``--steps`` steps of
one, then of the other; the medians and the ratio per round (the spread) are printed. On a
shared machine, separate runs drift with the load; alternating rounds see the same load.
Pinned to N cores (``jax_side.cores_for``), no Eigen intra-op pool, as the bench.
"""

import argparse
import os
import statistics
import sys
import time

from jaxdp.flags import comma_ints


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m parity_tests.bench.interleaved", description=__doc__.splitlines()[0])
    p.add_argument("compare", choices=("options", "bare"))
    p.add_argument("model", help="resnet18, vit-tiny, ...")
    p.add_argument("--width", type=int, default=64, help="ResNet width")
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--batch", type=comma_ints, default=(16,), help="per-device batches, e.g. 16,32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    args = p.parse_args(argv)
    from parity_tests.bench.jax_side import prepare_jax

    os.environ["JAXDP_COMPILER_OPTIONS"] = "none"  # each variant names its options
    prepare_jax(args.devices)
    for b in args.batch:
        print(compare(args, b), flush=True)
    return 0


def compare(args, b: int) -> str:
    import jax
    import numpy as np

    from parity_tests.bench.jax_side import cores_for

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
    (first, a), (second, c) = times.items()
    k = args.steps
    rounds = [statistics.median(c[i:i + k]) / statistics.median(a[i:i + k]) for i in range(0, len(a), k)]
    return (f"{args.model} width {args.width} {args.strategy} N={args.devices} batch {b}: {first} "
            f"{statistics.median(a):.4f} s, {second} {statistics.median(c):.4f} s, ratio "
            f"{statistics.median(c) / statistics.median(a):.3f} (per round {', '.join(f'{r:.3f}' for r in rounds)}); "
            f"load {', '.join(f'{x:.1f}' for x in os.getloadavg())}")


def _variants(args, host) -> dict:
    """name -> a function running one step (state carried inside), each compiled and run once."""
    import jax

    from jaxdp.analysis.measure import build_strategy
    from jaxdp.compile_options import YNN_DOTS_AND_REDUCES
    from jaxdp.mesh import make_mesh
    from jaxdp.models import create_model
    from parity_tests.bench.bare import bare_jax_step

    net = create_model(args.model, width=args.width)
    if args.compare == "options":
        plans = {"default": "none", "ynn_dots_reduces": YNN_DOTS_AND_REDUCES}
    else:
        plans = {"bare": None, "jaxdp": "none"}
    variants = {}
    for name, options in plans.items():
        if name == "bare":
            cfg = dict(model=args.model, width=args.width, blocks=None, dtype="float32", optimizer="sgd")
            run, state, batch = bare_jax_step(cfg, host["image"], host["label"])
            variants[name] = _carried(lambda s, run=run, batch=batch: run(*s, *batch)[:3], state)
        else:
            strategy = build_strategy(args.strategy, make_mesh(args.devices), net, "sgd",
                                      {"compiler_options": options})
            state, batch = strategy.init(jax.random.key(0), host), strategy.shard_batch(host)
            run = strategy.lower_step(state, batch).compile()
            variants[name] = _carried(lambda s, run=run, batch=batch: run(s, batch)[0], state)
        variants[name]()  # warm-up
    return variants


def _carried(step, state):
    """A no-argument step that carries its (donated) state from call to call."""
    box = [state]

    def run():
        box[0] = step(box[0])
        return box[0]
    return run


if __name__ == "__main__":
    sys.exit(main())
