"""Channel-parallel ResNet blocks on the ``model`` axis (``jaxdp/models/resnet/parallel.py``)
beside ddp and ZeRO-3 on ``data``.

With SyncBatchNorm the statistics are the global batch's whatever the mesh, so data=2 x
model=2 must train exactly as the whole model and batch on one device: losses, averaged
gradients, params, BN running statistics and the optimizer state, every step (float64).
Without it each data rank normalises with its own rows, so the reference is the same
strategy on data=2 alone: the model axis must change nothing.
"""

import jax
import numpy as np
import optax
import pytest

from helpers import as_batch, canonical_history, max_rel_error, numpy_init, random_batch, step_collectives_by_axis, tiny_resnet
from jaxdp.runtime.mesh import make_mesh
from jaxdp.models import create_model
from jaxdp.models.resnet import BasicBlock
from jaxdp.strategies import StrategyError, create_strategy
from jaxdp.loss.task import classifier

STEPS = 3
LR = 0.05
OPTIONS = {"ddp": {}, "zero3": {"units": (BasicBlock,)}}


def batches(steps=STEPS, n=8):
    return [as_batch(*random_batch(n, seed=s)) for s in range(steps)]


def train(name, mesh, variables, sync_bn, model=None):
    """Every step's (loss, canonical grads) and the final canonical state."""
    model = model or tiny_resnet()
    strategy = create_strategy(name, model, classifier(model), optax.sgd(LR, momentum=0.9), mesh,
                               return_grads=True, sync_bn=sync_bn, **OPTIONS[name])
    return canonical_history(strategy, variables, batches())


@pytest.fixture(scope="module")
def variables():
    with jax.enable_x64(True):  # module fixtures are built before conftest's per-test x64 switch
        return numpy_init(tiny_resnet())


@pytest.fixture(scope="module")
def references(variables):
    """Computed once per module: the whole model on one device, and ddp on data=2 alone."""
    with jax.enable_x64(True):
        return {"one device": train("ddp", make_mesh(data=1), variables, sync_bn=False),
                "data=2": train("ddp", make_mesh(data=2), variables, sync_bn=False)}


def assert_same_training(got, want):
    (history, state), (ref_history, ref_state) = got, want
    for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(history, ref_history)):
        assert abs(loss - ref_loss) <= 1e-13 * abs(ref_loss), (step, loss, ref_loss)
        assert max_rel_error(grads, ref_grads) < 1e-12, step
    assert max_rel_error(state.params, ref_state.params) < 1e-12
    assert max_rel_error(state.model_state, ref_state.model_state) < 1e-12
    assert max_rel_error(state.opt_state, ref_state.opt_state) < 1e-12


@pytest.mark.float64
@pytest.mark.parametrize("name,sync_bn,reference", [("ddp", True, "one device"), ("zero3", True, "one device"),
                                                    ("ddp", False, "data=2")])
def test_data_x_model_trains_as_its_reference(name, sync_bn, reference, variables, references):
    """Without SyncBN, ddp broadcasts data rank 0's BN statistics, each model device its own channel slice."""
    got = train(name, make_mesh(data=2, model=2), variables, sync_bn)
    assert_same_training(got, references[reference])


def test_one_all_reduce_over_model_per_block_forward_and_backward():
    """Forward: conv2's partial output is summed; backward: the gradient of the block input
    that feeds the column-parallel conv1 is. 4 blocks, 8 all-reduces; nothing else crosses ``model``."""
    model = tiny_resnet("float32")
    strategy = create_strategy("ddp", model, classifier(model), optax.sgd(0.1), make_mesh(data=2, model=2))
    images, labels = random_batch(8, dtype=np.float32)
    counts = step_collectives_by_axis(strategy, as_batch(images, labels))
    assert counts[("all-reduce", "model")] == 2 * 4, counts
    assert {k for k in counts if k[1] == "model"} == {("all-reduce", "model")}, counts


def test_a_width_that_does_not_split_is_one_clear_error():
    model = create_model("resnet18", width=6, blocks=(1, 1, 1, 1))  # blocks of 6, 12, 24, 48 channels
    with pytest.raises(StrategyError, match=r"^a ResNet of width 6 cannot be split over model=4: its blocks' inner "
                                            r"channels \(6, 12, 24, 48\) must all divide by it$"):
        create_strategy("ddp", model, classifier(model), optax.sgd(0.1), make_mesh(data=2, model=4))
