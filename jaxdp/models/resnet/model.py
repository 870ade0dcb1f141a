"""ResNet-18/34/50 in Flax with torchvision's architecture and parameter names.

The variable tree mirrors torchvision's ``state_dict`` keys one to one, so
``layer2.0.downsample.1.running_var`` is ``batch_stats/layer2/0/downsample/1/var``
(``torch_names``; the layouts in ``jaxdp.interop``). Every convolution pads explicitly and symmetrically as
torch does: 'SAME' would pad stride-2 convolutions (0, 1) instead of (1, 1).
"""

import math
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxdp.models.batchnorm import BatchNorm
from jaxdp.models.resnet.parallel import TP_PLAN, summed_values  # noqa: F401 - found beside the model by jaxdp.parallel.tensor
from jaxdp.parallel.tensor import model_axis_size, summed_over

# torch's kaiming_normal_(mode="fan_out", nonlinearity="relu"): untruncated normal.
conv_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")
# torch nn.Linear default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias.
linear_kernel_init = nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


def linear_bias_init(fan_in):
    bound = 1.0 / math.sqrt(fan_in)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


class _Layers(nn.Module):
    """Shared conv/BN factories so every block pads and normalises identically.

    ``model_axis``: run channel-parallel over that mesh axis (inside ``shard_map``; see
    ``parallel.py``): each block's first convolution computes this device's slice of
    its channels and the second sums its partial output over the axis. None (the default,
    and always at init): the whole model.
    """

    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    bn_axis_name: Optional[str] = None
    model_axis: Optional[str] = None

    @property
    def split(self) -> int:
        """How many ways a block's inner channels are split (1: not split)."""
        return model_axis_size(self.model_axis)

    def conv(self, features, kernel, stride=1, name=None, row_parallel: bool = False):
        pad = kernel // 2
        summed = row_parallel and self.model_axis is not None
        return nn.Conv(
            features,
            (kernel, kernel),
            strides=(stride, stride),
            padding=((pad, pad), (pad, pad)),
            use_bias=False,
            kernel_init=conv_init,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
            conv_general_dilated=summed_over(self.model_axis, jax.lax.conv_general_dilated) if summed else None,
        )

    def bn(self, name=None):
        return BatchNorm(
            axis_name=self.bn_axis_name, dtype=self.dtype, param_dtype=self.param_dtype, name=name
        )


class Downsample(_Layers):
    """torchvision's ``downsample = Sequential(conv1x1, BatchNorm2d)``: names '0' and '1'."""

    features: int = 64
    stride: int = 1

    @nn.compact
    def __call__(self, x, train):
        x = self.conv(self.features, 1, self.stride, name="0")(x)
        return self.bn(name="1")(x, train)


class BasicBlock(_Layers):
    planes: int = 64
    stride: int = 1
    expansion = 1

    @nn.compact
    def __call__(self, x, train):
        identity = x
        y = self.conv(self.planes // self.split, 3, self.stride, name="conv1")(x)
        y = nn.relu(self.bn(name="bn1")(y, train))
        y = self.conv(self.planes, 3, name="conv2", row_parallel=True)(y)
        y = self.bn(name="bn2")(y, train)
        if self.stride != 1 or x.shape[-1] != self.planes:
            identity = self._downsample(x, train)
        return nn.relu(y + identity)

    def _downsample(self, x, train):
        return Downsample(
            features=self.planes * self.expansion, stride=self.stride, dtype=self.dtype,
            param_dtype=self.param_dtype, bn_axis_name=self.bn_axis_name, name="downsample",
        )(x, train)


class Bottleneck(BasicBlock):
    """torchvision v1.5 bottleneck: the stride sits on the 3x3 convolution."""

    expansion = 4

    @nn.compact
    def __call__(self, x, train):
        identity = x
        y = self.conv(self.planes // self.split, 1, name="conv1")(x)
        y = nn.relu(self.bn(name="bn1")(y, train))
        y = self.conv(self.planes, 3, self.stride, name="conv2", row_parallel=True)(y)
        y = nn.relu(self.bn(name="bn2")(y, train))
        y = self.conv(self.planes * 4, 1, name="conv3")(y)
        y = self.bn(name="bn3")(y, train)
        if self.stride != 1 or x.shape[-1] != self.planes * 4:
            identity = self._downsample(x, train)
        return nn.relu(y + identity)


class Stage(nn.Module):
    """torchvision's ``layerK``: a Sequential of blocks named '0', '1', ..."""

    block: Any
    planes: int
    num_blocks: int
    stride: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    bn_axis_name: Optional[str] = None
    model_axis: Optional[str] = None

    @nn.compact
    def __call__(self, x, train):
        for i in range(self.num_blocks):
            x = self.block(
                planes=self.planes, stride=self.stride if i == 0 else 1, dtype=self.dtype,
                param_dtype=self.param_dtype, bn_axis_name=self.bn_axis_name, model_axis=self.model_axis,
                name=str(i),
            )(x, train)
        return x


class ResNet(_Layers):
    block: Any = BasicBlock
    stage_sizes: Sequence[int] = (2, 2, 2, 2)
    width: int = 64
    num_classes: int = 10
    stem: str = "cifar"  # "cifar": 3x3/1 conv, no maxpool; "imagenet": 7x7/2 conv + maxpool

    def check_model_split(self, size: int):
        """Why this ResNet cannot run channel-parallel over ``size`` devices, or None if it can."""
        planes = [self.width * 2**i for i in range(len(self.stage_sizes))]
        if any(p % size for p in planes):
            return (f"a ResNet of width {self.width} cannot be split over model={size}: its blocks' inner "
                    f"channels ({', '.join(map(str, planes))}) must all divide by it")
        return None

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = x.astype(self.dtype)
        if self.stem == "imagenet":
            x = self.conv(self.width, 7, 2, name="conv1")(x)
        else:
            x = self.conv(self.width, 3, 1, name="conv1")(x)
        x = nn.relu(self.bn(name="bn1")(x, train))
        if self.stem == "imagenet":
            x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        for i, num_blocks in enumerate(self.stage_sizes):
            x = Stage(
                block=self.block, planes=self.width * 2**i, num_blocks=num_blocks,
                stride=1 if i == 0 else 2, dtype=self.dtype,
                param_dtype=self.param_dtype, bn_axis_name=self.bn_axis_name, model_axis=self.model_axis,
                name=f"layer{i + 1}",
            )(x, train)
        x = x.mean(axis=(1, 2))
        fan_in = x.shape[-1]
        x = nn.Dense(
            self.num_classes, kernel_init=linear_kernel_init, bias_init=linear_bias_init(fan_in),
            dtype=self.dtype, param_dtype=self.param_dtype, name="fc",
        )(x)
        # Logits leave the model in at least float32 so the loss is never bf16.
        return x.astype(jnp.promote_types(self.dtype, jnp.float32))


# The module classes jaxdp's FSDP / ZeRO-3 treat as units (torch_ref fully_shards the same).
FSDP_UNITS = (BasicBlock, Bottleneck)
