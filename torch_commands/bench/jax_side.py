"""The bench's jaxdp side: one strategy's step compiled once and timed, on N cores of a CPU host."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Optional

import numpy as np

from jaxdp import names, registry
from jaxdp.runtime.mesh import make_mesh, simulate_cpu_devices
from torch_commands.bench import cuda_host, levers

XLA_THREAD_FLAGS = "--xla_cpu_multi_thread_eigen=false"


def prepare_jax(max_devices: int) -> None:
    """Simulated CPU devices and single-threaded XLA CPU ops; only effective before jax starts."""
    if "jax" not in sys.modules:
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_cpu_multi_thread_eigen" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} {XLA_THREAD_FLAGS}".strip()
        simulate_cpu_devices(max_devices)


@contextlib.contextmanager
def cores_for(n: int):
    """On a CPU host, run every thread of this process on ``n`` of its cores while inside.

    torch_ref's N ranks get one intra-op thread each; XLA's CPU runtime would otherwise
    spread one simulated device's convolutions over every core (measured: ResNet-18, one
    device, batch 16: 0.49 s/step on 2 cores, 0.73 s on 1). So N devices get N cores,
    as N torch ranks do. Threads started inside inherit the mask.
    """
    cores = sorted(os.sched_getaffinity(0))
    if cuda_host() or n >= len(cores):
        yield
        return
    threads = [int(t) for t in os.listdir("/proc/self/task")]
    _set_affinity(threads, set(cores[:n]))
    try:
        yield
    finally:
        _set_affinity([int(t) for t in os.listdir("/proc/self/task")], set(cores))


def _set_affinity(threads, cores) -> None:
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:  # a thread that ended meanwhile
            pass


def bench_jax(name: str, n: int, cfg: dict, images: np.ndarray, labels: np.ndarray, options=None,
              mesh=None, lever: Optional[str] = None) -> dict:
    """One row's jaxdp record on N devices, or on the named ``mesh`` ({"data": 2, "model": 2}: N = its
    product); ``options``: the strategy's own, for this row (``variants.py``); ``lever``: the
    row's ``levers.LEVERS`` entry (None: default)."""
    import jax

    with cores_for(n), jax.enable_x64(cfg["dtype"] == "float64"):  # 64-bit types for this row only
        rec = _bench_jax(name, n, cfg, images, labels, options or {}, mesh, lever)
    rec["cores"] = n if not cuda_host() else None
    return rec


def _bench_jax(name: str, n: int, cfg: dict, images: np.ndarray, labels: np.ndarray, options: dict,
               mesh=None, lever=None) -> dict:
    import jax

    from jaxdp import analysis as ins
    from jaxdp.analysis.plan import with_total
    from jaxdp.models import create_model
    from jaxdp.optim import make_optimizer
    from jaxdp.strategies import create_strategy
    from jaxdp.loss.task import classifier

    net = create_model(cfg["model"], width=cfg["width"], blocks=cfg["blocks"], dtype=cfg["dtype"], **cfg.get("vit", {}))
    tx = make_optimizer(cfg["optimizer"], names.optimizer(cfg["optimizer"]).default_lr)
    shape = registry.mesh_shape(name, n)
    options = dict(options, **({"mesh_shape": shape} if shape else {}))
    # zero3/hsdp shard per FSDP unit (the ResNet's blocks), as torch_ref's fully_shard does.
    devices = make_mesh(**mesh) if mesh else make_mesh(n)
    strategy = create_strategy(name, net, classifier(net), tx, devices, **ins.fsdp_options(name, net, options),
                               compiler_options=levers.compiler_options(lever, jax.devices()[0].platform) or "none")
    strategy.donate = levers.donates(lever)
    host = {"image": np.asarray(images, np.dtype(net.dtype)), "label": np.asarray(labels, np.int32)}
    state = strategy.engine.init(jax.random.key(0), host)  # sharded: each device builds only its own part
    rec = {"framework": "jaxdp", "compiler_options": strategy.compiler_options, "donate": strategy.donate}
    # Model-state bytes measured vs the ZeRO formula (traced, no compile).
    try:
        rep = ins.measure(strategy, host, state=state, compile=False)
        rec.update(psi=rep["psi"], state=rep["state"], traffic_formula_bytes=rep["traffic_formula_bytes"],
                   axes=rep["axes"])
    except Exception as e:  # a strategy inspect does not know: say so, go on
        rec["state_error"] = f"{type(e).__name__}: {e}"
    batch = strategy.engine.shard_batch(host)

    t0 = time.perf_counter()
    try:
        compiled = strategy.engine.lower_step(state, batch).compile()
        run = compiled
        rec["memory"] = with_total(ins.compiled_memory(compiled))
        rec["collectives"] = ins.parse_collectives(compiled.as_text(), n)
        rec["compile_s"] = time.perf_counter() - t0
    except Exception as e:  # no AOT path: the first call compiles (and runs one step)
        rec["compile_error"] = f"{type(e).__name__}: {e}"
        run = strategy.engine.step
        state, out = run(state, batch)
        jax.block_until_ready((state, out))
        rec["compile_s"] = time.perf_counter() - t0
        rec["compile_s_includes_one_step"] = True
    for _ in range(cfg["warmup"]):
        state, out = run(state, batch)
        # Each step waits for the last: back-to-back programs on a CPU mesh with two device
        # axes can deadlock in XLA:CPU's rendezvous (ShardMapEngine._one_at_a_time).
        jax.block_until_ready((state, out))
    jax.block_until_ready(state)
    times = []
    for _ in range(cfg["steps"]):
        t = time.perf_counter()
        state, out = run(state, batch)
        jax.block_until_ready((state, out))
        times.append(time.perf_counter() - t)
    rec["step_times_s"] = times
    rec["loss"] = float(np.mean(np.asarray(out["loss"])))  # dp (pmap): one per device
    return rec


def bench_pipeline(n: int, global_batch: int, num_images: int) -> dict:
    from jaxdp.data import epoch_batches, make_synthetic

    train, _ = make_synthetic(num_images, 8, seed=0)
    t = time.perf_counter()
    count = 0
    for batch in epoch_batches(train, num_replicas=n, batch_per_replica=global_batch // n, epoch=0, seed=0,
                               train=True):
        count += batch.images.shape[0] * batch.images.shape[1]
    dt = time.perf_counter() - t
    return {"replicas": n, "global_batch": global_batch, "images": count, "seconds": dt,
            "images_per_s": count / dt, "threads": "1 (numpy, main thread)"}
