"""Tensor parallelism on the ``model`` axis composed with the data-parallel strategies.

Every layout must train exactly as the same model on one device (float64): the losses,
the averaged gradients, the params and the optimizer state after each step. And the
Megatron collectives must be the ones the design promises, counted in the compiled step.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import TinyConvNet, canonical_history, max_rel_error, resumed_on, step_collectives_by_axis, stepped
from jaxdp.runtime.mesh import make_mesh
from jaxdp.models.vit import EncoderBlock, ViT
from jaxdp.parallel.tensor import Column, TensorParallel
from jaxdp.strategies import StrategyError, create_strategy
from jaxdp.loss.task import classifier

DEPTH = 2
SMALL_VIT = dict(num_classes=10, image_size=16, patch=8, dim=16, depth=DEPTH, heads=4, mlp_dim=32)
OPTIONS = {"ddp": {}, "zero1": {}, "zero2": {}, "zero3": {"units": (EncoderBlock,)}}


def vit(dtype=jnp.float64, **sizes):
    return ViT(**{**SMALL_VIT, **sizes}, dtype=dtype, param_dtype=dtype)


def batches(n, steps=3, seed=0):
    rng = np.random.default_rng(seed)
    return [{"image": rng.normal(size=(n, 16, 16, 3)), "label": rng.integers(0, 10, n).astype(np.int32)}
            for _ in range(steps)]


def train(name, mesh, variables, data, model=None, **options):
    """Every step's (loss, canonical grads) and the final canonical state."""
    model = model or vit()
    tx = optax.sgd(0.1, momentum=0.9)
    strategy = create_strategy(name, model, classifier(model), tx, mesh, return_grads=True, **options)
    return canonical_history(strategy, variables, data)


@pytest.fixture(scope="module")
def variables():
    with jax.enable_x64(True):  # module fixtures are built before conftest's per-test x64 switch
        return vit().init(jax.random.key(1), jnp.zeros((1, 16, 16, 3), jnp.float64), train=False)


@pytest.fixture(scope="module")
def one_device(variables):
    """The reference: the whole model, the whole batch, one device."""
    with jax.enable_x64(True):
        return {n: train("ddp", make_mesh(data=1), variables, batches(n)) for n in (8, 12)}


@pytest.mark.float64
@pytest.mark.parametrize("name,data", [("ddp", 2), ("zero1", 2), ("zero2", 2), ("zero3", 2), ("zero3", 3),
                                       ("zero2", 3)])
def test_data_x_model_trains_as_one_device(name, data, variables, one_device):
    """data=3 pads: each model slice (8 features) is cut 3 ways, so ZeRO pads every slice on its own."""
    n = 4 * data
    history, state = train(name, make_mesh(data=data, model=2), variables, batches(n), **OPTIONS[name])
    ref_history, ref_state = one_device[n]
    for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(history, ref_history)):
        assert abs(loss - ref_loss) <= 1e-13 * abs(ref_loss), (step, loss, ref_loss)
        assert max_rel_error(grads, ref_grads) < 1e-12, step
    assert max_rel_error(state.params, ref_state.params) < 1e-12
    assert max_rel_error(state.opt_state, ref_state.opt_state) < 1e-12


@pytest.mark.float64
@pytest.mark.parametrize("mesh,options", [(dict(replica=2, data=2, model=2), {}),
                                          (dict(data=4, model=2), {"mesh_shape": (2, 2)})])
def test_hsdp_beside_a_model_axis_trains_as_one_device(mesh, options, variables, one_device):
    """HSDP keeps the model axis: sharded within each data group, all-reduced across replicas,
    each model slice on its own; named on the mesh, or split from data=4 by mesh_shape."""
    model = vit()
    kept = create_strategy("hsdp", model, classifier(model), optax.sgd(0.1), make_mesh(**mesh), **options)
    assert dict(kept.mesh.shape) == {"replica": 2, "data": 2, "model": 2} and kept.model_split is not None
    history, state = train("hsdp", make_mesh(**mesh), variables, batches(8), units=(EncoderBlock,), **options)
    ref_history, ref_state = one_device[8]
    for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(history, ref_history)):
        assert abs(loss - ref_loss) <= 1e-13 * abs(ref_loss), (step, loss, ref_loss)
        assert max_rel_error(grads, ref_grads) < 1e-12, step
    assert max_rel_error(state.params, ref_state.params) < 1e-12


def model_axis_collectives(name, mesh):
    """{(op, "model"|"data"): count} in the compiled float32 step on a data x model mesh."""
    model = vit(jnp.float32)
    strategy = create_strategy(name, model, classifier(model), optax.sgd(0.1), mesh, **OPTIONS[name])
    batch = batches(8, steps=1)[0]
    return step_collectives_by_axis(strategy, {"image": batch["image"].astype(np.float32), "label": batch["label"]})


def test_megatron_layers_all_reduce_once_forward_and_once_backward():
    """Per encoder block: attention's proj and the MLP's fc2 each sum their partial outputs
    in forward; in backward, the gradients of qkv's and fc1's replicated inputs are summed.
    4 per block, nothing else moves over ``model``."""
    mesh = make_mesh(data=2, model=2)
    counts = model_axis_collectives("ddp", mesh)
    assert counts[("all-reduce", "model")] == 4 * DEPTH, counts
    assert {k for k in counts if k[1] == "model"} == {("all-reduce", "model")}, counts


def test_grouped_column_layout_gives_each_device_its_own_heads():
    """qkv's output features are [q | k | v]; device j must hold q, k and v of its heads only."""
    tp = TensorParallel({"params/qkv": Column(groups=3)}, size=2)
    dim = 8  # 4 heads of 2: device 0 owns heads 0-1 (features 0-3), device 1 heads 2-3
    canonical = np.arange(3 * dim)[None, :].repeat(2, 0)  # (in=2, out=3*dim), value = feature index
    state = np.asarray(tp.to_state("params/qkv", jnp.asarray(canonical)))
    device0, device1 = state[0, :3 * dim // 2], state[0, 3 * dim // 2:]
    assert device0.tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19]
    assert device1.tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]
    np.testing.assert_array_equal(np.asarray(tp.from_state("params/qkv", jnp.asarray(state))), canonical)


@pytest.mark.parametrize("name", ["dp", "async"])
def test_strategies_without_model_parallelism_refuse_a_model_axis(name):
    model = vit(jnp.float32)
    with pytest.raises(StrategyError, match=f"^{name} runs over the data axis only, but the mesh has model=2"):
        create_strategy(name, model, classifier(model), optax.sgd(0.1), make_mesh(data=2, model=2))


def test_a_model_that_does_not_split_is_one_clear_error():
    model = ViT(**{**SMALL_VIT, "mlp_dim": 30})  # an MLP of 30 over 4 devices
    with pytest.raises(StrategyError, match=r"^a ViT with MLP width 30 cannot be split over model=4: it must divide "
                                            r"by it$"):
        create_strategy("ddp", model, classifier(model), optax.sgd(0.1), make_mesh(data=2, model=4))


def test_a_model_without_a_plan_is_one_clear_error():
    model = TinyConvNet()
    with pytest.raises(StrategyError, match=r"^TinyConvNet has no tensor-parallel plan for the mesh's model axis"):
        create_strategy("ddp", model, classifier(model), optax.sgd(0.1), make_mesh(data=1, model=2))


THREE_HEADS = dict(heads=3, dim=12)


@pytest.mark.float64
def test_heads_that_do_not_divide_keep_attention_whole_and_train_as_one_device():
    """3 heads over model=2: attention runs whole on every model device, the MLP is split."""
    model = vit(**THREE_HEADS)
    variables = model.init(jax.random.key(2), jnp.zeros((1, 16, 16, 3)), train=False)
    history, state = train("ddp", make_mesh(data=2, model=2), variables, batches(8), model=model)
    ref_history, ref_state = train("ddp", make_mesh(data=1), variables, batches(8), model=model)
    for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(history, ref_history)):
        assert abs(loss - ref_loss) <= 1e-13 * abs(ref_loss), (step, loss, ref_loss)
        assert max_rel_error(grads, ref_grads) < 1e-12, step
    assert max_rel_error(state.params, ref_state.params) < 1e-12
    assert max_rel_error(state.opt_state, ref_state.opt_state) < 1e-12
    assert state.params["blocks"]["0"]["attn"]["qkv"]["kernel"].shape == (12, 36)  # canonical: 3 heads


def test_three_heads_over_model2_train_from_the_command_line_saying_attention_stays_whole(tmp_path, capsys,
                                                                                        monkeypatch):
    """``jaxdp train --mesh data=2,model=2 --model vit-tiny`` (vit-tiny's 3 heads), at a tiny size:
    the full vit-tiny takes 62 s of CPU on this path."""
    from jaxdp.cli.command import main
    from jaxdp.models import VIT_ARCHITECTURES

    monkeypatch.setitem(VIT_ARCHITECTURES, "vit-tiny", dict(dim=12, depth=1, heads=3, mlp_dim=16, patch=8))
    out = tmp_path / "run"
    assert main(["train", "--model", "vit-tiny", "--mesh", "data=2,model=2", "--synthetic-size", "32,16",
                 "--global-batch-size", "8", "--epochs", "1", "--no-progress", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    note = ("tensor parallelism: 3 attention heads do not split over model=2: attention stays whole on every "
            "model device, only the MLP is split\n")
    assert err.count(note) == 1, err
    losses = [r["loss"] for r in map(json.loads, open(out / "metrics.jsonl")) if r.get("kind") == "train"]
    assert len(losses) == 4 and all(np.isfinite(losses)), losses


@pytest.mark.parametrize("plan,message", [
    ({"params/head/kernel": Column()}, r"^params/head/kernel has 5 features along dim 1, which do not split 2 ways"),
    ({"params/nothing/*": Column()}, r"^tensor-parallel rules match no variable: params/nothing/\*$"),
])
def test_a_plan_that_does_not_fit_the_variables_is_one_clear_error(plan, message):
    model = ViT(**{**SMALL_VIT, "num_classes": 5})
    strategy = create_strategy("ddp", model, classifier(model), optax.sgd(0.1), make_mesh(data=1, model=2),
                               tp_plan=plan)
    with pytest.raises(StrategyError, match=message):
        strategy.engine.init(jax.random.key(0), batches(2, steps=1)[0])


def test_ring_all_reduce_is_refused_beside_a_model_axis():
    model = vit(jnp.float32)
    with pytest.raises(StrategyError, match="allreduce='ring' does not combine with a model axis"):
        create_strategy("ddp", model, classifier(model), optax.sgd(0.1), make_mesh(data=2, model=2), allreduce="ring")


_BACK_TO_BACK = """
import sys
import jax, numpy as np, optax
from jaxdp.runtime.mesh import make_mesh
from jaxdp.models.vit import EncoderBlock, ViT
from jaxdp.strategies import create_strategy
from jaxdp.loss.task import classifier

name, steps = sys.argv[1], int(sys.argv[2])
model = ViT(num_classes=10, image_size=16, patch=8, dim=16, depth=2, heads=4, mlp_dim=32)
rng = np.random.default_rng(0)
batch = {"image": rng.normal(size=(8, 16, 16, 3)).astype(np.float32), "label": rng.integers(0, 10, 8).astype(np.int32)}
options = {"units": (EncoderBlock,)} if name == "zero3" else {}
strategy = create_strategy(name, model, classifier(model), optax.sgd(0.01), make_mesh(data=2, model=4), **options)
state = strategy.engine.init(jax.random.key(0), batch)
placed = strategy.engine.shard_batch(batch)
for _ in range(steps):
    state, metrics = strategy.engine.step(state, placed)  # dispatched back to back: nobody waits here
print("done", float(metrics["loss"]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", "zero3"])
def test_200_steps_dispatched_back_to_back_never_hang(name):
    """XLA:CPU deadlocked 3 of 3 such runs before the strategies waited for each program
    (``ShardMapEngine._one_at_a_time``); a deadlock aborts after 40 s, the timeout catches worse.
    The subprocess keeps the suite's fast-compile XLA flags: without the wait it aborted 2 of 2
    runs under them too, and with it the zero3 run costs 17 s of CPU instead of XLA's default 37."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", _BACK_TO_BACK, name, "200"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("done "), done.stdout


@pytest.mark.float64
@pytest.mark.parametrize("first,then", [(("zero3", {"data": 2, "model": 2}), ("zero1", {"data": 4})),
                                        (("ddp", {"data": 4}), ("zero2", {"data": 2, "model": 2}))])
def test_a_checkpoint_resumes_on_another_mesh(first, then, variables, tmp_path):
    """The checkpoint's layout is canonical whatever the mesh: 2 steps on one layout, save,
    restore into another (a target that builds nothing), 2 more steps == 4 steps on one device."""
    data = batches(8, steps=4, seed=3)
    tx = optax.sgd(0.1, momentum=0.9)

    def make(name, axes):
        model = vit()
        return create_strategy(name, model, classifier(model), tx, make_mesh(**axes), **OPTIONS[name])

    reference = make("ddp", {"data": 1})
    want = jax.device_get(reference.engine.canonical(stepped(reference, reference.engine.init_state(variables), data)))
    got = resumed_on(make(*first), make(*then), variables, data, 2, tmp_path / "ckpt")
    assert max_rel_error(got.params, want.params) < 1e-12
    assert max_rel_error(got.opt_state, want.opt_state) < 1e-12
