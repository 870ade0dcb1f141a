"""Every name a user picks, but a strategy's, in one table importable without jax or torch.

The strategies are rows of ``jaxdp.registry``; the other names live here, once: the models (by
family, with each family's own options), stems, dtypes, datasets, optimizers, schedules and the
gradient sync's options. ``jaxdp.models`` and ``torch_ref.models`` build what a model row says,
``jaxdp.config.choices`` offers these names on the command line (before jax starts), and the
parity harness reads a family's attributes where the two frameworks' checks differ by model.
What a name *does* is each framework's own code (``jaxdp.optim``'s optax chains, torch.optim);
the name, its options and their checks are here.

A model family (``Family``):

- ``models``: its model names, each with its size (ResNet: the block and the blocks per stage;
  ViT: width, depth, heads, MLP width and patch);
- ``options``: the ``create_model`` options it takes in both frameworks, with their defaults
  (None: the named size's); ``jax_options``: those only jaxdp's model takes (BatchNorm's axes);
  an option of another family is refused unless left at its default, so that a caller may pass
  a whole config (the trainer's width/blocks/stem) whatever the model;
- ``batchnorm``: it normalises with BatchNorm (running statistics; parity's bfloat16 bounds).

An optimizer (``Optimizer``): its name (torch.optim's semantics), the learning rate ``bench``,
``inspect`` and ``plan`` step with (they take no ``--lr``), and torch.optim's own default weight
decay (AdamW's 1e-2; what the model-parallel parity runs with).
"""

from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple


class ModelError(ValueError):
    """A model option the user chose does not exist (the same one line in both frameworks)."""


class ChoiceError(ValueError):
    """A name the user chose is not in its table (one line)."""


@dataclass(frozen=True)
class Family:
    name: str
    title: str  # as messages name it
    models: Mapping[str, Mapping[str, Any]]
    options: Mapping[str, Any]
    jax_options: Mapping[str, Any] = field(default_factory=dict)
    batchnorm: bool = False


RESNET = Family(
    "resnet", "ResNet", {
        "resnet18": {"block": "basic", "stages": (2, 2, 2, 2)},
        "resnet34": {"block": "basic", "stages": (3, 4, 6, 3)},
        "resnet50": {"block": "bottleneck", "stages": (3, 4, 6, 3)},
    },
    {"width": 64, "blocks": None, "stem": "cifar"}, jax_options={"bn_axis_name": None}, batchnorm=True)
# The options that override a named ViT's size (None keeps it); ``image_size`` (default 32) fixes
# its position embeddings.
VIT_SIZES = ("depth", "dim", "heads", "mlp_dim", "patch")
VIT = Family(
    "vit", "ViT", {
        "vit-tiny": dict(dim=192, depth=12, heads=3, mlp_dim=768, patch=4),
        "vit-small": dict(dim=384, depth=12, heads=6, mlp_dim=1536, patch=4),
    },
    {**dict.fromkeys(VIT_SIZES), "image_size": None})
FAMILIES: Tuple[Family, ...] = (RESNET, VIT)
MODELS = tuple(name for f in FAMILIES for name in f.models)
VIT_IMAGE_SIZE = 32  # a ViT's input side when image_size is None

STEMS = ("cifar", "imagenet")  # ResNet: 3x3/1 conv for 32x32 inputs, or torchvision's 7x7/2 conv + max-pool
DTYPES = ("float32", "bfloat16", "float64")  # bfloat16: bf16 compute on float32 params
DATASETS = ("synthetic", "cifar10", "digits")


@dataclass(frozen=True)
class Optimizer:
    name: str  # torch.optim's semantics
    default_lr: float  # bench, inspect and plan's (no --lr there)
    torch_weight_decay: float  # torch.optim's default


OPTIMIZER_TABLE: Tuple[Optimizer, ...] = (Optimizer("sgd", 0.1, 0.0), Optimizer("adam", 1e-3, 0.0),
                                          Optimizer("adamw", 1e-3, 1e-2))
OPTIMIZERS = tuple(o.name for o in OPTIMIZER_TABLE)

SCHEDULES = ("constant", "cosine", "multistep", "warmup_cosine")
ALLREDUCES = ("psum", "ring")  # how DDP's all-reduce sums: XLA's collective, or a ring of ppermutes
COMPRESSIONS = ("bf16", "fp16", "powersgd")  # torch's DDP communication hooks
REMATS = ("unit", "none")  # what an FSDP unit keeps for backward: its input (and recomputes), or its activations
REDUCE_DTYPES = ("float32", "bfloat16")  # what ZeRO-3 reduce-scatters gradients in (default: the params' dtype)
ACCUM_REDUCES = ("each", "once")  # ZeRO-3's reduce-scatter: each micro-batch, or once per update (unsharded sum)


def family(model: str) -> Family:
    """The family of a model name from MODELS (ModelError, one line, for another name)."""
    for f in FAMILIES:
        if model in f.models:
            return f
    raise ModelError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")


def optimizer(name: str) -> Optimizer:
    """The row of an optimizer name from OPTIMIZERS (ChoiceError, one line, for another name)."""
    for o in OPTIMIZER_TABLE:
        if o.name == name:
            return o
    raise ChoiceError(f"unknown optimizer {name!r}; valid choices: {', '.join(OPTIMIZERS)}")


def check_options(model: str, given: Mapping[str, Any]) -> Family:
    """``model``'s family, once no option of another family in ``given`` differs from its default."""
    own = family(model)
    for other in FAMILIES:
        for option, default in {**other.options, **other.jax_options}.items():
            if option in given and option not in own.options and option not in own.jax_options \
                    and given[option] != default:
                raise ModelError(f"{option}={given[option]!r} does not apply to {model}; "
                                 f"{own.title} options: {', '.join(own.options)}")
    return own


def resnet_size(model: str, width: int, blocks: Optional[Sequence[int]], stem: str) -> Tuple[str, Tuple[int, ...]]:
    """(block, blocks per stage) of a ResNet name with these options, or ModelError in one line."""
    if model not in RESNET.models:
        raise ModelError(f"unknown model {model!r}; choose one of {', '.join(RESNET.models)}")
    if stem not in STEMS:
        raise ModelError(f"unknown stem {stem!r}; choose one of {', '.join(STEMS)}")
    if width < 1:
        raise ModelError(f"width must be positive, got {width}")
    size = RESNET.models[model]
    if blocks is None:
        return size["block"], tuple(size["stages"])
    if len(blocks) != 4 or min(blocks) < 1:
        raise ModelError(f"blocks must be four positive counts, got {tuple(blocks)}")
    return size["block"], tuple(blocks)


def vit_size(model: str, given: Mapping[str, Any]) -> Dict[str, int]:
    """A ViT name's size with the ViT options in ``given`` over it (None keeps the named one),
    ``image_size`` included, or ModelError in one line."""
    config = {**VIT.models[model], "image_size": VIT_IMAGE_SIZE}
    config.update({k: _positive(k, given[k]) for k in VIT.options if given.get(k) is not None})
    if config["dim"] % config["heads"]:
        raise ModelError(f"dim {config['dim']} must be divisible by heads {config['heads']}")
    if config["image_size"] % config["patch"]:
        raise ModelError(f"image_size {config['image_size']} must be divisible by patch {config['patch']}")
    return config


def _positive(option: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelError(f"{option} must be a positive integer, got {value!r}")
    return value
