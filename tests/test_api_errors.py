"""The Python API's mistakes (issue 28's table): each gives one line that names the fix, as a
``jaxdp.UsageError``, at ``init`` or at the step before anything compiles."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.relu(nn.Dense(4)(x)))[:, 0]


model = Net()


def good_loss(params, model_state, batch, rng):
    loss = jnp.mean((model.apply({"params": params}, batch["x"]) - batch["y"]) ** 2)
    return loss, (model_state, {})


def host_batch(rows=8, y_rows=None):
    rs = np.random.default_rng(0)
    return {"x": rs.normal(size=(rows, 3)).astype(np.float32),
            "y": rs.normal(size=(rows if y_rows is None else y_rows,)).astype(np.float32)}


def trainer(loss_fn=good_loss, n=4, **kw):
    kw.setdefault("model_inputs", lambda b: (b["x"],))
    return jaxdp.Trainer(model, loss_fn, optax.sgd(0.1), "ddp", jaxdp.make_mesh(data=n), **kw)


def one_line(excinfo, *words):
    """A jaxdp error, one line, naming the fix; raised from jaxdp's code, not from inside jax."""
    assert excinfo.type is jaxdp.UsageError
    message = str(excinfo.value)
    assert "\n" not in message and len(message) < 300, message
    for word in words:
        assert word in message, message
    frames = [entry.path for entry in excinfo.traceback][1:]  # after the test's own frame
    assert len(frames) <= 4 and all("/jaxdp/" in str(p) for p in frames), frames  # no jax frames


def no_compile_happened(t):
    assert t.strategy.engine.jit_step is None


def test_batch_that_does_not_split_over_the_devices():
    t = trainer()
    state = t.init(jax.random.key(0), host_batch(8))
    with pytest.raises(jaxdp.UsageError) as e:
        t.step(state, host_batch(10))
    one_line(e, "10 rows", "4 device(s)", "multiple of 4", "12 or 8")
    no_compile_happened(t)


def only_the_loss(params, model_state, batch, rng):
    return good_loss(params, model_state, batch, rng)[0]


def loss_and_metrics(params, model_state, batch, rng):
    loss = only_the_loss(params, model_state, batch, rng)
    return loss, {"mse": loss}


def metrics_not_a_dict(params, model_state, batch, rng):
    loss = only_the_loss(params, model_state, batch, rng)
    return loss, (model_state, loss)


def per_example_loss(params, model_state, batch, rng):
    return (model.apply({"params": params}, batch["x"]) - batch["y"]) ** 2, (model_state, {})


@pytest.mark.parametrize("loss_fn,words", [
    (only_the_loss, ("a single array", "return loss, (model_state, {})")),
    (loss_and_metrics, ("(loss, dict)", "return loss, (model_state, metrics)")),
    (metrics_not_a_dict, ("metrics must be a dict", "got an array", "{'name': value}")),
    (per_example_loss, ("must be a scalar", "shape (2,)", ".mean()")),  # one device's 8 / 4 rows
], ids=lambda x: x.__name__ if callable(x) else "")
def test_loss_fn_output_mistakes_are_named_at_init(loss_fn, words):
    t = trainer(loss_fn)
    with pytest.raises(jaxdp.UsageError) as e:
        t.init(jax.random.key(0), host_batch())
    one_line(e, *words)
    assert t.strategy.shapes is None  # refused before init built (or compiled) anything


def test_batch_leaves_with_different_rows():
    t = trainer()
    with pytest.raises(jaxdp.UsageError) as e:
        t.init(jax.random.key(0), host_batch(12, y_rows=8))
    one_line(e, "['x']: 12", "['y']: 8", "same leading batch dimension")
    state = t.init(jax.random.key(0), host_batch(8))
    with pytest.raises(jaxdp.UsageError) as e:  # and at the step, with the rows given (not per device)
        t.step(state, host_batch(12, y_rows=8))
    one_line(e, "['x']: 12", "['y']: 8")
    no_compile_happened(t)


@pytest.mark.filterwarnings("ignore:shape requires ndarray:DeprecationWarning")  # flax's, on the dict
def test_dict_batch_without_model_inputs():
    with pytest.raises(jaxdp.UsageError) as e:
        trainer(model_inputs=None).init(jax.random.key(0), host_batch())
    one_line(e, "whole dict batch", "model_inputs=lambda batch: (batch['x'],)")


def test_a_loss_that_reduces_over_the_batch_axes_is_left_to_the_step():
    """It cannot be traced outside the mesh: no false alarm at init, and it trains."""
    def loss_fn(params, model_state, batch, rng):
        loss = jax.lax.psum(good_loss(params, model_state, batch, rng)[0], "data") / 2
        return loss, (model_state, {})
    t = trainer(loss_fn, n=2)
    state = t.init(jax.random.key(0), host_batch())
    _, metrics = t.step(state, host_batch())
    assert np.isfinite(float(metrics["loss"]))


def test_numpy_int64_targets_init_and_step_without_a_dtype_warning():
    """numpy's default integers (int64) are what a user's labels usually are. With x64 off jax
    holds them as int32 (as ``device_put`` does), so init traces the model with int32 and
    neither init nor the step warns about a dtype jax cannot hold."""
    import warnings

    def loss(params, model_state, batch, rng):
        out = model.apply({"params": params}, batch["x"])
        return jnp.mean((out - batch["y"].astype(out.dtype)) ** 2), (model_state, {})

    batch = {"x": host_batch()["x"], "y": np.arange(8)}
    assert batch["y"].dtype == np.int64 and not jax.config.jax_enable_x64
    t = trainer(loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = t.init(jax.random.key(0), batch)
        state, metrics = t.step(state, batch)
    assert np.isfinite(float(metrics["loss"]))
