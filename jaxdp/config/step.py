"""What one training step is, named once for every config that describes one.

Three configs describe a step: ``jaxdp train``'s (``jaxdp.config.tree.TrainConfig``), ``jaxdp
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

from jaxdp import names, registry
from jaxdp.config import choices
from jaxdp.config.fields import declared, option


@dataclass
class StrategyOptions:
    """The strategy and its options: a section of ``jaxdp train``'s tree (``jaxdp.config.tree``),
    of parity's and of torch_ref's step. A strategy is built with them typed (``jaxdp train``
    hands its parsed config to the strategy's class: ``jaxdp.strategies.options``, which checks
    them in one place); each strategy takes the options its facts list (``Facts.takes``,
    ``jaxdp.strategies.options_of``; its torch twin's ``torch_ref.strategies.Twin.options``),
    and the others must stay at their defaults. Their metadata say how ``jaxdp parity`` pairs
    them and whether ``jaxdp inspect`` takes them (``options_where``)."""

    strategy: str = option("ddp", "data-parallel strategy", numbers=False, choices=choices.STRATEGIES)
    accum_steps: int = option(1, "micro-batches per update (torch no_sync)", numbers=True, at_least=1)
    sync_bn: bool = option(False, "global BatchNorm statistics (SyncBatchNorm)", numbers=True)
    bucket_cap_mb: Optional[float] = option(
        registry.BUCKET_CAP_MB, "ddp gradient bucket size in MiB (inf: one bucket; default: torch's, a 1 MiB first "
        "bucket, then 25)", numbers=False, strategy_option=True, parity="paired")
    # How jaxdp sums: gloo and nccl pick their own algorithm, so any value runs against the same twin.
    allreduce: str = option("psum", "ddp, zero1: psum, or ring (reduce-scatter + all-gather written out)",
                            numbers=True, choices=choices.ALLREDUCES, strategy_option=True, parity="jax-only",
                            inspect=True)
    compress: Optional[str] = option(None, "ddp/zero1 gradient compression (default: none)", numbers=True,
                                     choices=choices.COMPRESSIONS, strategy_option=True, parity="paired", inspect=True)
    powersgd_rank: int = option(1, "powersgd: rank of P and Q", numbers=True, strategy_option=True, parity="paired",
                                inspect=True)
    # Not a pair option of its own: it rides with --compress powersgd (parity hands it to both sides).
    powersgd_start_iter: int = option(
        1000, "powersgd: plain all-reduce for the first N steps (torch's start_powerSGD_iter; >= 2)", numbers=True,
        strategy_option=True)
    # async's bound: torch has no bounded-staleness parameter server; staleness 0 runs against DDP.
    staleness: int = option(0, "async: max staleness k of worker weights", numbers=True, strategy_option=True,
                            at_least=0, parity="jax-only", inspect=True)
    mesh_shape: Optional[Tuple[int, int]] = option(None, "hsdp: replicas,shards", numbers=False,
                                                   strategy_option=True, parity="paired", inspect=True)
    # What ZeRO-3 keeps for backward: FSDP2 keeps the activations, and recomputing them changes no number.
    remat: str = option("unit", "zero3, hsdp: unit = keep each unit's input and recompute it in backward (least "
                                "memory); none = keep its activations, gather its params again (FSDP2's default)",
                        numbers=False, choices=choices.REMATS, strategy_option=True, parity="jax-only", inspect=True,
                        hint=" (what an FSDP unit keeps for backward)")
    # FSDP2's MixedPrecisionPolicy(reduce_dtype=...): both sides take it.
    reduce_dtype: Optional[str] = option(
        None, "zero3, hsdp: the dtype gradients are reduce-scattered (and all-reduced across replicas) in "
              "(default: the params' own, float32 under --dtype bfloat16; bfloat16 halves the bytes)",
        numbers=True, choices=choices.REDUCE_DTYPES, strategy_option=True, parity="paired", inspect=True)
    # FSDP2's set_requires_gradient_sync(False) until the last micro-batch, which torch_ref's twin always does.
    accum_reduce: str = option(
        "each", "zero3, hsdp with --accum-steps K: each = reduce-scatter every micro-batch (gradients stay "
                "sharded); once = sum the unsharded gradients (4 bytes per param more per device) and "
                "reduce-scatter once per update", numbers=True, choices=choices.ACCUM_REDUCES,
        strategy_option=True, parity="jax-only", inspect=True, hint=" (when ZeRO-3 reduce-scatters under accumulation)")

    # (a class attribute, not a field: the options a strategy may take, beside strategy, accum_steps, sync_bn)
    STRATEGY_OPTIONS = ()


StrategyOptions.STRATEGY_OPTIONS = tuple(f.name for f in declared(StrategyOptions) if f.metadata["strategy_option"])


def options_where(**metadata) -> Tuple[str, ...]:
    """The strategy options whose field metadata have these values, in declaration order:
    ``options_where(inspect=True)``, ``options_where(parity="jax-only")``."""
    return tuple(f.name for f in declared(StrategyOptions) if f.metadata["strategy_option"]
                 and all(f.metadata[k] == v for k, v in metadata.items()))


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

    RESNET_OPTIONS = tuple(names.RESNET.options)
    VIT_OPTIONS = names.VIT_SIZES


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
