"""jaxdp.clip_by_global_norm against torch's clip_grad_norm_, float64, in every layout."""

import numpy as np
import pytest

from parity_tests.cases import SGD, assert_parity, config
from parity_tests.runner import run_parity

# Gradient clipping, torch's clip_grad_norm_ before each optimizer.step() against
# jaxdp.clip_by_global_norm first in the optax chain, in every layout the optimizer sees:
# whole gradients (ddp), ZeRO's chunks (padded at N = 3), HSDP replicated (2 x 1) and sharded
# (1 x 3). On FSDP2's DTensors clip_grad_norm_ takes the global norm. max_norm sits below every
# step's gradient norm (asserted), so every update is clipped.
CLIP_NORM = 0.1
CLIP = {f"{strategy}-n{n}": dict(strategy=strategy, devices=n, steps=2, clip_grad_norm=CLIP_NORM, **SGD)
        for strategy in ("ddp", "zero1", "zero2", "zero3", "hsdp") for n in (2, 3)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CLIP))
def test_clipped_gradients_float64(name):
    result = run_parity(config("float64", **CLIP[name]))
    assert_parity(result)
    for record in result.torch_records:  # the pre-clip norm: the clip acted at every step
        norm = np.sqrt(sum(float(np.sum(np.square(g))) for g in record["grads"].values()))
        assert norm > 2 * CLIP_NORM, norm
