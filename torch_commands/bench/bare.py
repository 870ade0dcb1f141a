"""The bench's ``bare`` rows: the same model, loss and optimizer with no jaxdp and no DDP code.

- jax: one ``jax.jit`` step of ``value_and_grad`` (softmax cross-entropy, BatchNorm's batch
  statistics as mutable state) and the optax update, on one device, state donated, compiled
  with the strategies' default compile options (``jaxdp.runtime.compile_options``);
- torch: one eager step (``zero_grad``, forward, ``cross_entropy``, ``backward``,
  ``optimizer.step``) in a fresh process with one intra-op thread, as a torch_ref rank has.

Each runs at a row's per-device batch (global batch / N) on one core (jax pinned by
``cores_for(1)``), so ``strategy step / bare step`` at the same per-device batch is what the
strategy costs on top of the kernels: its collectives, its bookkeeping, and the share of a
core the other N-1 devices take. That ratio, jaxdp's beside torch_ref's, is the overhead
column of the report.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Optional

import numpy as np

from jaxdp import names
from torch_commands.bench import cuda_host, levers
from torch_commands.bench.jax_side import cores_for
from torch_commands.bench.torch_side import compile_preflight


def bench_bare(cfg: dict, images: np.ndarray, labels: np.ndarray, *, with_torch: bool, timeout_s: float,
               compile_backend: Optional[str] = None, lever: Optional[str] = None) -> dict:
    """Both bare steps on one device's batch (and the torch step under ``torch.compile`` with
    ``compile_backend``, if given; the jax step under ``lever``); a failure is recorded, as a
    strategy row's is."""
    runs = {"jax": lambda: bare_jax(cfg, images, labels, lever)}
    if with_torch:
        runs["torch"] = lambda: bare_torch(cfg, images, labels, timeout_s)
    if with_torch and compile_backend:
        runs["torch_compile"] = lambda: bare_torch(dict(cfg, warmup=max(cfg["warmup"], 1)), images, labels, timeout_s,
                                                   compile_backend)
    rec = {"batch_per_device": int(len(images))}
    missing = compile_preflight(compile_backend, cuda_host()) if "torch_compile" in runs else None
    for fw, run in runs.items():
        if fw == "torch_compile" and missing:
            rec[fw] = {"error": missing}
            continue
        try:
            rec[fw] = run()
            rec[fw]["median_step_s"] = statistics.median(rec[fw]["step_times_s"])
        except Exception as e:
            rec[fw] = {"error": f"{type(e).__name__}: {str(e)[-2000:]}"}
    return rec


def add_overheads(row: dict, bare: dict) -> None:
    """``overhead_jaxdp`` = jaxdp's step / the bare jax step at the row's per-device batch;
    ``overhead_torch_ref`` likewise against the bare torch step."""
    for fw, base in (("jaxdp", "jax"), ("torch_ref", "torch"), ("torch_compile", "torch_compile")):
        step, alone = (row.get(fw) or {}).get("median_step_s"), (bare.get(base) or {}).get("median_step_s")
        if step and alone:
            row[f"overhead_{fw}"] = step / alone


def bare_markdown(result: dict) -> str:
    """The bare steps per N, and each strategy's step over them."""
    if not result.get("bare"):
        return ""
    lines = ["", "Bare steps (no jaxdp, no DDP: one `jax.jit(value_and_grad)` step; one torch step, eager and "
                 "under torch.compile where timed), one core, at each N's per-device batch; overhead = strategy "
                 "step / bare step:", "",
             "| strategy | N | batch/device | bare jax s | bare torch s | jaxdp / bare jax | torch_ref / bare torch "
             "| bare torch.compile s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        bare = result["bare"].get(r.get("bare_key", str(r["n"])), {})
        cells = [(bare.get(fw) or {}).get("median_step_s") for fw in ("jax", "torch")]
        cells += [r.get("overhead_jaxdp"), r.get("overhead_torch_ref"), (bare.get("torch_compile") or {}).get("median_step_s")]
        lines.append(f"| {r['strategy']} | {r['n']} | {bare.get('batch_per_device', '-')} | "
                     + " | ".join("-" if x is None else f"{x:.2f}" if i in (2, 3) else f"{x:.4f}" for i, x in enumerate(cells))
                     + " |")
    return "\n".join(lines)


def bare_jax(cfg: dict, images: np.ndarray, labels: np.ndarray, lever: Optional[str] = None) -> dict:
    """Median-ready step times of the plain jitted step on ``images`` (one device's batch)."""
    with cores_for(1):
        return _bare_jax(cfg, images, labels, lever)


def _bare_jax(cfg: dict, images: np.ndarray, labels: np.ndarray, lever: Optional[str]) -> dict:
    import jax

    t0 = time.perf_counter()
    run, state, batch = bare_jax_step(cfg, images, labels, lever)
    compile_s = time.perf_counter() - t0
    times = []
    for i in range(cfg["warmup"] + cfg["steps"]):
        t = time.perf_counter()
        *state, loss = run(*state, *batch)
        jax.block_until_ready(loss)
        if i >= cfg["warmup"]:
            times.append(time.perf_counter() - t)
    return {"framework": "bare jax", "compile_s": compile_s, "step_times_s": times, "loss": float(loss)}


def bare_jax_step(cfg: dict, images: np.ndarray, labels: np.ndarray, lever: Optional[str] = None):
    """The compiled bare step, its state and batch: ``run(*state, *batch) -> (*state, loss)``;
    compiled under ``lever`` (``levers.LEVERS``; None: the strategies' defaults)."""
    import jax
    import optax

    from jaxdp.models import create_model
    from jaxdp.optim import make_optimizer

    net = create_model(cfg["model"], width=cfg["width"], blocks=cfg["blocks"], dtype=cfg["dtype"], **cfg.get("vit", {}))
    tx = make_optimizer(cfg["optimizer"], names.optimizer(cfg["optimizer"]).default_lr)
    x, y = jax.device_put(np.asarray(images, np.dtype(net.dtype))), jax.device_put(np.asarray(labels, np.int32))
    variables = jax.jit(lambda x: net.init(jax.random.key(0), x, train=False))(x)
    params, batch_stats = variables["params"], variables.get("batch_stats", {})
    opt_state = jax.jit(tx.init)(params)

    def step(params, batch_stats, opt_state, x, y):
        def loss_fn(p):
            logits, new = net.apply({"params": p, "batch_stats": batch_stats}, x, train=True,
                                    mutable=["batch_stats"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(np.float32), y).mean()
            return loss, new["batch_stats"]

        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), batch_stats, opt_state, loss

    state = (params, batch_stats, opt_state)
    # The strategies' compile options (jaxdp.runtime.compile_options' default for the platform) and the
    # row's lever, so that the overhead column compares code, not kernels.
    options = levers.compiler_options(lever, jax.devices()[0].platform)
    donate = (0, 1, 2) if levers.donates(lever) else ()
    run = jax.jit(step, donate_argnums=donate, compiler_options=options).lower(*state, x, y).compile()
    return run, state, (x, y)


def bare_torch(cfg: dict, images: np.ndarray, labels: np.ndarray, timeout_s: float,
               compile_backend: Optional[str] = None) -> dict:
    """The torch step's times (eager, or ``torch.compile`` with ``compile_backend``), from a
    fresh process (forkserver, as the bench's ranks)."""
    from torch_ref import launcher

    ctx = launcher._context()
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_bare_torch_worker, args=(send, cfg, images, labels, compile_backend), daemon=True)
    proc.start()
    send.close()
    try:
        if not receive.poll(timeout_s):
            raise TimeoutError(f"bare torch step: no result in {timeout_s:.0f} s")
        result = receive.recv()
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
    if "error" in result:
        raise RuntimeError(result["error"])
    return result


def _bare_torch_worker(send, cfg: dict, images: np.ndarray, labels: np.ndarray, compile_backend) -> None:
    import traceback

    try:
        send.send(_bare_torch(cfg, images, labels, compile_backend))
    except BaseException:
        send.send({"error": traceback.format_exc()[-2000:]})
    finally:
        sys.stdout.flush()
        os._exit(0)


def _bare_torch(cfg: dict, images: np.ndarray, labels: np.ndarray, compile_backend: Optional[str] = None) -> dict:
    import torch
    import torch.nn.functional as F

    from torch_ref.models import create_model
    from torch_ref.step_api import memory_format
    from torch_ref.strategies import optimizer_for

    torch.set_num_threads(1)
    device = torch.device("cuda" if cuda_host() and torch.cuda.is_available() else "cpu")
    # torch at its fastest, as the strategy rows' torch (step_api's tuned): channels_last and
    # cudnn.benchmark on CUDA, nothing on a CPU.
    layout = memory_format({"tuned": True}, device)
    torch.backends.cudnn.benchmark = device.type == "cuda"
    dtype = torch.float64 if cfg["dtype"] == "float64" else torch.float32  # bfloat16: autocast, f32 weights
    net = create_model(cfg["model"], width=cfg["width"], blocks=cfg["blocks"], **cfg.get("vit", {}))
    net = net.to(device, dtype, memory_format=layout)
    opt = optimizer_for(list(net.parameters()), cfg["optimizer"], names.optimizer(cfg["optimizer"]).default_lr)
    model = torch.compile(net, backend=compile_backend) if compile_backend else net
    x = torch.from_numpy(np.ascontiguousarray(np.asarray(images).transpose(0, 3, 1, 2)))
    x = x.to(device, dtype).contiguous(memory_format=layout)
    y = torch.from_numpy(np.asarray(labels, np.int64)).to(device)
    bf16 = cfg["dtype"] == "bfloat16"
    times = []
    for i in range(cfg["warmup"] + cfg["steps"]):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= cfg["warmup"]:
            times.append(time.perf_counter() - t)
    return {"framework": "bare torch" + (f" + torch.compile({compile_backend})" if compile_backend else ""),
            "step_times_s": times, "loss": float(loss.detach()), "threads": torch.get_num_threads(),
            "memory_format": str(layout)}
