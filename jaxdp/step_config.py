"""What one training step is, named once for every config that describes one.

Three configs describe a step: ``jaxdp train``'s (``jaxdp.config.TrainConfig``), ``jaxdp
parity``'s (``parity_tests.config.ParityConfig``) and torch_ref's step API
(``torch_ref.step_api``, whose config is a ``StepConfig`` as a dict). The groups below are
what they share, with one name and one default each; a config extends the groups it uses
and may change a default (parity's tiny float64 model, say), never a name.

- ``StrategyOptions``: the strategy and its options (all three configs);
- ``ModelOptions``, ``OptimizerOptions``: the model, optimizer and schedule (parity, torch_ref;
  ``TrainConfig`` names its own, with training's defaults, and no ViT sizes);
- ``StepConfig``: a whole step, torch_ref's config.

Plain dataclasses: no jax, no torch (the CLI reads them before jax starts, torch ranks
before anything else).
"""

from dataclasses import dataclass
from typing import Optional, Tuple

from jaxdp import registry


@dataclass
class StrategyOptions:
    strategy: str = "ddp"
    accum_steps: int = 1  # micro-batches per update (torch: no_sync on all but the last)
    sync_bn: bool = False
    # Each strategy takes those of these its constructor names (jaxdp.strategies.options_of,
    # torch_ref.strategies.STRATEGY_OPTIONS); the others must stay at their defaults.
    bucket_cap_mb: Optional[float] = registry.BUCKET_CAP_MB  # ddp: gradient bucket size (None: torch's)
    allreduce: str = "psum"  # ddp: "psum" | "ring" (reduce-scatter + all-gather by ppermute)
    compress: Optional[str] = None  # ddp, zero1: None | "bf16" | "fp16" | "powersgd"
    powersgd_rank: int = 1
    powersgd_start_iter: int = 1000  # plain all-reduce for the first steps (torch's start_powerSGD_iter)
    staleness: int = 0  # async parameter server: max updates a worker's weights may lag
    mesh_shape: Optional[Tuple[int, int]] = None  # hsdp: (replicas, shards)
    remat: str = "unit"  # zero3, hsdp: what an FSDP unit keeps for backward ("unit": its input; "none": activations)

    # (class attributes, not fields: no annotation, so __dataclass_fields__ lists only options)
    STRATEGY_OPTIONS = (
        "bucket_cap_mb", "allreduce", "compress", "powersgd_rank", "powersgd_start_iter", "staleness", "mesh_shape",
        "remat")


@dataclass
class ModelOptions:
    model: str = "resnet18"
    width: int = 64  # ResNet: channels of the first stage (64 = torchvision)
    blocks: Optional[Tuple[int, ...]] = None  # ResNet: blocks per stage (None: the named depth's)
    stem: str = "cifar"
    # ViT sizes (None: the named model's)
    depth: Optional[int] = None
    dim: Optional[int] = None
    heads: Optional[int] = None
    mlp_dim: Optional[int] = None
    patch: Optional[int] = None
    num_classes: int = 10
    dtype: str = "float32"  # bfloat16: bf16 compute, float32 params

    RESNET_OPTIONS = ("width", "blocks", "stem")
    VIT_OPTIONS = ("depth", "dim", "heads", "mlp_dim", "patch")


@dataclass
class OptimizerOptions:
    optimizer: str = "sgd"  # torch.optim's semantics (jaxdp.optim)
    lr: float = 0.1  # peak learning rate
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad_norm: Optional[float] = None  # max global gradient norm (torch.nn.utils.clip_grad_norm_)
    schedule: str = "constant"
    warmup_steps: int = 0


@dataclass
class StepConfig(OptimizerOptions, ModelOptions, StrategyOptions):
    """torch_ref's step (``torch_ref.step_api.build``): the groups above, plus what sizes the
    schedule and the ViT's position embeddings."""

    image_size: Optional[int] = None  # ViT: input side (None: 32)
    total_steps: int = 1  # the schedule's length in updates
    milestones: Tuple[int, ...] = ()  # multistep: updates at which lr *= gamma
    gamma: float = 0.1
    seed: int = 0
