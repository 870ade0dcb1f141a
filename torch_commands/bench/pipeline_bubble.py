"""The GPipe bubble, measured: step time at several micro-batch counts M for S pipeline stages.

Run:      python -m torch_commands.bench.pipeline_bubble [--stages 2 4] [--microbatches 1 2 4 8]
Takes:    about 2 minutes on 2 CPU cores (compiling each M).

A ViT (dim 64, depth 6: ``MODEL``) on a stage=S mesh, global batch fixed, so each
micro-batch shrinks as M grows. Estimator: the ideal pipelined step is the one-device step
split S ways, t_ideal = t_1 / S (no bubble, no communication); the measured bubble fraction is
1 - t_ideal / t(M), printed beside GPipe's (S-1)/(M+S-1). On simulated CPU devices the S
stages share the same cores, so the stages do not truly overlap: expect the measured fraction
far above the formula there; on S real accelerators the two should meet as M grows.
Writes benchmarks/results/pipeline_bubble.json.
"""

import argparse
import json
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jaxdp.runtime.mesh import make_mesh  # noqa: E402
from jaxdp.models.vit import ViT  # noqa: E402
from jaxdp.strategies import create_strategy  # noqa: E402
from jaxdp.loss.task import classifier  # noqa: E402
from torch_commands.bench.layouts import measured_bubble  # noqa: E402

MODEL = dict(num_classes=10, image_size=32, patch=4, dim=64, depth=6, heads=4, mlp_dim=128)


def median_step_seconds(mesh, batch, repeats: int, **options) -> float:
    model = ViT(**MODEL)
    strategy = create_strategy("ddp", model, classifier(model), optax.sgd(0.01), mesh, **options)
    state = strategy.engine.init(jax.random.key(0), batch)
    placed = strategy.engine.shard_batch(batch)
    state, metrics = strategy.engine.step(state, placed)  # compile
    jax.block_until_ready(metrics)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state, metrics = strategy.engine.step(state, placed)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    p.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/pipeline_bubble.json")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    batch = {"image": rng.normal(size=(args.batch, 32, 32, 3)).astype(np.float32),
             "label": rng.integers(0, 10, args.batch).astype(np.int32)}
    one = median_step_seconds(make_mesh(data=1), batch, args.repeats)
    rows = []
    print(f"one device: {one * 1e3:.1f} ms per step (global batch {args.batch})")
    print(f"{'S':>2} {'M':>3} {'step ms':>8} {'ideal ms':>8} {'measured bubble':>16} {'(S-1)/(M+S-1)':>14}")
    for s in args.stages:
        if s > len(jax.devices()):
            continue
        for m in args.microbatches:
            t = median_step_seconds(make_mesh(data=1, stage=s), batch, args.repeats, microbatches=m)
            row = dict(stages=s, microbatches=m, step_s=t, ideal_s=one / s, measured_bubble=measured_bubble(one / s, t),
                       gpipe_bubble=(s - 1) / (m + s - 1))
            rows.append(row)
            print(f"{s:>2} {m:>3} {t * 1e3:8.1f} {one / s * 1e3:8.1f} {row['measured_bubble']:16.2f} "
                  f"{row['gpipe_bubble']:14.2f}")
            save(args.out, one, args.batch, rows)  # after each row: a stopped run keeps what it measured
    print(f"wrote {args.out}")


def save(path, one, batch, rows):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "model": MODEL, "batch": batch,
                   "one_device_s": one, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
