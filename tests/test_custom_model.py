"""examples/custom_model.py: a user's own BN-free transformer LM with a dict batch trains
with ZeRO-3 (units = its own Block class) and follows DDP's loss sequence."""

import importlib.util
import os

import numpy as np
import pytest

import jaxdp
from helpers import compiles_of, jax_compile_log

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "custom_model.py")


def _load():
    spec = importlib.util.spec_from_file_location("custom_model", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_custom_model_trains_with_zero3_as_with_ddp():
    example = _load()
    log = []
    with jax_compile_log(log):
        zero3 = example.train(jaxdp.ZeRO(stage=3, units=(example.Block,)), steps=12)
        ddp = example.train(jaxdp.DDP(), steps=12)
    # Trainer.init places the whole state where the step leaves it, so 12 steps are one program:
    # an unplaced step counter made the second step compile everything again.
    assert compiles_of(log, "local_step") == 2, [line for line in log if "compilation" in line]
    assert zero3[-1] < 0.5 * zero3[0]  # it learns
    # The same math in another layout: float32 rounding apart, step by step.
    np.testing.assert_allclose(zero3, ddp, rtol=2e-5, atol=1e-6)
