"""The ViT's building blocks (timm's layout): attention with a fused ``qkv``, the MLP, the
pre-norm encoder block, the patch embedding, and the class token + position embeddings.

``model.py`` assembles them into the ViT; ``pipeline.py`` applies them one layer at a time.
"""

import math
from typing import Any, Optional

import flax.linen as nn
import jax.numpy as jnp

from jaxdp.models.resnet import linear_bias_init, linear_kernel_init
from jaxdp.models.vit.parallel import attention_splits
from jaxdp.parallel.tensor import model_axis_size, summed_over

# timm and torchvision ViTs use 1e-6 (torch's nn.LayerNorm default is 1e-5); the
# torch twin passes the same value.
LAYER_NORM_EPS = 1e-6

# torchvision's init for the two bare tensors; every Linear, Conv and LayerNorm
# keeps torch's layer default (resnet.linear_*_init is U(+-1/sqrt(fan_in))).
pos_embed_init = nn.initializers.normal(0.02)


def _accumulate(dtype):
    """Softmax and attention logits run in at least float32 (float64 stays float64)."""
    return jnp.promote_types(dtype, jnp.float32)


class _Layers(nn.Module):
    """Dense and LayerNorm factories shared by every part, so they init and compute alike.

    ``model_axis``: run tensor-parallel over that mesh axis (inside ``shard_map``; see
    ``parallel.py`` beside this file): attention heads and MLP features are split, each
    device holding its slice of every split layer, and a row-parallel layer's output is
    summed over the axis. None (the default, and always at init): the whole model.
    """

    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    model_axis: Optional[str] = None

    @nn.nowrap  # a factory, also called outside the module (the pipeline plan)
    def dense(self, features, fan_in, name, row_parallel: bool = False):
        summed = row_parallel and self.model_axis is not None
        return nn.Dense(
            features, kernel_init=linear_kernel_init, bias_init=linear_bias_init(fan_in),
            dtype=self.dtype, param_dtype=self.param_dtype, name=name,
            dot_general=summed_over(self.model_axis) if summed else None,
        )

    @property
    def split(self) -> int:
        """How many ways this layer's heads / hidden features are split (1: not split)."""
        return model_axis_size(self.model_axis)

    @property
    def common(self):
        return dict(dtype=self.dtype, param_dtype=self.param_dtype, model_axis=self.model_axis)

    @nn.nowrap  # a factory, also called outside the module (the pipeline plan)
    def norm(self, name):
        return nn.LayerNorm(
            epsilon=LAYER_NORM_EPS, use_fast_variance=False, dtype=self.dtype,
            param_dtype=self.param_dtype, name=name,
        )


class Attention(_Layers):
    """Multi-head self-attention with one fused ``qkv`` projection.

    The qkv output splits as torch's ``reshape(B, N, 3, heads, head_dim)``: features
    [0, dim) are q, then k, then v, each head a contiguous ``head_dim`` slice.
    """

    dim: int = 192
    heads: int = 3

    @nn.compact
    def __call__(self, x):
        b, n, _ = x.shape
        head_dim = self.dim // self.heads
        heads = self.heads // self.split  # this device's heads (all of them unless split)
        qkv = self.dense(3 * heads * head_dim, self.dim, "qkv")(x).reshape(b, n, 3, heads, head_dim)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        acc = _accumulate(self.dtype)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=acc)
        weights = nn.softmax(logits * (1.0 / math.sqrt(head_dim)), axis=-1).astype(self.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, n, heads * head_dim)
        return self.dense(self.dim, self.dim, "proj", row_parallel=True)(out)


class Mlp(_Layers):
    """fc1 -> exact (erf) GELU -> fc2, as torch's ``nn.GELU()``; flax defaults to tanh."""

    dim: int = 192
    mlp_dim: int = 768

    @nn.compact
    def __call__(self, x):
        x = nn.gelu(self.dense(self.mlp_dim // self.split, self.dim, "fc1")(x), approximate=False)
        return self.dense(self.dim, self.mlp_dim, "fc2", row_parallel=True)(x)


class EncoderBlock(_Layers):
    """One pre-norm transformer block: the unit FSDP / ZeRO-3 shards and gathers.

    ``train`` is accepted so every FSDP unit (ResNet blocks too) has one call
    signature; with no dropout it changes nothing.
    """

    dim: int = 192
    heads: int = 3
    mlp_dim: int = 768

    @nn.compact
    def __call__(self, x, train: bool = True):
        # Heads that do not divide by the model axis: attention runs whole on every model device.
        attn_axis = self.model_axis if attention_splits(self.heads, self.split) else None
        x = x + Attention(dim=self.dim, heads=self.heads, name="attn", **{**self.common, "model_axis": attn_axis})(
            self.norm("norm1")(x))
        return x + Mlp(dim=self.dim, mlp_dim=self.mlp_dim, name="mlp", **self.common)(self.norm("norm2")(x))


class Blocks(nn.Module):
    """torch's ``blocks = nn.Sequential(...)``: EncoderBlocks named '0', '1', ..."""

    depth: int
    dim: int
    heads: int
    mlp_dim: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    model_axis: Optional[str] = None

    @nn.compact
    def __call__(self, x, train):
        for i in range(self.depth):
            x = EncoderBlock(
                dim=self.dim, heads=self.heads, mlp_dim=self.mlp_dim, dtype=self.dtype,
                param_dtype=self.param_dtype, model_axis=self.model_axis, name=str(i),
            )(x, train)
        return x


class PatchEmbed(nn.Module):
    """timm's ``patch_embed.proj``: a patch x patch convolution with stride patch,
    i.e. one Linear per non-overlapping patch; tokens in row-major patch order."""

    dim: int
    patch: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        p = self.patch
        fan_in = p * p * x.shape[-1]
        x = nn.Conv(
            self.dim, (p, p), strides=(p, p), padding="VALID", kernel_init=linear_kernel_init,
            bias_init=linear_bias_init(fan_in), dtype=self.dtype, param_dtype=self.param_dtype,
            name="proj",
        )(x)
        return x.reshape(x.shape[0], -1, self.dim)



def with_tokens(patches, cls, pos, dtype):
    """The class token prepended to the patch tokens, plus the position embeddings."""
    cls = jnp.broadcast_to(cls.astype(dtype), (patches.shape[0], 1, cls.shape[-1]))
    return jnp.concatenate([cls, patches], axis=1) + pos.astype(dtype)
