"""How a ViT splits over the ``model`` axis (Megatron, as torchtitan's ``parallelize.py`` for
its models): attention's fused ``qkv`` column-parallel by heads and ``proj`` row-parallel;
the MLP's ``fc1`` column-parallel and ``fc2`` row-parallel. Patch embedding, class token,
position embeddings, LayerNorms and the head stay whole on every model device.

When the heads do not divide by the model axis (vit-tiny's 3 over 2), attention stays whole
on every model device too and only the MLP is split (``tp_plan``): exact, no padding, the
checkpoint in its canonical shapes; attention's compute and memory are then repeated on each
model device.

The torch twin applies the same plan with ``parallelize_module`` (``torch_ref/tensor_parallel.py``).
"""

from jaxdp.parallel.tensor import Column, Row

ATTENTION_PLAN = {
    "params/blocks/*/attn/qkv/kernel": Column(groups=3),  # [q | k | v], each split by heads
    "params/blocks/*/attn/qkv/bias": Column(groups=3),
    "params/blocks/*/attn/proj/kernel": Row(),
}
MLP_PLAN = {
    "params/blocks/*/mlp/fc1/kernel": Column(),
    "params/blocks/*/mlp/fc1/bias": Column(),
    "params/blocks/*/mlp/fc2/kernel": Row(),
}
TP_PLAN = {**ATTENTION_PLAN, **MLP_PLAN}


def attention_splits(heads: int, size: int) -> bool:
    """Whether attention splits by heads over ``size`` model devices (else it stays whole)."""
    return heads % size == 0


def tp_plan(vit, size: int):
    """The plan for ``vit`` over ``size`` model devices: Megatron's, or the MLP's alone."""
    return TP_PLAN if attention_splits(vit.heads, size) else MLP_PLAN


def summed_values(vit, size: int, batch: int, image_size: int) -> tuple:
    """Activation values all-reduced over ``model`` in one step (``jaxdp inspect``'s formula):
    (forward, backward). B·T·d per row-parallel layer's output in forward, and as many for the
    gradient of its column-parallel partner's input in backward; two per block (attention,
    MLP), or one when attention stays whole."""
    tokens = 1 + (image_size // vit.patch) ** 2
    values = (2 if attention_splits(vit.heads, size) else 1) * vit.depth * batch * tokens * vit.dim
    return values, values
