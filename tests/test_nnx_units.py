"""ZeRO-3 units of a Flax NNX model: the NNX LM (examples/custom_model_nnx.py) and its Flax Linen
twin (examples/custom_model.py), from the same init, train the same float64 numbers under zero3
on 4 devices, bit for bit, with the same argument bytes, temp memory and collectives per step:
each NNX unit is gathered just before it runs and freed after, as each Linen unit is. And the
unit specifications that cannot work, each in one line."""

import importlib.util
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdp
from jaxdp.analysis import parse_collectives
from jaxdp.loss.nnx_state import Parts
from jaxdp.strategies.units import UnitError

pytestmark = pytest.mark.float64

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")
STEPS, N = 5, 4
FAST = {"compiler_options": "xla_backend_optimization_level=0"}  # 5 steps: level 2 compiles 2x longer


def example(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def float64_attention(query, key, value, mask=None, **_):
    """Linen's attention, which computes float64 in float64 (NNX's default takes jax.nn's, whose
    softmax runs in float32: 2e-7 off)."""
    return nn.dot_product_attention(query, key, value, mask=mask)


def linen_names(params):
    """The NNX LM's params under its Linen twin's names: ``blocks/0`` is ``blocks_0``."""
    blocks = params.get("blocks", {})
    return {**{k: v for k, v in params.items() if k != "blocks"}, **{f"blocks_{i}": b for i, b in blocks.items()}}


@pytest.fixture(scope="module")
def twins():
    """Both LMs under zero3 on 4 devices from the NNX LM's init: (trainer, state, step compiled) each."""
    with jax.enable_x64(True):  # a module fixture runs before the float64 mark turns x64 on
        return _twins()


def _twins():
    nnx_lm, linen_lm = example("custom_model_nnx"), example("custom_model")
    model = nnx_lm.TinyLM(rngs=nnx.Rngs(0), param_dtype=jnp.float64, attention_fn=float64_attention)
    init = Parts(model).variables()
    batch = next(linen_lm.batches(1))
    tx, mesh = optax.adamw(3e-3, weight_decay=0.01), jaxdp.make_mesh(data=N)
    a = jaxdp.Trainer(model, nnx_lm.loss_fn, tx, jaxdp.ZeRO(stage=3, units=(nnx_lm.Block,), **FAST), mesh)
    b = jaxdp.Trainer(linen_lm.model, linen_lm.loss_fn, tx, jaxdp.ZeRO(stage=3, units=(linen_lm.Block,), **FAST), mesh,
                      model_inputs=lambda batch: (batch["tokens"][:, :-1],))
    states = [a.init(jax.random.key(0), batch), b.strategy.engine.init_state({"params": linen_names(init["params"])})]
    compiled = [t.strategy.engine.compile_step(s, t.strategy.engine.shard_batch(batch)) for t, s in zip((a, b), states)]
    return linen_lm, (a, b), states, compiled


def test_the_nnx_lm_trains_its_linen_twins_numbers_bit_for_bit(twins):
    linen_lm, trainers, states, _ = twins
    losses = ([], [])
    for batch in linen_lm.batches(STEPS, seed=1):
        for i, trainer in enumerate(trainers):
            states[i], metrics = trainer.step(states[i], batch)
            losses[i].append(float(metrics["loss"]))
    assert losses[0] == losses[1] and losses[0][-1] < losses[0][0]
    got, want = (jax.device_get(t.canonical(s).params) for t, s in zip(trainers, states))
    got = linen_names(got)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, want)


def test_the_nnx_lm_takes_its_linen_twins_memory_and_collectives(twins):
    """Argument bytes equal, temp within 5 % (measured: equal), and the same all-gathers and
    reduce-scatters: one gather per param tensor of each unit in forward, again in backward."""
    _, _, _, (a, b) = twins
    ma, mb = a.memory_analysis(), b.memory_analysis()
    assert ma.argument_size_in_bytes == mb.argument_size_in_bytes
    assert abs(ma.temp_size_in_bytes - mb.temp_size_in_bytes) <= 0.05 * mb.temp_size_in_bytes
    ca, cb = (parse_collectives(c.as_text(), N)["ops"] for c in (a, b))
    for op in ("all-gather", "reduce-scatter"):
        assert ca.get(op, {}).get("count") == cb.get(op, {}).get("count"), op
    assert ca["all-gather"]["count"] > 0


class Tiny(nnx.Module):
    def __init__(self):
        self.layers = nnx.List([nnx.Linear(2, 2, rngs=nnx.Rngs(0)) for _ in range(2)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def tiny_loss(model, batch, rng):
    return jnp.mean(model(batch["x"]) ** 2)


def test_units_that_cannot_work_are_one_line():
    """Refused when the strategy first reads the model (at init), or when it is made."""
    mesh, batch = jaxdp.make_mesh(data=2), {"x": np.ones((4, 2), np.float32)}
    trainer = jaxdp.Trainer(Tiny(), tiny_loss, optax.sgd(0.1), jaxdp.ZeRO(stage=3, units=("blocks/*",)), mesh)
    with pytest.raises(UnitError, match=r"^no submodule of the nnx.Module matches the FSDP units \['blocks/\*'\] "
                                        r"\(attribute paths read like layers, layers/0, layers/1\)$"):
        trainer.init(jax.random.key(0), batch)
    with pytest.raises(UnitError, match=r"^units of an nnx.Module are nnx.Module classes or attribute paths like "
                                        r"'blocks/\*', got \[<class 'flax.linen.linear.Dense'>\]$"):
        jaxdp.Trainer(Tiny(), tiny_loss, optax.sgd(0.1), jaxdp.ZeRO(stage=3, units=(nn.Dense,)), mesh)

