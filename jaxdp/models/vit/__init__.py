"""ViT-Tiny/Small for 32x32 images, with the torch twin's names (torch_ref/vit.py).

``model`` is the Flax network, ``torch_names`` its state_dict key grammar (used by
``jaxdp.interop``). ``FSDP_UNITS`` names the module classes FSDP/ZeRO-3 shard as
units, so strategies need not know the model.
"""

from jaxdp.models.vit import torch_names
from jaxdp.models.vit.model import CONFIGS, FSDP_UNITS, LAYER_NORM_EPS, EncoderBlock, ViT

__all__ = ["CONFIGS", "FSDP_UNITS", "LAYER_NORM_EPS", "EncoderBlock", "ViT", "torch_names"]
