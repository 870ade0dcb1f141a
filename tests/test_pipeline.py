"""Pipeline stages on the ``stage`` axis (GPipe) composed with the data-parallel strategies.

Every layout must train exactly as the same model on one device (float64): the losses, the
averaged gradients, the params and the optimizer state after each step; and the two things
a pipeline can get silently wrong, the micro-batch loss scale and the order of the stages,
must each break that equality when injected.

Time: each distinct pipelined program costs ~4 s to compile for the ViT (XLA's scan with a
switch over the stages), ~1 s for the toy model, so the ViT runs only the layouts the toy
cannot (uneven stages of a real model on data x stage with M > 1; four stages) and the toy,
with its own one-device reference, runs the rest.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import canonical_history, max_rel_error, resumed_on, tiny_resnet
from jaxdp.runtime.mesh import make_mesh
from jaxdp.models.toy import ToyMpModel
from jaxdp.models.vit import EncoderBlock, ViT
from jaxdp.parallel import pipeline
from jaxdp.strategies import StrategyError, create_strategy
from jaxdp.loss.task import classifier
from parity_tests.pipeline_parallel import injected

# depth 2: four pipeline layers, so two stages are (embed, block 0) and (block 1, norm + head),
# of different param counts (the embedding's position table against the head).
SMALL_VIT = dict(num_classes=10, image_size=8, patch=4, dim=8, depth=2, heads=2, mlp_dim=16)
IMAGE = (8, 8, 3)


def vit(dtype=jnp.float64):
    return ViT(**SMALL_VIT, dtype=dtype, param_dtype=dtype)


def batches(n, steps=2, seed=0, shape=IMAGE, classes=10):
    rng = np.random.default_rng(seed)
    return [{"image": rng.normal(size=(n, *shape)), "label": rng.integers(0, classes, n).astype(np.int32)}
            for _ in range(steps)]


def train(model, mesh, variables, data, name="ddp", **options):
    """Every step's (loss, canonical grads) and the final canonical state."""
    tx = optax.sgd(0.1, momentum=0.9)
    strategy = create_strategy(name, model, classifier(model), tx, mesh, return_grads=True, **options)
    return canonical_history(strategy, variables, data)


def assert_trains_alike(run, reference, tol=1e-12):
    (history, state), (ref_history, ref_state) = run, reference
    for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(history, ref_history)):
        assert abs(loss - ref_loss) <= tol * abs(ref_loss), (step, loss, ref_loss)
        assert max_rel_error(grads, ref_grads) < tol, step
    assert max_rel_error(state.params, ref_state.params) < tol
    assert max_rel_error(state.opt_state, ref_state.opt_state) < tol


@pytest.fixture(scope="module")
def reference():
    """The start (float64 variables) and the reference run: the whole model and batch on one device.
    (x64 switched on here: module fixtures are built before conftest's per-test switch.)"""
    with jax.enable_x64(True):
        start = jax.jit(vit().init, static_argnames="train")(jax.random.key(1), jnp.zeros((1, *IMAGE)), train=False)
        return start, train(vit(), make_mesh(data=1), start, batches(8))


@pytest.fixture(scope="module")
def variables(reference):
    return reference[0]


@pytest.fixture(scope="module")
def one_device(reference):
    return reference[1]


@pytest.mark.float64
@pytest.mark.parametrize("axes,microbatches", [({"data": 2, "stage": 2}, 4), ({"stage": 4}, 2)])
def test_a_vit_on_stages_trains_as_one_device(axes, microbatches, variables, one_device):
    """data x stage, M > 1: the embedding and the head on stages of different sizes; stage=4:
    one layer per stage."""
    run = train(vit(), make_mesh(**axes), variables, batches(8), microbatches=microbatches)
    assert_trains_alike(run, one_device)


def toy():
    return ToyMpModel(dtype=jnp.float64, param_dtype=jnp.float64)


@pytest.fixture(scope="module")
def toy_reference():
    """The tutorial model's start and its run on one device."""
    with jax.enable_x64(True):
        start = toy().init(jax.random.key(0), jnp.zeros((1, 10), jnp.float64))
        return start, train(toy(), make_mesh(data=1), start, toy_batches())


def toy_batches():
    return batches(8, shape=(10,), classes=5)


@pytest.mark.float64
@pytest.mark.parametrize("name,axes,microbatches", [
    ("ddp", {"stage": 2}, 1), ("ddp", {"data": 2, "stage": 2}, 1), ("zero3", {"data": 2, "stage": 2}, 2)])
def test_the_tutorial_model_on_two_stages_trains_as_one_device(name, axes, microbatches, toy_reference):
    """ToyMpModel (the DDP tutorial's Linear(10,10) -> ReLU -> Linear(10,5)): net1 on stage 0,
    net2 on stage 1; M = 1 is the tutorial's picture. zero3: the stages' vectors kept as chunks
    over data and gathered whole (each stage's vector is its one unit), their gradients
    reduce-scattered."""
    start, reference = toy_reference
    run = train(toy(), make_mesh(**axes), start, toy_batches(), name, microbatches=microbatches)
    assert_trains_alike(run, reference)


@pytest.mark.float64
@pytest.mark.parametrize("bug", ["loss_scale", "stage_order"])
def test_an_injected_pipeline_bug_breaks_the_equality(bug, toy_reference):
    """Without the 1/M loss scale (torch without ``scale_grads``) the grads are M times too large;
    activations sent one stage too far (s -> s + 2 mod S: each stage feeds itself) run the
    wrong layers. The equality tests above must see both (the bugs live in
    parity_tests/pipeline_parallel.py, which catches them against torch too)."""
    start, reference = toy_reference
    with injected(bug):
        run = train(toy(), make_mesh(data=2, stage=2), start, toy_batches(), microbatches=4)
    with pytest.raises(AssertionError):
        assert_trains_alike(run, reference)
    assert max_rel_error(run[0][0][1], reference[0][0][1]) > 0.1  # the first step's grads: far off


def test_stacking_round_trips_and_puts_each_layer_on_its_stage(variables):
    pp = pipeline.for_mesh(vit(), make_mesh(data=1, stage=2))
    stacked = pp.stack(variables["params"])
    sizes = [sum(x.size for x in jax.tree_util.tree_leaves([variables["params"][k] for k in keys]))
             for keys in (("patch_embed", "cls_token", "pos_embed", "blocks"), ("norm", "head"))]
    block = sum(x.size for x in jax.tree_util.tree_leaves(variables["params"]["blocks"]["1"]))
    first, second = sizes[0] - block, sizes[1] + block  # stage 0: embedding + block 0; stage 1: block 1 + head
    assert stacked["stages"].shape == (2, max(first, second))
    assert not np.any(np.asarray(stacked["stages"][int(first > second), min(first, second):]))  # the padding
    block1 = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(variables["params"]["blocks"]["1"])])
    np.testing.assert_array_equal(stacked["stages"][1, :block], block1)  # stage 1 opens with block 1
    assert max_rel_error(pp.unstack(stacked), variables["params"]) == 0
    assert pipeline.stage_bounds(5, 2) == [(0, 3), (3, 5)]


@pytest.mark.parametrize("make,axes,options,message", [
    (lambda: tiny_resnet(), {"data": 1, "stage": 2}, {},
     r"^ResNet has no pipeline plan for the mesh's stage axis: give it a `pipeline_layers\(\)` method"),
    (lambda: vit(jnp.float32), {"data": 2, "stage": 2}, {"name": "dp"},
     r"^dp runs over the data axis only, but the mesh has stage=2: use ddp, zero1, zero2 or zero3 with a stage"),
    (lambda: vit(jnp.float32), {"data": 2}, {"microbatches": 2},
     r"^microbatches are pipeline micro-batches: they need a mesh with a stage axis$"),
    (lambda: vit(jnp.float32), {"data": 1, "stage": 8}, {},
     r"^a model of 4 pipeline layers cannot fill 8 stages$"),
    (lambda: vit(jnp.float32), {"data": 2, "stage": 2}, {"name": "zero3", "units": (EncoderBlock,)},
     r"^zero3 units are gathered module by module; on pipeline stages each stage's params are one vector"),
])
def test_what_cannot_pipeline_is_one_clear_error(make, axes, options, message):
    model, options = make(), dict(options)
    name = options.pop("name", "ddp")
    with pytest.raises(StrategyError, match=message):
        create_strategy(name, model, classifier(model), optax.sgd(0.1), make_mesh(**axes), **options)


def test_a_batch_that_does_not_split_into_microbatches_is_one_clear_error():
    model = ToyMpModel()
    strategy = create_strategy("ddp", model, classifier(model), optax.sgd(0.1), make_mesh(data=2, stage=2),
                               microbatches=4)
    batch = {k: v.astype(np.float32) if k == "image" else v
             for k, v in batches(12, steps=1, shape=(10,), classes=5)[0].items()}
    state = strategy.engine.init(jax.random.key(0), batch)
    with pytest.raises(pipeline.PipelineError, match=r"^per-device batch 6 does not split into 4 pipeline "
                                                     r"micro-batches \(--microbatches\)"):
        strategy.engine.step(state, strategy.engine.shard_batch(batch))


@pytest.mark.float64
@pytest.mark.parametrize("first,then", [(("ddp", {"data": 2, "stage": 2}), ("zero1", {"data": 4})),
                                        (("ddp", {"data": 4}), ("ddp", {"data": 2, "stage": 2}))])
def test_a_checkpoint_resumes_on_another_mesh(first, then, toy_reference, tmp_path):
    """Checkpoints hold the canonical params tree whatever the stages: 1 step on one layout, save,
    restore into another (a target that builds nothing), 1 more step == 2 steps on one device."""
    (variables, (_, want)), data, tx = toy_reference, toy_batches(), optax.sgd(0.1, momentum=0.9)

    def make(name, axes):
        return create_strategy(name, toy(), classifier(toy()), tx, make_mesh(**axes))

    got = resumed_on(make(*first), make(*then), variables, data, 1, tmp_path / "ckpt")
    assert max_rel_error(got.params, want.params) < 1e-12
    assert max_rel_error(got.opt_state, want.opt_state) < 1e-12


_BACK_TO_BACK = """
import jax, numpy as np, optax
from jaxdp.runtime.mesh import make_mesh
from jaxdp.models.toy import ToyMpModel
from jaxdp.strategies import create_strategy
from jaxdp.loss.task import classifier

model = ToyMpModel()
rng = np.random.default_rng(0)
batch = {"image": rng.normal(size=(8, 10)).astype(np.float32), "label": rng.integers(0, 5, 8).astype(np.int32)}
strategy = create_strategy("ddp", model, classifier(model), optax.sgd(0.01), make_mesh(data=2, stage=2),
                           microbatches=2)
state = strategy.engine.init(jax.random.key(0), batch)
placed = strategy.engine.shard_batch(batch)
for _ in range(200):
    state, metrics = strategy.engine.step(state, placed)  # dispatched back to back: nobody waits here
print("done", float(metrics["loss"]))
"""


def test_200_steps_dispatched_back_to_back_never_hang():
    """The stages' ppermutes and the data all-reduce on a 2 x 2 mesh: the XLA:CPU rendezvous
    trap ``ShardMapEngine._one_at_a_time`` guards against (test_tensor_parallel.py has the model axis's)."""
    import os
    import subprocess
    import sys

    # 4 devices, and the suite's fast-compile flags (conftest.py) kept: compiling dominates here.
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = dict(os.environ, XLA_FLAGS=" ".join(flags + ["--xla_force_host_platform_device_count=4"]),
               JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", _BACK_TO_BACK], capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("done "), done.stdout


@pytest.mark.parametrize("axes,options,per_device,message", [
    ({"data": 2, "stage": 2}, {"microbatches": 4, "accum_steps": 2}, 12,
     r"^6 images per device and accumulation step do not split into 4 pipeline micro-batches: pick a "
     r"--global-batch-size that is a multiple of 16 or change --microbatches$"),
    ({"data": 2}, {"microbatches": 2}, 4, r"^--microbatches are pipeline micro-batches: give --mesh a stage axis"),
])
def test_train_refuses_microbatches_that_cannot_work_in_one_line(axes, options, per_device, message):
    from jaxdp.config.tree import TrainConfig, TrainError
    from jaxdp.run.setup import _pipeline_options

    with pytest.raises(TrainError, match=message):
        _pipeline_options(TrainConfig(**options), make_mesh(**axes), per_device)
    assert _pipeline_options(TrainConfig(), make_mesh(data=2, stage=2), 4) == {"microbatches": 2}  # one per stage
