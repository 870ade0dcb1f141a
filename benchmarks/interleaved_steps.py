"""Step times of several compiled steps taken in turn, one step each, in one process.

On a shared machine whose load drifts, `jaxdp bench`'s rows (each timed over its own
stretch of minutes) can differ by 3x between repeats; here every variant's k-th step runs
within seconds of the others', so the ratios hold under the drift. The numbers in
benchmarks/RESULTS.md ("ZeRO-3 remat and DDP bucket size") came from:

    python benchmarks/interleaved_steps.py 64 2 9 remat     # width, devices, rounds, variants
    python benchmarks/interleaved_steps.py 16 2 25 buckets

ResNet-18 at the width given, float32, SGD momentum, global batch 32, the process pinned to
N cores with XLA's Eigen pool off (as `jaxdp bench`). Prints one JSON line: each variant's
median step time and its ratio to the first variant's.
"""

import json
import os
import statistics
import sys
import time

width, n, rounds, which = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n} --xla_cpu_multi_thread_eigen=false"
os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:n]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxdp.mesh import make_mesh  # noqa: E402
from jaxdp.models import create_model, fsdp_units  # noqa: E402
from jaxdp.optim import make_optimizer  # noqa: E402
from jaxdp.strategies import create_strategy  # noqa: E402
from jaxdp.task import classifier  # noqa: E402

net = create_model("resnet18", width=width)
rng = np.random.default_rng(0)
batch = {"image": rng.normal(size=(32, 32, 32, 3)).astype(np.float32), "label": np.zeros(32, np.int32)}
units = fsdp_units(net)
VARIANTS = {
    "remat": [("ddp", {}), ("zero3", {"units": units}), ("zero3", {"units": units, "remat": "none"})],
    "buckets": [("ddp", {"bucket_cap_mb": cap}) for cap in (1.0, 5.0, 25.0, 100.0, 1e9)],  # 1e9: one bucket
}[which]

runs = []
for name, options in VARIANTS:
    s = create_strategy(name, net, classifier(net), make_optimizer("sgd", 0.1, momentum=0.9), make_mesh(n), **options)
    state, sharded = s.init(jax.random.key(0), batch), s.shard_batch(batch)
    step = s.lower_step(state, sharded).compile()
    for _ in range(2):  # warm-up
        state, out = step(state, sharded)
    jax.block_until_ready(out)
    label = " ".join([name] + [f"{k}={v}" for k, v in options.items() if k != "units"])
    runs.append({"label": label, "step": step, "state": state, "batch": sharded, "times": []})
for _ in range(rounds):
    for r in runs:
        t = time.perf_counter()
        r["state"], out = r["step"](r["state"], r["batch"])
        jax.block_until_ready(out)
        r["times"].append(time.perf_counter() - t)
first = statistics.median(runs[0]["times"])
print(json.dumps({"width": width, "n": n, "rounds": rounds, "loadavg": os.getloadavg(),
                  **{r["label"]: {"median_s": statistics.median(r["times"]),
                                  "ratio_to_first": statistics.median(r["times"]) / first} for r in runs}}))
