"""How a ViT splits over the ``model`` axis (Megatron, as torchtitan's ``parallelize.py`` for
its models): attention's fused ``qkv`` column-parallel by heads and ``proj`` row-parallel;
the MLP's ``fc1`` column-parallel and ``fc2`` row-parallel. Patch embedding, class token,
position embeddings, LayerNorms and the head stay whole on every model device.

The torch twin applies the same plan with ``parallelize_module`` (``torch_ref/tensor_parallel.py``).
"""

from jaxdp.parallel.tensor import Column, Row

TP_PLAN = {
    "params/blocks/*/attn/qkv/kernel": Column(groups=3),  # [q | k | v], each split by heads
    "params/blocks/*/attn/qkv/bias": Column(groups=3),
    "params/blocks/*/attn/proj/kernel": Row(),
    "params/blocks/*/mlp/fc1/kernel": Column(),
    "params/blocks/*/mlp/fc1/bias": Column(),
    "params/blocks/*/mlp/fc2/kernel": Row(),
}
