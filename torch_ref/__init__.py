"""torch_ref: the PyTorch reference that jaxdp is compared against, step by step.

It shares only the numpy data pipeline and the weight conversion
(``jaxdp.interop``) with jaxdp; everything else is ordinary PyTorch.
"""

from torch_ref.models import MODELS, STEMS, ResNet, resnet

__all__ = ["MODELS", "STEMS", "ResNet", "resnet"]
