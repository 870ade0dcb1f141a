"""FLOPs per trained image, counted from the model itself: the one count MFU uses, in
``jaxdp train``'s records and in ``jaxdp bench``.

Model FLOPs, the MFU convention (PaLM, appendix B; MaxText's
``calculate_tflops_training_per_device``): 2 x the multiply-accumulates of every
convolution and matrix product in the forward pass, x 3 for forward and backward (the
backward computes two products per forward one: the input's gradient and the weight's).
Elementwise work (BatchNorm, activations, softmax, the optimizer) is left out, and so is
recomputation (remat): MFU counts the model's work, not the hardware's.

Counted on the forward pass's jaxpr, from shapes alone (no compile, no device), so any
Flax classifier counts, custom ones too. Not from the compiled step's ``cost_analysis()``:
on a GPU, XLA hands convolutions and matmuls to cuDNN/cuBLAS custom calls, which its cost
analysis counts as 0 FLOPs (``HloCostAnalysis::HandleCustomCall``); on a CPU it gives 2.93
GFLOP per ResNet-18 image against the 3.33 counted here (it also skips the taps that
fall on a convolution's zero padding, which the convention counts).
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax

from jaxdp.analysis.flops import forward_flops
from jaxdp.models import create_model

# forward + backward = 3 x forward: the backward's two products per forward product.
TRAIN_FACTOR = 3


def train_flops_per_image(model, *inputs, apply_kwargs: Optional[dict] = None) -> float:
    """Model FLOPs of training a Flax model on one example: ``inputs`` hold one example each
    (a leading axis of 1; arrays or ``jax.ShapeDtypeStruct``s), ``apply_kwargs`` what
    ``model.apply`` takes besides (None: ``train=False``, as jaxdp's models)."""
    kwargs = {"train": False} if apply_kwargs is None else apply_kwargs
    variables = jax.eval_shape(lambda *xs: model.init(jax.random.key(0), *xs, **kwargs), *inputs)
    return TRAIN_FACTOR * forward_flops(lambda v, *xs: model.apply(v, *xs, **kwargs), variables, *inputs)


def model_flops_per_image(name: str, image_shape: Sequence[int] = (32, 32, 3), **options) -> float:
    """``train_flops_per_image`` of ``jaxdp.models.create_model(name, **options)`` on one image."""
    model = create_model(name, **options)
    return train_flops_per_image(model, jax.ShapeDtypeStruct((1, *image_shape), model.dtype))


def mfu(images_per_s: Optional[float], flops_per_image: Optional[float], devices: int,
        peak_flops: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation: the model FLOP/s achieved over ``devices`` x the peak of one."""
    if not (images_per_s and flops_per_image and peak_flops):
        return None
    return images_per_s * flops_per_image / (devices * peak_flops)

