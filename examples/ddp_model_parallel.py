"""DDP with a model split over two devices: PyTorch's "Combining DDP with model parallelism", in jaxdp.

Run:      python examples/ddp_model_parallel.py
Takes:    about 15 seconds on 2 CPU cores (most of it compiling).

The tutorial's ToyMpModel (Linear(10, 10) -> ReLU -> Linear(10, 5)) puts its two halves on
two devices and wraps the whole in DDP. Here the mesh has 4 simulated devices, data=2 x
stage=2: each data rank's model is split over two pipeline stages, ``net1`` + ReLU on stage
0 and ``net2`` on stage 1 (``jaxdp.models.toy``), the activations crossing from one to the
other with a ppermute; DDP averages the gradients over ``data``, each stage only its own.
With one micro-batch (``microbatches=1``, the tutorial's picture) stage 1 idles while stage 0
computes and the other way round; more micro-batches fill that bubble (GPipe, docs/strategies.md).
The torch twin, ``PipelineStage`` + ``ScheduleGPipe`` on a (dp, pp) DeviceMesh: ``python -m
torch_ref.pipeline`` (float64; ``parity_tests/test_pipeline_parallel.py`` checks the two agree).
"""

import os

# XLA reads this when jax is first imported: ask for 4 host devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jaxdp.runtime.mesh import make_mesh  # noqa: E402
from jaxdp.models.toy import ToyMpModel  # noqa: E402
from jaxdp.strategies import create_strategy  # noqa: E402
from jaxdp.loss.task import classifier  # noqa: E402

BATCH, STEPS = 20, 30


def main():
    model = ToyMpModel()
    mesh = make_mesh(data=2, stage=2)
    ddp = create_strategy("ddp", model, classifier(model), optax.sgd(0.1), mesh, microbatches=1)

    # A fixed random "dataset": 20 inputs of 10 features and 5 classes, as in the tutorial.
    rng = np.random.default_rng(0)
    batch = {"image": rng.normal(size=(BATCH, 10)).astype(np.float32),
             "label": rng.integers(0, 5, BATCH).astype(np.int32)}
    state = ddp.engine.init(jax.random.key(0), batch)
    stacked = state.params["stages"]  # (stages, longest stage's param count), cut over "stage"
    print(f"mesh {dict(mesh.shape)}; each device holds {stacked.sharding.shard_shape(stacked.shape)} of the "
          f"stacked params {stacked.shape}: its stage's params only")
    placed = ddp.engine.shard_batch(batch)  # 10 rows per data rank, the same rows on both of its stages
    for step in range(STEPS):
        state, metrics = ddp.engine.step(state, placed)
        if step % 10 == 0 or step == STEPS - 1:
            print(f"step {step:2d}  loss {float(metrics['loss']):.4f}")
    params = ddp.engine.canonical(state).params  # the model's own tree again: net1 and net2, as on one device
    print("net1 kernel", params["net1"]["kernel"].shape, "net2 kernel", params["net2"]["kernel"].shape)


if __name__ == "__main__":
    main()
