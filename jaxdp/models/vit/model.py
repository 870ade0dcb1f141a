"""Vision Transformer in Flax, laid out as timm's ``VisionTransformer`` (fused ``qkv``).

The variable tree mirrors the torch twin's ``state_dict`` (torch_ref/vit.py) one to
one: ``blocks.3.attn.qkv.weight`` is ``params/blocks/3/attn/qkv/kernel`` (see
``torch_names``). Pre-norm blocks, a class token read by the head, learned position
embeddings, no dropout. LayerNorm uses an explicit eps and the two-pass variance
E[(x - E[x])^2], as torch does; flax's default one-pass E[x^2] - E[x]^2 differs in
the last bits, which float64 parity would see.
"""

import flax.linen as nn
import jax.numpy as jnp

from jaxdp import names
# The building blocks live in layers.py (LAYER_NORM_EPS stays importable from here).
from jaxdp.models.vit.layers import (LAYER_NORM_EPS, Blocks, EncoderBlock, PatchEmbed, _Layers,  # noqa: F401
                                     pos_embed_init, with_tokens)
# tp_plan and summed_values are found here, beside the model's class, by jaxdp.parallel.tensor.
from jaxdp.models.vit.parallel import attention_splits, summed_values, tp_plan  # noqa: F401
from jaxdp.models.vit.pipeline import layers as pipeline_layers

CONFIGS = names.VIT.models  # each named ViT's size (the model table, jaxdp.names)


class ViT(_Layers):
    num_classes: int = 10
    image_size: int = 32
    patch: int = 4
    dim: int = 192
    depth: int = 12
    heads: int = 3
    mlp_dim: int = 768

    def check_model_split(self, size: int):
        """Why this ViT cannot run tensor-parallel over ``size`` devices, or None if it can."""
        if self.mlp_dim % size:
            return f"a ViT with MLP width {self.mlp_dim} cannot be split over model={size}: it must divide by it"
        return None

    def model_split_note(self, size: int):
        """What the user should know about this ViT's split over ``size`` devices, or None."""
        if attention_splits(self.heads, size):
            return None
        return (f"{self.heads} attention heads do not split over model={size}: attention stays whole on every "
                "model device, only the MLP is split")

    @nn.compact
    def __call__(self, x, train: bool = True):
        # Position embeddings are sized by the config, not by whatever image arrives.
        if x.shape[1:3] != (self.image_size, self.image_size):
            raise ValueError(f"ViT built for {self.image_size}x{self.image_size} images, got "
                             f"{x.shape[1]}x{x.shape[2]}")
        common = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        x = PatchEmbed(dim=self.dim, patch=self.patch, name="patch_embed", **common)(x.astype(self.dtype))
        tokens = 1 + (self.image_size // self.patch) ** 2
        cls = self.param("cls_token", nn.initializers.zeros, (1, 1, self.dim), self.param_dtype)
        pos = self.param("pos_embed", pos_embed_init, (1, tokens, self.dim), self.param_dtype)
        x = with_tokens(x, cls, pos, self.dtype)
        x = Blocks(depth=self.depth, dim=self.dim, heads=self.heads, mlp_dim=self.mlp_dim,
                   name="blocks", **self.common)(x, train)
        return self.classify(self.norm("norm"), self.dense(self.num_classes, self.dim, "head"), x)

    @nn.nowrap
    def classify(self, norm, head, x):
        """The class token's logits: ``norm`` and ``head`` are the final LayerNorm and Dense."""
        x = head(norm(x)[:, 0])
        # Logits leave the model in at least float32 so the loss is never bf16.
        return x.astype(jnp.promote_types(self.dtype, jnp.float32))

    @nn.nowrap
    def pipeline_layers(self):
        """The ordered layers pipeline stages cut (``jaxdp.parallel.pipeline``): ``pipeline.py`` beside this file."""
        return pipeline_layers(self)


# The module classes jaxdp's FSDP / ZeRO-3 treat as units (torch_ref fully_shards the same).
FSDP_UNITS = (EncoderBlock,)
