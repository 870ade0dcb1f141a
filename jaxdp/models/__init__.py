"""Model zoo: torchvision-layout ResNets with PyTorch BatchNorm semantics, and
timm-layout ViTs. Each family has a torch twin in torch_ref with the same names."""

import importlib
from typing import Optional, Sequence

import jax.numpy as jnp

from jaxdp import names
from jaxdp.models import vit
from jaxdp.models.batchnorm import BatchNorm
from jaxdp.models.errors import ModelError
from jaxdp.models.resnet import BasicBlock, Bottleneck, ResNet
from jaxdp.models.vit import EncoderBlock, ViT

# The model table is jaxdp.names (jax-free, shared with torch_ref): here its rows as this framework builds them.
BLOCKS = {"basic": BasicBlock, "bottleneck": Bottleneck}
ARCHITECTURES = {name: (BLOCKS[size["block"]], size["stages"]) for name, size in names.RESNET.models.items()}
VIT_ARCHITECTURES = vit.CONFIGS  # names.VIT.models itself
MODELS = names.MODELS
FAMILIES = {name: f.name for f in names.FAMILIES for name in f.models}
STEMS = names.STEMS
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float64": jnp.float64}


def family(name: str) -> str:
    """``"resnet"`` or ``"vit"`` for a model name from MODELS."""
    return names.family(name).name


def fsdp_units(model) -> tuple:
    """The module classes FSDP / ZeRO-3 shard as units in ``model`` (a model instance),
    read from the ``FSDP_UNITS`` beside the model's class, so strategies never name a model."""
    units = getattr(importlib.import_module(type(model).__module__), "FSDP_UNITS", None)
    if units is None:
        raise ModelError(f"{type(model).__name__} declares no FSDP_UNITS in {type(model).__module__}")
    return units


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
    build = _BUILDERS[names.check_options(name, given).name]
    return build(name, given, num_classes, *_dtypes(dtype))


def _dtypes(dtype: str):
    """(compute dtype, param dtype): params stay float32 under bfloat16 compute."""
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype], (jnp.float64 if dtype == "float64" else jnp.float32)


def _create_resnet(name, given, num_classes, compute, param_dtype) -> ResNet:
    block, stage_sizes = names.resnet_size(name, given["width"], given["blocks"], given["stem"])
    return ResNet(block=BLOCKS[block], stage_sizes=stage_sizes, width=given["width"], num_classes=num_classes,
                  stem=given["stem"], dtype=compute, param_dtype=param_dtype, bn_axis_name=given["bn_axis_name"])


def _create_vit(name, given, num_classes, compute, param_dtype) -> ViT:
    return ViT(num_classes=num_classes, dtype=compute, param_dtype=param_dtype, **names.vit_size(name, given))


_BUILDERS = {names.RESNET.name: _create_resnet, names.VIT.name: _create_vit}  # each family of jaxdp.names


__all__ = [
    "ARCHITECTURES", "DTYPES", "FAMILIES", "MODELS", "STEMS", "VIT_ARCHITECTURES", "BatchNorm",
    "EncoderBlock", "ModelError", "ResNet", "ViT", "create_model", "family", "fsdp_units",
]
