"""Model zoo: torchvision-layout ResNets with PyTorch BatchNorm semantics."""

from typing import Optional, Sequence

import jax.numpy as jnp

from jaxdp.models.batchnorm import BatchNorm
from jaxdp.models.resnet import BasicBlock, Bottleneck, ResNet

ARCHITECTURES = {
    "resnet18": (BasicBlock, (2, 2, 2, 2)),
    "resnet34": (BasicBlock, (3, 4, 6, 3)),
    "resnet50": (Bottleneck, (3, 4, 6, 3)),
}
MODELS = tuple(ARCHITECTURES)
STEMS = ("cifar", "imagenet")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float64": jnp.float64}


class ModelError(ValueError):
    """A model option the user chose does not exist."""


def create_model(
    name: str = "resnet18",
    *,
    num_classes: int = 10,
    width: int = 64,
    blocks: Optional[Sequence[int]] = None,
    stem: str = "cifar",
    dtype: str = "float32",
    bn_axis_name: Optional[str] = None,
) -> ResNet:
    """Build a ResNet. ``width`` is the first stage's channels (64 in torchvision);
    ``blocks`` overrides the blocks per stage for tiny test variants.

    ``dtype='bfloat16'`` computes in bfloat16 with float32 params and BN statistics.
    """
    if name not in ARCHITECTURES:
        raise ModelError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    if stem not in STEMS:
        raise ModelError(f"unknown stem {stem!r}; choose one of {', '.join(STEMS)}")
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if width < 1:
        raise ModelError(f"width must be positive, got {width}")
    block, stage_sizes = ARCHITECTURES[name]
    if blocks is not None:
        if len(blocks) != 4 or min(blocks) < 1:
            raise ModelError(f"blocks must be four positive counts, got {tuple(blocks)}")
        stage_sizes = tuple(blocks)
    compute = DTYPES[dtype]
    param_dtype = jnp.float64 if dtype == "float64" else jnp.float32
    return ResNet(
        block=block, stage_sizes=tuple(stage_sizes), width=width, num_classes=num_classes,
        stem=stem, dtype=compute, param_dtype=param_dtype, bn_axis_name=bn_axis_name,
    )


__all__ = ["ARCHITECTURES", "MODELS", "STEMS", "DTYPES", "BatchNorm", "ModelError", "ResNet", "create_model"]
