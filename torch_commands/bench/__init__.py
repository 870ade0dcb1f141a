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
  ring formula (both from ``jaxdp.analysis``: ``measure``/``parse_collectives``).
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
``cuda:r``), default dtype bfloat16, torch_ref tuned (channels_last, cudnn.benchmark) and,
with ``--torch-compile``, also under ``torch.compile``; it adds MFU = images/s x the model's
FLOPs per trained image / (N x peak) (``jaxdp.run.flops.mfu``, as train's records; the peak
from ``jaxdp.run.perf.PEAK_FLOPS``). ``--levers`` gives jaxdp a row per XLA/step lever
(``levers``); ``--preset gpu`` (``gpu_preset``) sizes it all for a GPU host.

The modules: ``command`` (``jaxdp bench``, registered with ``jaxdp`` by entry point; the
[torch] extra), ``runner`` (the rows, the environment), ``jax_side``, ``torch_side``,
``bare``, ``levers``, ``gpu_preset``, ``report`` (Markdown and PNG).

A strategy with a replica axis (hsdp) runs on ``jaxdp.registry.mesh_shape(name, N)`` on both
sides, the default a user gets. Nothing here imports jax or torch at module level: the simulated device count and XLA
flags must be set before jax starts, and torch ranks import ``torch_side`` to run.
"""

import os


def cuda_host() -> bool:
    return os.path.exists("/dev/nvidiactl") or bool(os.environ.get("CUDA_VISIBLE_DEVICES"))

