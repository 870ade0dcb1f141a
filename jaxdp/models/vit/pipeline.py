"""How a ViT cuts into pipeline stages (``jaxdp.parallel.pipeline``): its ordered layers.

    embed      patch_embed, cls_token, pos_embed   images -> tokens
    blocks_i   blocks/i                            tokens -> tokens (one per encoder block)
    head       norm, head                          tokens -> logits (the class token's)

Each layer applies the same Flax modules the ViT builds (``layers.py``), on its own params.
The torch twin cuts the same layers (``torch_ref/pipeline.py``).
"""


from jaxdp.models.vit.layers import EncoderBlock, PatchEmbed, with_tokens
from jaxdp.parallel.pipeline import Layer


def layers(vit):
    common = dict(dtype=vit.dtype, param_dtype=vit.param_dtype)
    patches = PatchEmbed(dim=vit.dim, patch=vit.patch, **common)
    block = EncoderBlock(dim=vit.dim, heads=vit.heads, mlp_dim=vit.mlp_dim, **common)
    norm, head = vit.norm(None), vit.dense(vit.num_classes, vit.dim, None)

    def embed(params, images):
        patch_params, cls, pos = params
        return with_tokens(patches.apply({"params": patch_params}, images.astype(vit.dtype)), cls, pos, vit.dtype)

    def encode(params, tokens):
        return block.apply({"params": params[0]}, tokens)

    def classify(params, tokens):
        norm_params, head_params = params
        return vit.classify(lambda x: norm.apply({"params": norm_params}, x),
                            lambda x: head.apply({"params": head_params}, x), tokens)

    return ([Layer("embed", (("patch_embed",), ("cls_token",), ("pos_embed",)), embed)]
            + [Layer(f"blocks_{i}", (("blocks", str(i)),), encode) for i in range(vit.depth)]
            + [Layer("head", (("norm",), ("head",)), classify)])



