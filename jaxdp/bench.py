"""``jaxdp bench``: jaxdp vs torch_ref side by side, per strategy and device count.

    jaxdp bench --quick                       # tiny ResNet, N = 1,2, every strategy (minutes on 2 cores)
    jaxdp bench --strategies ddp,zero3 --devices 1,2 --width 16 --global-batch-size 32 --steps 10

For every (N, strategy) row, in one invocation:

- **jaxdp**: the strategy's step is lowered and compiled once (``lower_step(...).compile()``,
  its wall time reported as ``compile_s``, never mixed into step times) and that same
  executable is then run ``--warmup`` times untimed and ``--steps`` times timed, each step
  ended by ``block_until_ready``. Reported: median step time, images/s, compiled per-device
  memory (``memory_analysis()``: argument, output, alias, temp; ``total`` = argument + output
  - alias + temp, the donated state counted once), per-device model-state bytes measured
  vs the ZeRO formula and the collective bytes per step read from the compiled HLO vs the
  ring formula (both from ``jaxdp.inspect``: ``measure``/``parse_collectives``).
- **torch_ref**: the twin strategy (ddp -> DDP, zero1 -> ZeroRedundancyOptimizer,
  zero2/zero3 -> FSDP2, hsdp -> FSDP2 on a 2-D mesh, dp -> one process on the full batch
  on CPU) in N ranks started like ``torch_ref.launcher`` (forkserver, one intra-op
  thread per rank, torchrun's ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``: rank r on ``cuda:r``
  under nccl; backend from ``torch_ref.dist.resolve_backend``, i.e. ``JAXDP_TORCH_BACKEND``
  or nccl with a GPU per rank, else gloo). Each rank builds ``torch_ref.step_api.build(config)`` and times
  ``Runner.step(collect=False)`` itself: barrier, ``perf_counter``, step (which ends with an
  all-gather of the losses, so every rank has finished), ``perf_counter``. Rank 0's
  times are reported; process start, imports and wrapping are outside the timed steps.
  ``async``'s torch columns are empty: its twin is DDP (at staleness 0), which the ddp row times.
- The order alternates per row (jaxdp first on even rows, torch first on odd rows) and
  the ratio ``jaxdp/torch`` of median step times is given per row (< 1: jaxdp faster).
- Both frameworks step the same fixed host batch (global batch split over N, ``--dtype``),
  so the input pipeline is not in either number; it is measured on its own
  (``epoch_batches`` with augmentation, host images/s) against the best training rate.

CPU fairness: torch ``set_num_threads(1)`` per rank; JAX gets the same cores: the
process's threads are pinned to N cores while a row with N devices runs (``cores_for``:
XLA:CPU's convolutions otherwise use every core, even for one device), and
``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false`` (no Eigen intra-op thread pool inside an
op; the N simulated devices still run concurrently, like N ranks). Not
``intra_op_parallelism_threads=1``: that old TF-style token is no XLA flag in jax 0.10, and
XLA's parser silently stops at it, dropping every flag after it (the device count too). Every
record carries its environment: device kind, versions, those flags, CPU affinity and
the load average before and after the row.

GPU (CUDA host): the same command runs jaxdp on the GPUs and torch_ref on NCCL (rank r on
``cuda:r``), default
dtype bfloat16, and adds MFU = images/s x FLOP per image / (N x peak), with FLOP per
trained image from ResNet-18 CIFAR (3.33 GFLOP at width 64, scaled by (width/64)^2) and
the peak from ``PEAK_TFLOPS`` by device name. This path has not been run on a GPU yet.

Nothing here imports jax or torch at module level: the simulated device count and XLA
flags must be set before jax starts, and torch ranks import this module to run.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
import time
from typing import List, Optional, Sequence

import numpy as np

# Dense bf16 peak per device, TFLOP/s, by a substring of the device name (first match wins).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "GH200": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 70.0,
               "L4": 121.0, "V100": 125.0}
RESNET18_CIFAR_FLOP = 3.33e9  # per trained image (fwd + bwd), width 64, 32x32
XLA_THREAD_FLAGS = "--xla_cpu_multi_thread_eigen=false"
QUICK = dict(width=8, blocks=(1, 1, 1, 1), global_batch=16, steps=10, warmup=2, n=(1, 2))


def _ints(text: str):
    return tuple(int(x) for x in text.split(",") if x)


def add_bench_args(p) -> None:
    from jaxdp import choices
    from jaxdp.flags import deprecated_alias

    p.add_argument("--strategies", default=None, help="comma list (default: every registered strategy)")
    p.add_argument("--devices", dest="n", type=_ints, default=None,
                   help="device counts, e.g. 1,2,4,8 (default 1,2,4,8)")
    deprecated_alias(p, "--n", "--devices", dest="n", type=_ints)
    p.add_argument("--model", default="resnet18", metavar=choices.listing(choices.MODELS), help="architecture")
    p.add_argument("--width", type=int, default=None, help="ResNet: channels of the first stage (default 16)")
    p.add_argument("--blocks", type=_ints, default=None, help="ResNet: blocks per stage, e.g. 1,1,1,1")
    p.add_argument("--global-batch-size", dest="global_batch", type=int, default=None,
                   help="images per step over all devices (default 32)")
    deprecated_alias(p, "--global-batch", "--global-batch-size", dest="global_batch", type=int)
    p.add_argument("--dtype", default=None, metavar=choices.listing(choices.DTYPES), help="float32 (CPU default) | bfloat16 (GPU default)")
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"), help="sgd (momentum 0.9) | adam")
    p.add_argument("--steps", type=int, default=None, help="timed steps per row (default 10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps after compiling (default 2)")
    p.add_argument("--no-torch", dest="torch", action="store_false", help="jaxdp only")
    p.add_argument("--pipeline-images", type=int, default=4096, help="images in the input-pipeline measurement")
    p.add_argument("--quick", action="store_true",
                   help=f"tiny settings: width {QUICK['width']}, blocks 1,1,1,1, batch {QUICK['global_batch']}, "
                        f"N {','.join(map(str, QUICK['n']))}, {QUICK['steps']} steps")
    p.add_argument("--out", default="benchmarks/results", help="folder for bench.json, bench.md and the PNGs")
    p.add_argument("--tag", default="bench", help="file name stem of the outputs")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per torch launch")


def _resolve(args) -> dict:
    gpu = _cuda_host()
    q = QUICK if args.quick else {}
    from jaxdp.config import TrainError  # not jaxdp.models: jax must not start before prepare_jax

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
    }


def _cuda_host() -> bool:
    return os.path.exists("/dev/nvidiactl") or bool(os.environ.get("CUDA_VISIBLE_DEVICES"))


def prepare_jax(max_devices: int) -> None:
    """Simulated CPU devices and single-threaded XLA CPU ops; only effective before jax starts."""
    from jaxdp.mesh import simulate_cpu_devices

    if "jax" not in sys.modules:
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_cpu_multi_thread_eigen" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} {XLA_THREAD_FLAGS}".strip()
        simulate_cpu_devices(max_devices)


# ----------------------------------------------------------------------------- environment

def environment() -> dict:
    import jax

    env = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "host": platform.node(), "python": platform.python_version(),
        "jax": jax.__version__, "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind, "jax_devices": len(jax.devices()),
        "cpu_count": os.cpu_count(), "cpu_affinity": sorted(os.sched_getaffinity(0)),
        "cpu_model": _cpu_model(),
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        "jax_already_imported_before_flags": "xla_cpu_multi_thread_eigen" not in os.environ.get("XLA_FLAGS", ""),
        "torch_threads_per_rank": 1,
        "loadavg": list(os.getloadavg()),
    }
    try:
        import torch

        env["torch"] = torch.__version__
        env["torch_cuda"] = torch.cuda.is_available()
    except ImportError:
        env["torch"] = None
    return env


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def peak_tflops(device_kind: str) -> Optional[float]:
    for key, value in PEAK_TFLOPS.items():
        if key.lower() in device_kind.lower():
            return value
    return None


def flop_per_image(model: str, width: int) -> Optional[float]:
    """ResNet-18 CIFAR FLOP per trained image, conv FLOP scaling with width^2 (other models: None)."""
    return RESNET18_CIFAR_FLOP * (width / 64) ** 2 if model == "resnet18" else None


# ----------------------------------------------------------------------------- jaxdp side

def _mesh_shape(name: str, n: int):
    if name != "hsdp":
        return None
    return (2, n // 2) if n >= 2 and n % 2 == 0 else (1, n)


@contextlib.contextmanager
def cores_for(n: int):
    """On a CPU host, run every thread of this process on ``n`` of its cores while inside.

    torch_ref's N ranks get one intra-op thread each; XLA's CPU runtime would otherwise
    spread one simulated device's convolutions over every core (measured: ResNet-18, one
    device, batch 16: 0.49 s/step on 2 cores, 0.73 s on 1). So N devices get N cores,
    as N torch ranks do. Threads started inside inherit the mask.
    """
    cores = sorted(os.sched_getaffinity(0))
    if _cuda_host() or n >= len(cores):
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


def bench_jax(name: str, n: int, cfg: dict, images: np.ndarray, labels: np.ndarray) -> dict:
    with cores_for(n):
        rec = _bench_jax(name, n, cfg, images, labels)
    rec["cores"] = n if not _cuda_host() else None
    return rec


def _bench_jax(name: str, n: int, cfg: dict, images: np.ndarray, labels: np.ndarray) -> dict:
    import jax

    from jaxdp import inspect as ins
    from jaxdp.mesh import make_mesh
    from jaxdp.models import create_model
    from jaxdp.optim import make_optimizer
    from jaxdp.strategies import create_strategy
    from jaxdp.task import classifier

    net = create_model(cfg["model"], width=cfg["width"], blocks=cfg["blocks"], dtype=cfg["dtype"])
    tx = make_optimizer(cfg["optimizer"], 0.1 if cfg["optimizer"] == "sgd" else 1e-3)
    options = {"mesh_shape": _mesh_shape(name, n)} if name == "hsdp" else {}
    # zero3/hsdp shard per FSDP unit (the ResNet's blocks), as torch_ref's fully_shard does.
    strategy = create_strategy(name, net, classifier(net), tx, make_mesh(n), **ins.fsdp_options(name, net, options))
    host = {"image": np.asarray(images, np.dtype(net.dtype)), "label": np.asarray(labels, np.int32)}
    state = strategy.init(jax.random.key(0), host)  # sharded: each device builds only its own part
    rec = {"framework": "jaxdp"}
    # Model-state bytes measured vs the ZeRO formula (traced, no compile).
    try:
        rep = ins.measure(strategy, host, state=state, compile=False)
        rec.update(psi=rep["psi"], state=rep["state"], traffic_formula_bytes=rep["traffic_formula_bytes"])
    except Exception as e:  # a strategy inspect does not know: say so, go on
        rec["state_error"] = f"{type(e).__name__}: {e}"
    batch = strategy.shard_batch(host)

    t0 = time.perf_counter()
    try:
        compiled = strategy.lower_step(state, batch).compile()
        run = compiled
        rec["memory"] = ins.compiled_memory(compiled)
        m = rec["memory"]
        m["total"] = m["argument"] + m["output"] - m["alias"] + m["temp"]
        rec["collectives"] = ins.parse_collectives(compiled.as_text(), n)
        rec["compile_s"] = time.perf_counter() - t0
    except Exception as e:  # no AOT path: the first call compiles (and runs one step)
        rec["compile_error"] = f"{type(e).__name__}: {e}"
        run = strategy.step
        state, out = run(state, batch)
        jax.block_until_ready((state, out))
        rec["compile_s"] = time.perf_counter() - t0
        rec["compile_s_includes_one_step"] = True
    for _ in range(cfg["warmup"]):
        state, out = run(state, batch)
    jax.block_until_ready((state, out) if cfg["warmup"] else state)
    times = []
    for _ in range(cfg["steps"]):
        t = time.perf_counter()
        state, out = run(state, batch)
        jax.block_until_ready((state, out))
        times.append(time.perf_counter() - t)
    rec["step_times_s"] = times
    rec["loss"] = float(np.mean(np.asarray(out["loss"])))  # dp (pmap): one per device
    return rec


# ----------------------------------------------------------------------------- torch_ref side

def _torch_worker(rank: int, world: int, workdir: str, config: dict, images: np.ndarray, labels: np.ndarray,
                  warmup: int, steps: int, timeout_s: float, backend: str = "gloo") -> None:
    """One rank: build the Runner, run warm-up steps, time ``steps`` steps (see module docstring)."""
    import pickle
    import traceback

    code = 1
    try:
        from torch_ref.launcher import rank_env

        os.environ.update(rank_env(rank, world, backend))  # torchrun's variables: cuda:rank on nccl
        import torch

        torch.set_num_threads(1)
        from torch_ref import dist as tdist
        from torch_ref.step_api import build

        tdist.init(timeout_s, init_method="file://" + os.path.join(workdir, "store"), rank=rank, world_size=world,
                   backend=backend)
        runner = build(config, None)
        cuda = tdist.device().type == "cuda"  # gloo runs on the CPU, GPUs or not
        x, y = images[rank], labels[rank]
        for _ in range(warmup):
            runner.step(x, y, collect=False)
        times, out = [], None
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for _ in range(steps):
            torch.distributed.barrier()
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = runner.step(x, y, collect=False)  # ends with an all-gather of the losses
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        if rank == 0:
            result = {"step_times_s": times, "loss": out["loss"],
                      "threads": torch.get_num_threads(), "torch": torch.__version__,
                      "backend": tdist.backend(),
                      "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None}
            tmp = os.path.join(workdir, "results.pkl.tmp")
            with open(tmp, "wb") as f:
                pickle.dump(result, f)
            os.replace(tmp, os.path.join(workdir, "results.pkl"))
        torch.distributed.barrier()
        code = 0
    except BaseException:
        with open(os.path.join(workdir, f"rank{rank}.error"), "w") as f:
            f.write(traceback.format_exc())
    finally:  # no teardown: see torch_ref.launcher._worker
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def torch_twin(name: str) -> Optional[str]:
    """torch_ref's strategy for ``name`` (its facts), None where the twin holds only for some
    options: async is DDP at staleness 0, which the ddp row already times."""
    from jaxdp.strategies import facts

    f = facts(name)
    return None if f.twin_when else f.torch_twin


def bench_torch(name: str, n: int, cfg: dict, images: np.ndarray, labels: np.ndarray, timeout_s: float) -> dict:
    """Launch ``n`` ranks (dp: one process on the full batch) and collect rank 0's step times."""
    import pickle
    import shutil
    import tempfile

    from torch_ref import launcher
    from torch_ref.dist import resolve_backend

    config = {"strategy": torch_twin(name), "model": cfg["model"], "width": cfg["width"], "blocks": cfg["blocks"],
              "dtype": cfg["dtype"], "optimizer": cfg["optimizer"], "lr": 0.1 if cfg["optimizer"] == "sgd" else 1e-3,
              "total_steps": cfg["warmup"] + cfg["steps"]}
    if name == "hsdp":
        config["mesh_shape"] = _mesh_shape(name, n)
    world = n
    if name == "dp":  # single process holding the whole batch (nn.DataParallel's CPU fallback)
        world = 1
        images = images.reshape(1, -1, *images.shape[2:])
        labels = labels.reshape(1, -1)
    # Resolved here, not in the ranks: a forkserver started earlier has another environment.
    backend = resolve_backend(cfg.get("torch_backend"), world)
    ctx = launcher._context()
    workdir = tempfile.mkdtemp(prefix="jaxdp_bench_torch_")
    procs = []
    t0 = time.perf_counter()
    try:
        for r in range(world):
            p = ctx.Process(target=_torch_worker, daemon=True,
                            args=(r, world, workdir, config, images, labels, cfg["warmup"], cfg["steps"], timeout_s,
                                  backend))
            p.start()
            procs.append(p)
        launcher._wait(procs, workdir, timeout_s)
        with open(os.path.join(workdir, "results.pkl"), "rb") as f:
            rec = pickle.load(f)
    finally:
        launcher._stop(procs)
        shutil.rmtree(workdir, ignore_errors=True)
    rec.update(framework="torch_ref", config=config, world=world, launch_wall_s=time.perf_counter() - t0)
    return rec


# ----------------------------------------------------------------------------- input pipeline

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


# ----------------------------------------------------------------------------- the run

def _median(xs):
    return statistics.median(xs) if xs else None


def _summary(rec: dict, global_batch: int) -> dict:
    med = _median(rec.get("step_times_s", []))
    rec["median_step_s"] = med
    rec["images_per_s"] = global_batch / med if med else None
    return rec


class BenchError(ValueError):
    """A bench request with nothing to measure: one line, no traceback."""


def run_bench(cfg: dict, strategies: Sequence[str], *, with_torch: bool = True, timeout_s: float = 600.0,
              pipeline_images: int = 4096, log=print) -> dict:
    import jax

    env = environment()
    available = len(jax.devices())
    ns = [n for n in cfg["n"] if n <= available and cfg["global_batch"] % n == 0]
    skipped = [n for n in cfg["n"] if n not in ns]
    if not ns or not strategies:
        raise BenchError("nothing to benchmark: no strategy given" if not strategies else
                         f"nothing to benchmark: every N in {list(cfg['n'])} was skipped (only {available} "
                         f"devices, or global batch {cfg['global_batch']} not divisible by N)")
    if skipped:
        log(f"bench: skipping N = {skipped} (only {available} devices, or global batch "
            f"{cfg['global_batch']} not divisible)")
    peak = peak_tflops(env["device_kind"]) if env["backend"] == "gpu" else None
    fpi = flop_per_image(cfg["model"], cfg["width"])
    rng = np.random.default_rng(0)
    rows = []
    i = 0
    for n in ns:
        images = rng.normal(size=(n, cfg["global_batch"] // n, 32, 32, 3)).astype(np.float32)
        labels = rng.integers(0, 10, size=(n, cfg["global_batch"] // n)).astype(np.int32)
        for name in strategies:
            row = {"strategy": name, "n": n, "mesh_shape": _mesh_shape(name, n), "global_batch": cfg["global_batch"],
                   "order": "jaxdp first" if i % 2 == 0 else "torch_ref first",
                   "loadavg_before": list(os.getloadavg())}
            do_torch = with_torch and torch_twin(name) is not None

            def do_jax():
                try:
                    row["jaxdp"] = _summary(bench_jax(name, n, cfg, images.reshape(-1, 32, 32, 3),
                                                      labels.reshape(-1)), cfg["global_batch"])
                except Exception as e:
                    row["jaxdp"] = {"error": f"{type(e).__name__}: {e}"}

            def do_torch_row():
                try:
                    row["torch_ref"] = _summary(bench_torch(name, n, cfg, images, labels, timeout_s),
                                                cfg["global_batch"])
                except Exception as e:
                    row["torch_ref"] = {"error": f"{type(e).__name__}: {str(e)[-2000:]}"}

            order = [do_jax, do_torch_row] if i % 2 == 0 else [do_torch_row, do_jax]
            for f in order:
                if f is do_torch_row and not do_torch:
                    continue
                f()
            i += 1
            row["loadavg_after"] = list(os.getloadavg())
            j, t = row.get("jaxdp", {}), row.get("torch_ref", {})
            if j.get("median_step_s") and t.get("median_step_s"):
                row["ratio_jax_over_torch"] = j["median_step_s"] / t["median_step_s"]
            if peak and fpi and j.get("images_per_s"):
                row["mfu_jaxdp"] = j["images_per_s"] * fpi / (n * peak * 1e12)
                if t.get("images_per_s"):
                    row["mfu_torch_ref"] = t["images_per_s"] * fpi / (n * peak * 1e12)
            rows.append(row)
            log(_row_line(row))
    pipe = bench_pipeline(max(ns), cfg["global_batch"], pipeline_images) if ns else None
    best = max((r["jaxdp"]["images_per_s"] for r in rows if r.get("jaxdp", {}).get("images_per_s")), default=None)
    if pipe and best:
        pipe["best_jaxdp_train_images_per_s"] = best
        pipe["headroom"] = pipe["images_per_s"] / best
    env["loadavg_end"] = list(os.getloadavg())
    return {"config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()},
            "strategies": list(strategies), "environment": env, "peak_tflops": peak, "flop_per_image": fpi,
            "rows": rows, "pipeline": pipe}


# ----------------------------------------------------------------------------- formatting

def _fmt(x, spec=".3f", none="-"):
    return none if x is None else format(x, spec)


def _mb(x):
    return None if x is None else x / 2 ** 20


HEADER = ("| strategy | N | jaxdp step s | torch step s | jax/torch | jaxdp img/s | torch img/s | compile s "
          "| mem/dev MiB (compiled) | state MiB meas / formula | traffic MiB/step meas / formula |")


def _row_cells(r: dict) -> list:
    j, t = r.get("jaxdp", {}), r.get("torch_ref", {})
    st = j.get("state") or {}
    meas = st.get("measured") or {}
    form = st.get("formula") or {}
    state_m = sum(v for k, v in meas.items() if k in ("params", "grads", "opt") and v is not None) if meas else None
    state_f = sum(form.values()) if form else None
    coll = (j.get("collectives") or {}).get("ring_bytes")
    err = j.get("error") or t.get("error")
    return [r["strategy"] + (f" {r['mesh_shape'][0]}x{r['mesh_shape'][1]}" if r.get("mesh_shape") else ""),
            str(r["n"]), _fmt(j.get("median_step_s"), ".4f"),
            _fmt(t.get("median_step_s"), ".4f", "n/a" if "torch_ref" not in r else "err"),
            _fmt(r.get("ratio_jax_over_torch"), ".2f"), _fmt(j.get("images_per_s"), ".1f"),
            _fmt(t.get("images_per_s"), ".1f"), _fmt(j.get("compile_s"), ".1f"),
            _fmt(_mb((j.get("memory") or {}).get("total")), ".2f"),
            f"{_fmt(_mb(state_m), '.3f')}{' (no grads)' if meas and meas.get('grads') is None else ''}"
            f" / {_fmt(_mb(state_f), '.3f')}",
            f"{_fmt(_mb(coll), '.3f')} / {_fmt(_mb(j.get('traffic_formula_bytes')), '.3f')}"] + ([err[:80]] if err else [])


def _row_line(r: dict) -> str:
    return " | ".join(_row_cells(r))


def markdown(result: dict) -> str:
    c, e = result["config"], result["environment"]
    lines = [
        f"Model {c['model']} width {c['width']} blocks {c['blocks'] or 'default'}, {c['dtype']}, {c['optimizer']}, "
        f"global batch {c['global_batch']}, median of {c['steps']} steps after {c['warmup']} warm-up.",
        f"Machine: {e['device_kind']} ({e['backend']}), {e['cpu_count']} CPUs ({e['cpu_model']}), "
        f"jax {e['jax']}, torch {e.get('torch')}, {e['date_utc']} UTC; load average start "
        f"{', '.join(f'{x:.2f}' for x in e['loadavg'])}, end {', '.join(f'{x:.2f}' for x in e['loadavg_end'])}.",
        f"XLA_FLAGS: `{e['XLA_FLAGS']}`; torch: 1 intra-op thread per rank.",
        "",
        HEADER,
        "|" + "---|" * (HEADER.count("|") - 1),
    ]
    for r in result["rows"]:
        cells = _row_cells(r)[:HEADER.count("|") - 1]
        lines.append("| " + " | ".join(cells) + " |")
    errors = [(r["strategy"], r["n"], fw, r[fw]["error"]) for r in result["rows"] for fw in ("jaxdp", "torch_ref")
              if isinstance(r.get(fw), dict) and "error" in r[fw]]
    for s, n, fw, err in errors:
        lines.append(f"\n- error {fw} {s} N={n}: `{err.splitlines()[0][:200] if err else ''}`")
    if result.get("peak_tflops"):
        lines.append("")
        for r in result["rows"]:
            if "mfu_jaxdp" in r:
                lines.append(f"- MFU {r['strategy']} N={r['n']}: jaxdp {r['mfu_jaxdp']:.1%}, torch_ref "
                             f"{_fmt(r.get('mfu_torch_ref'), '.1%')} (peak {result['peak_tflops']} TFLOP/s)")
    p = result.get("pipeline")
    if p:
        lines += ["", f"Input pipeline (numpy, epoch_batches with augmentation, {p['replicas']} replicas): "
                      f"{p['images_per_s']:.0f} images/s on the host; best jaxdp training rate "
                      f"{_fmt(p.get('best_jaxdp_train_images_per_s'), '.1f')} images/s; headroom "
                      f"{_fmt(p.get('headroom'), '.1f')}x."]
    return "\n".join(lines)


def plots(result: dict, out: str, tag: str) -> List[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    strategies = result["strategies"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    ax = axes[0]
    for k, s in enumerate(strategies):  # one colour per strategy; solid jaxdp, dashed torch_ref
        rs = [r for r in rows if r["strategy"] == s]
        for fw, style in (("jaxdp", "-o"), ("torch_ref", "--s")):
            pts = [(r["n"], r[fw]["images_per_s"]) for r in rs if (r.get(fw) or {}).get("images_per_s")]
            if pts:
                ax.plot(*zip(*pts), style, color=f"C{k % 10}", label=f"{s} {fw}")
    ax.set_xticks(sorted({r["n"] for r in rows}))
    ax.set_xlabel("devices / ranks N")
    ax.set_ylabel("images/s")
    ax.set_title("throughput")
    ax.legend(fontsize=7)
    nmax = max((r["n"] for r in rows), default=1)
    last = [r for r in rows if r["n"] == nmax and (r.get("jaxdp") or {}).get("memory")]
    xs = np.arange(len(last))
    ax = axes[1]
    comp = [_mb(r["jaxdp"]["memory"]["total"]) for r in last]
    meas = [_mb(sum(v or 0 for k, v in ((r["jaxdp"].get("state") or {}).get("measured") or {}).items()
                    if k in ("params", "grads", "opt"))) for r in last]
    form = [_mb(sum(((r["jaxdp"].get("state") or {}).get("formula") or {}).values())) for r in last]
    ax.bar(xs - 0.27, comp, 0.27, label="compiled step (arg+out-alias+temp)")
    ax.bar(xs, meas, 0.27, label="model state measured")
    ax.bar(xs + 0.27, form, 0.27, label="model state formula")
    ax.set_xticks(xs, [r["strategy"] for r in last])
    ax.set_ylabel("MiB per device")
    ax.set_title(f"memory per device, N={nmax}")
    ax.legend(fontsize=7)
    ax = axes[2]
    meas = [_mb((r["jaxdp"].get("collectives") or {}).get("ring_bytes") or 0) for r in last]
    form = [_mb(r["jaxdp"].get("traffic_formula_bytes") or 0) for r in last]
    ax.bar(xs - 0.2, meas, 0.4, label="HLO measured (ring bytes)")
    ax.bar(xs + 0.2, form, 0.4, label="formula")
    ax.set_xticks(xs, [r["strategy"] for r in last])
    ax.set_ylabel("MiB sent per device per step")
    ax.set_title(f"collective traffic, N={nmax}")
    ax.legend(fontsize=7)
    c = result["config"]
    fig.suptitle(f"jaxdp vs torch_ref: {c['model']} w{c['width']} {c['dtype']} batch {c['global_batch']} "
                 f"({result['environment']['device_kind']}, load {result['environment']['loadavg'][0]:.1f})")
    fig.tight_layout()
    path = os.path.join(out, f"{tag}.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]


def run(args) -> int:
    cfg = _resolve(args)
    prepare_jax(max(cfg["n"]))
    from jaxdp.strategies import STRATEGIES

    strategies = [s for s in (args.strategies.split(",") if args.strategies else STRATEGIES) if s]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        from jaxdp.strategies import StrategyError

        raise StrategyError(f"unknown strategy {', '.join(unknown)}; registered: {', '.join(STRATEGIES)}")
    print(HEADER)
    result = run_bench(cfg, strategies, with_torch=args.torch, timeout_s=args.timeout,
                       pipeline_images=args.pipeline_images)
    os.makedirs(args.out, exist_ok=True)
    md = markdown(result)
    with open(os.path.join(args.out, f"{args.tag}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(args.out, f"{args.tag}.md"), "w") as f:
        f.write(md + "\n")
    paths = plots(result, args.out, args.tag)
    print()
    print(md)
    print(f"\nwrote {os.path.join(args.out, args.tag)}.json, .md, {', '.join(paths)}")
    return 0
