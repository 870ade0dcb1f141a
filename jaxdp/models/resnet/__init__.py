"""ResNet-18/34/50 with torchvision's architecture and names (torch_ref/models.py is the twin).

``model`` is the Flax network, ``parallel`` how it splits over the ``model`` axis (``TP_PLAN``),
``torch_names`` its state_dict key grammar (used by ``jaxdp.interop``). ``FSDP_UNITS`` names the
module classes FSDP/ZeRO-3 shard as units, so strategies need not know the model.
"""

from jaxdp.models.resnet import torch_names
from jaxdp.models.resnet.model import (FSDP_UNITS, TP_PLAN, BasicBlock, Bottleneck, Downsample, ResNet, Stage,
                                       conv_init, linear_bias_init, linear_kernel_init, summed_values)

__all__ = ["FSDP_UNITS", "TP_PLAN", "BasicBlock", "Bottleneck", "Downsample", "ResNet", "Stage", "conv_init",
           "linear_bias_init", "linear_kernel_init", "summed_values", "torch_names"]
