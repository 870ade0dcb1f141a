"""The bench's torch_ref side: the twin strategy on N ranks, each timing its own steps.

Torch-free at import: the ranks (forkserver children) import this module to run ``_torch_worker``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import sysconfig
import time
from typing import List, Optional

import numpy as np

from jaxdp import names, registry


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


def compile_preflight(backend: Optional[str], cuda: bool) -> Optional[str]:
    """What ``torch.compile(backend="inductor")`` needs and this host lacks, in one line; None when
    nothing is missing (or for another backend). Inductor builds C++ kernels on a CPU and Triton
    kernels on a GPU; Triton compiles its launcher with a C compiler against Python's headers."""
    if backend != "inductor":
        return None
    missing: List[str] = []
    wanted = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    if not cuda:
        wanted = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    if not any(shutil.which(c) for c in wanted):
        missing.append(f"a {'C' if cuda else 'C++'} compiler (none of {', '.join(wanted)} on PATH)")
    header = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    if not os.path.exists(header):
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        missing.append(f"Python's headers ({header} is missing: e.g. apt install python{version}-dev)")
    if cuda and importlib.util.find_spec("triton") is None:
        missing.append("triton (pip install triton)")
    if not missing:
        return None
    return f"torch.compile preflight: inductor needs {'; '.join(missing)}; or leave out --torch-compile"


def torch_twin(name: str) -> Optional[str]:
    """torch_ref's strategy for ``name`` (its registry row), None where the twin holds only for some
    options (its facts): async is DDP at staleness 0, which the ddp row already times."""
    from jaxdp.strategies import facts

    return None if facts(name).twin_when else registry.row(name).torch_twin


def twin_options(twin: str, options: dict) -> dict:
    from torch_ref.strategies import twin as twin_named

    return {k: v for k, v in options.items() if k in twin_named(twin).options}


def bench_torch(name: str, n: int, cfg: dict, images: np.ndarray, labels: np.ndarray, timeout_s: float,
                options=None, compile_backend: Optional[str] = None) -> dict:
    """Launch ``n`` ranks (dp: one process on the full batch) and collect rank 0's step times.
    ``options``: the row's jaxdp options; the twin gets those it has a knob for (remat: FSDP2
    has none, it keeps activations). The step is torch at its fastest (``step_api``'s
    ``tuned``: channels_last and cudnn.benchmark on CUDA), under ``torch.compile`` with
    ``compile_backend`` if given (its compile falls in the warm-up steps: at least one)."""
    import pickle
    import shutil
    import tempfile

    from torch_ref import launcher
    from torch_ref.dist import resolve_backend
    from torch_ref.strategies import twin

    config = {"strategy": torch_twin(name), "model": cfg["model"], "width": cfg["width"], "blocks": cfg["blocks"],
              "dtype": cfg["dtype"], "optimizer": cfg["optimizer"], "lr": names.optimizer(cfg["optimizer"]).default_lr,
              "total_steps": cfg["warmup"] + cfg["steps"] + 1, "tuned": True, "compile": compile_backend}
    warmup = max(cfg["warmup"], 1) if compile_backend else cfg["warmup"]
    if registry.mesh_shape(name, n):
        config["mesh_shape"] = registry.mesh_shape(name, n)
    config.update(twin_options(config["strategy"], options or {}))
    world = n
    if twin(config["strategy"]).one_process:  # one process holding the whole batch (nn.DataParallel's CPU fallback)
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
                            args=(r, world, workdir, config, images, labels, warmup, cfg["steps"], timeout_s,
                                  backend))
            p.start()
            procs.append(p)
        launcher._wait(procs, workdir, timeout_s)
        with open(os.path.join(workdir, "results.pkl"), "rb") as f:
            rec = pickle.load(f)
    finally:
        launcher._stop(procs)
        shutil.rmtree(workdir, ignore_errors=True)
    rec.update(framework="torch_ref" + (" + torch.compile" if compile_backend else ""), config=config, world=world,
               warmup=warmup, launch_wall_s=time.perf_counter() - t0)
    return rec
