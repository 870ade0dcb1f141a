"""Vision Transformer in plain PyTorch, in timm's ``VisionTransformer`` layout.

The reference side of jaxdp's ViT (jaxdp/models/vit): the same blocks and the same
``state_dict`` keys (``blocks.0.attn.qkv.weight``, ...), so weights move both ways
through ``jaxdp.interop``. Pre-norm blocks, a class token read by the head, learned
position embeddings, no dropout; q, k, v come from one fused ``qkv`` Linear, split
as ``reshape(B, N, 3, heads, head_dim)``. timm itself is not a dependency.

Init is torch's layer defaults (Linear and Conv2d U(+-1/sqrt(fan_in)), LayerNorm 1/0)
plus torchvision's for the two bare tensors (class token 0, position embeddings
N(0, 0.02)); jaxdp draws from the same distributions.
"""

import torch
import torch.nn.functional as F
from torch import nn

from jaxdp import names

# timm and torchvision use 1e-6 (nn.LayerNorm's default is 1e-5); jaxdp uses the same.
LAYER_NORM_EPS = 1e-6

CONFIGS = names.VIT.models  # each named ViT's size (the model table, jaxdp.names)


class PatchEmbed(nn.Module):
    """A patch x patch convolution with stride patch; tokens in row-major patch order."""

    def __init__(self, patch: int, dim: int, in_chans: int = 3):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, dim, patch, stride=patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, dim, h, w) -> (B, h*w, dim)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads  # this rank's heads: tensor parallelism lowers it (torch_ref/tensor_parallel.py)
        self.head_dim = dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # each (B, heads, N, head_dim)
        x = F.scaled_dot_product_attention(q, k, v)  # softmax(q k^T / sqrt(head_dim)) v
        return self.proj(x.transpose(1, 2).reshape(b, n, self.heads * self.head_dim))


class Mlp(nn.Module):
    def __init__(self, dim: int, mlp_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, mlp_dim)
        self.act = nn.GELU()  # exact erf, as jaxdp's gelu(approximate=False)
        self.fc2 = nn.Linear(mlp_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderBlock(nn.Module):
    """One pre-norm transformer block: what FSDP2 ``fully_shard``s as a unit."""

    def __init__(self, dim: int, heads: int, mlp_dim: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.mlp = Mlp(dim, mlp_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(self, num_classes: int = 10, image_size: int = 32, patch: int = 4, dim: int = 192,
                 depth: int = 12, heads: int = 3, mlp_dim: int = 768):
        super().__init__()
        tokens = 1 + (image_size // patch) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.empty(1, tokens, dim).normal_(std=0.02))
        self.patch_embed = PatchEmbed(patch, dim)
        self.blocks = nn.Sequential(*[EncoderBlock(dim, heads, mlp_dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classify(self.blocks(self.embed(x)))

    # The first and last pipeline layers (torch_ref/pipeline.py's stages call them too).
    def embed(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        return torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed

    def classify(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x)[:, 0])


# The module classes torch_ref.strategies fully_shards as FSDP units.
FSDP_UNITS = (EncoderBlock,)
