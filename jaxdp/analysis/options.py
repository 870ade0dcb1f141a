"""What ``jaxdp inspect`` compiles and reports: one declaration, read by the CLI (its flags have
these names), ``inspect_strategy`` (a built-in model) and ``Trainer.inspect`` (a user's own)."""

from dataclasses import dataclass
from typing import Optional, Sequence

from jaxdp.runtime.target import Target


@dataclass(frozen=True)
class InspectOptions:
    # -- what to measure, for any strategy: a built-in model's or a Trainer's -----------------------
    target: Optional[Target] = None  # compile for its GPUs, without them (jaxdp.runtime.target)
    compile: bool = True  # False: model-state bytes only (no compiled memory, no HLO)
    schedule: bool = False  # also the compiled step's collectives and kernels in execution order
    plot: Optional[str] = None  # with a target: draw the estimated step's two streams to this PNG
    seed: int = 0
    batch_per_device: Optional[int] = None  # rows per device (default: 1; a Trainer: its example batch's)
    # -- a built-in model (inspect_strategy; a Trainer brings its own model, optimizer and batch) ----
    model: str = "resnet18"
    width: int = 64
    blocks: Optional[Sequence[int]] = None
    stem: str = "cifar"
    vit: Optional[dict] = None  # a ViT's sizes: depth, dim, heads, mlp_dim, patch
    optimizer: str = "sgd"
    dtype: str = "float32"
    image_size: int = 32
    # -- the strategy's options and mesh (inspect_strategy; a Trainer has its own) ------------------
    options: Optional[dict] = None  # allreduce, compress, powersgd_rank, staleness, units, ...
    mesh_shape: Optional[Sequence[int]] = None  # hsdp's (replicas, shards)
    mesh: Optional[dict] = None  # named mesh sizes, e.g. {"data": 2, "model": 2}
