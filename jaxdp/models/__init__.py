"""Model zoo: torchvision-layout ResNets with PyTorch BatchNorm semantics, and
timm-layout ViTs. Each family has a torch twin in torch_ref with the same names."""

import importlib
from typing import Optional, Sequence

import jax.numpy as jnp

from jaxdp.models import vit
from jaxdp.models.batchnorm import BatchNorm
from jaxdp.models.errors import ModelError
from jaxdp.models.resnet import BasicBlock, Bottleneck, ResNet
from jaxdp.models.vit import EncoderBlock, ViT

ARCHITECTURES = {
    "resnet18": (BasicBlock, (2, 2, 2, 2)),
    "resnet34": (BasicBlock, (3, 4, 6, 3)),
    "resnet50": (Bottleneck, (3, 4, 6, 3)),
}
VIT_ARCHITECTURES = vit.CONFIGS
MODELS = tuple(ARCHITECTURES) + tuple(VIT_ARCHITECTURES)
FAMILIES = {**{n: "resnet" for n in ARCHITECTURES}, **{n: "vit" for n in VIT_ARCHITECTURES}}
STEMS = ("cifar", "imagenet")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float64": jnp.float64}

# Each family's own options with their defaults. An option of the other family is
# refused unless left at its default, so a caller may pass a full config (the
# trainer's width/blocks/stem) whatever the model.
_RESNET_OPTIONS = {"width": 64, "blocks": None, "stem": "cifar", "bn_axis_name": None}
_VIT_OPTIONS = ("depth", "dim", "heads", "mlp_dim", "patch", "image_size")


def family(name: str) -> str:
    """``"resnet"`` or ``"vit"`` for a model name from MODELS."""
    if name not in FAMILIES:
        raise ModelError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return FAMILIES[name]


def fsdp_units(model) -> tuple:
    """The module classes FSDP / ZeRO-3 shard as units in ``model`` (a model instance),
    read from the ``FSDP_UNITS`` beside the model's class, so strategies never name a model."""
    units = getattr(importlib.import_module(type(model).__module__), "FSDP_UNITS", None)
    if units is None:
        raise ModelError(f"{type(model).__name__} declares no FSDP_UNITS in {type(model).__module__}")
    return units


def _positive(option: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelError(f"{option} must be a positive integer, got {value!r}")
    return value


def create_model(
    name: str = "resnet18",
    *,
    num_classes: int = 10,
    width: int = 64,
    blocks: Optional[Sequence[int]] = None,
    stem: str = "cifar",
    dtype: str = "float32",
    bn_axis_name: Optional[str] = None,
    depth: Optional[int] = None,
    dim: Optional[int] = None,
    heads: Optional[int] = None,
    mlp_dim: Optional[int] = None,
    patch: Optional[int] = None,
    image_size: Optional[int] = None,
):
    """Build a ResNet or a ViT.

    ResNet: ``width`` is the first stage's channels (64 in torchvision); ``blocks``
    overrides the blocks per stage for tiny test variants.
    ViT: ``depth``/``dim``/``heads``/``mlp_dim``/``patch`` override the named size
    (None keeps it), ``image_size`` (default 32) fixes the position embeddings.

    ``dtype='bfloat16'`` computes in bfloat16 with float32 params (and BN statistics).
    """
    given = dict(width=width, blocks=blocks, stem=stem, bn_axis_name=bn_axis_name, depth=depth,
                 dim=dim, heads=heads, mlp_dim=mlp_dim, patch=patch, image_size=image_size)
    if family(name) == "vit":
        return _create_vit(name, given, num_classes, dtype)
    for option in _VIT_OPTIONS:
        if given[option] is not None:
            raise ModelError(f"{option}={given[option]!r} does not apply to {name}; "
                             f"ResNet options: width, blocks, stem")
    if stem not in STEMS:
        raise ModelError(f"unknown stem {stem!r}; choose one of {', '.join(STEMS)}")
    compute, param_dtype = _dtypes(dtype)
    if width < 1:
        raise ModelError(f"width must be positive, got {width}")
    block, stage_sizes = ARCHITECTURES[name]
    if blocks is not None:
        if len(blocks) != 4 or min(blocks) < 1:
            raise ModelError(f"blocks must be four positive counts, got {tuple(blocks)}")
        stage_sizes = tuple(blocks)
    return ResNet(
        block=block, stage_sizes=tuple(stage_sizes), width=width, num_classes=num_classes,
        stem=stem, dtype=compute, param_dtype=param_dtype, bn_axis_name=bn_axis_name,
    )


def _dtypes(dtype: str):
    """(compute dtype, param dtype): params stay float32 under bfloat16 compute."""
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype], (jnp.float64 if dtype == "float64" else jnp.float32)


def _create_vit(name, given, num_classes, dtype) -> ViT:
    for option, default in _RESNET_OPTIONS.items():
        if given[option] != default:
            raise ModelError(f"{option}={given[option]!r} does not apply to {name}; "
                             f"ViT options: {', '.join(_VIT_OPTIONS)}")
    compute, param_dtype = _dtypes(dtype)
    config = {**VIT_ARCHITECTURES[name], "image_size": 32}
    config.update({k: _positive(k, given[k]) for k in _VIT_OPTIONS if given[k] is not None})
    if config["dim"] % config["heads"]:
        raise ModelError(f"dim {config['dim']} must be divisible by heads {config['heads']}")
    if config["image_size"] % config["patch"]:
        raise ModelError(f"image_size {config['image_size']} must be divisible by patch {config['patch']}")
    return ViT(num_classes=num_classes, dtype=compute, param_dtype=param_dtype, **config)


__all__ = [
    "ARCHITECTURES", "DTYPES", "FAMILIES", "MODELS", "STEMS", "VIT_ARCHITECTURES", "BatchNorm",
    "EncoderBlock", "ModelError", "ResNet", "ViT", "create_model", "family", "fsdp_units",
]
