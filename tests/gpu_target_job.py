"""Compile jaxdp's step for compile-only GPUs and write each ``inspect`` report as JSON (test_gpu_target.py).

    python tests/gpu_target_job.py OUT_DIR TARGET DEVICES_PER_HOST HOSTS WIDTH BLOCKS NAME=STRATEGY[:OPT=V,...] ...

Runs as a user's own process would (the test gives it the user's XLA flags, not the suite's), with
``jax.devices()`` made to fail: a target's mesh must be built from the target's devices alone.
"""

import json
import sys
import time


def forbid_local_devices():
    import jax

    def devices(*args, **kwargs):
        raise AssertionError("jax.devices() was read while compiling for a GPU target")
    jax.devices = devices


def main(out, target, per_host, hosts, width, blocks, *jobs):
    forbid_local_devices()
    from jaxdp.analysis.measure import inspect_strategy
    from jaxdp.runtime.target import Target

    target = Target.parse(target, int(per_host), int(hosts))
    for job in jobs:
        name, _, spec = job.partition("=")
        strategy, _, opts = spec.partition(":")
        options = dict(kv.split("=") for kv in opts.split(",") if kv)
        mesh_shape = tuple(int(x) for x in options.pop("mesh_shape").split("x")) if "mesh_shape" in options else None
        options = {k: float(v) if k == "bucket_cap_mb" else v for k, v in options.items()}
        start = time.perf_counter()
        report = inspect_strategy(strategy, target.devices, model="resnet18", width=int(width),
                                  blocks=[int(b) for b in blocks.split(",")] if blocks != "-" else None,
                                  dtype="bfloat16", batch_per_device=64, mesh_shape=mesh_shape, options=options,
                                  schedule=True, target=target)
        report["compile_s"] = time.perf_counter() - start
        with open(f"{out}/{name}.json", "w") as f:
            json.dump(report, f)
        print(f"{name}: {report['compile_s']:.1f} s", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
