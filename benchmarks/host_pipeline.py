"""Host input pipeline throughput: images per CPU-second per core, and with worker processes.

    PYTHONPATH=. python benchmarks/host_pipeline.py [--images 20000] [--batch 512] [--workers 1,2]
        [--out benchmarks/results/host_pipeline.json]                # ~1 min on 2 cores

Per core is counted in CPU time (``time.process_time``), so a busy machine slows the run
but hardly the number. Rows:

- ``device draws``: what the host does per step when the set is on the devices
  (``epoch_indices`` + ``step_draws``: ids and crop/flip draws, 16 bytes a sample).
- ``crop + flip (uint8)``: ``augment``, what a ``--data-workers`` process does per step.
- ``crop + flip + normalise``: ``epoch_batches``, the reference pipeline's whole batch.
- ``... before``: the same with the per-pixel fancy-index gather ``augment`` used before.
- ``N workers``: ``CropWorkers`` end to end, wall clock (the consumer takes each step as
  it comes), with the machine's load average beside it, and the consuming process's own
  CPU time per image (receiving the crops: the bound for one consumer, whatever N).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from jaxdp.data import augment, epoch_indices, make_synthetic, normalize
from jaxdp.data.augment import PAD, augment_params
from jaxdp.data.workers import CropWorkers
from jaxdp.run.device_data import step_draws


def fancy_index_augment(images, ids, seed, epoch):
    """``augment`` as it was: one fancy-index gather of every pixel (kept here to compare)."""
    h, w, c = images.shape[-3:]
    dy, dx, flip = augment_params(ids.reshape(-1), seed, epoch)
    flat = images.reshape(-1, h, w, c)
    padded = np.pad(flat, ((0, 0), (PAD, PAD), (PAD, PAD), (0, 0)))
    rows = dy[:, None] + np.arange(h)
    cols = dx[:, None] + np.where(flip[:, None], np.arange(w)[::-1], np.arange(w))
    return padded[np.arange(flat.shape[0])[:, None, None], rows[:, :, None], cols[:, None, :]].reshape(images.shape)


def per_core(work, steps, batch: int, reps: int = 3) -> float:
    """Images per CPU-second of ``work(ids)`` over every step (the best of ``reps`` passes)."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.process_time()
        for ids in steps:
            work(ids)
        best = min(best, time.process_time() - t0)
    return len(steps) * batch / best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=20000)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--workers", default="1,2")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    train, _ = make_synthetic(args.images, 10)
    steps = list(epoch_indices(len(train), num_replicas=1, batch_per_replica=args.batch, epoch=0, seed=0))
    rows = {
        "device draws (ids + crop/flip draws)": per_core(lambda ids: step_draws(ids, 0, 0, True), steps, args.batch),
        "crop + flip (uint8, a worker's step)": per_core(lambda ids: augment(train.images[ids], ids, 0, 0),
                                                         steps, args.batch),
        "crop + flip + normalise (epoch_batches)": per_core(
            lambda ids: normalize(augment(train.images[ids], ids, 0, 0)), steps, args.batch),
        "crop + flip + normalise, before (fancy-index gather)": per_core(
            lambda ids: normalize(fancy_index_augment(train.images[ids], ids, 0, 0)), steps, args.batch),
    }
    print(f"{len(steps)} steps of {args.batch} images, {os.cpu_count()} cores")
    for name, rate in rows.items():
        print(f"  per core  {name:55s} {rate:12,.0f} img/s")
    result = {"per_core_img_s": rows, "workers": {}, "batch": args.batch, "cores": os.cpu_count()}
    for n in (int(x) for x in args.workers.split(",")):
        with CropWorkers(train, n) as pool:
            list(pool.crops(steps[:2 * n], seed=0, epoch=0))  # the workers started and imported numpy
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in pool.crops(steps, seed=0, epoch=1):
                pass
            rate = len(steps) * args.batch / (time.perf_counter() - t0)
            consumer = len(steps) * args.batch / (time.process_time() - c0)  # receiving the crops
        load = os.getloadavg()[0]
        result["workers"][n] = {"img_s": rate, "consumer_img_s_per_core": consumer, "load_average": load}
        print(f"  {n} worker process(es), wall clock {'':27s} {rate:12,.0f} img/s (load average {load:.1f}); "
              f"the consumer's CPU: {consumer:,.0f} img/s per core")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
