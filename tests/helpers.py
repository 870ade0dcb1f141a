"""Small shared pieces for the tests: tiny models, random batches, tree comparison, jax's compile log."""

import contextlib
import logging
import re
from collections import Counter

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxdp.models import create_model
from jaxdp.models.batchnorm import BatchNorm
from jaxdp.strategies import conversions


def tiny_resnet(dtype="float64", **kw):
    """A one-block-per-stage ResNet-18 layout: every code path, a fraction of the cost."""
    return create_model("resnet18", width=4, blocks=(1, 1, 1, 1), dtype=dtype, **kw)


class TinyConvNet(nn.Module):
    """No BatchNorm: for checks where per-batch statistics would break an equality."""

    dtype: jnp.dtype = jnp.float64

    @nn.compact
    def __call__(self, x, train=True):
        x = nn.Conv(4, (3, 3), padding=((1, 1), (1, 1)), dtype=self.dtype, param_dtype=self.dtype)(x)
        x = nn.relu(x).mean(axis=(1, 2))
        return nn.Dense(10, dtype=self.dtype, param_dtype=self.dtype)(x)


class TinyBNNet(nn.Module):
    """conv -> torch-semantics BatchNorm -> dense: the BN code path at a fraction of a ResNet's compile time."""

    dtype: jnp.dtype = jnp.float64
    bn_axis_name: str = None

    @nn.compact
    def __call__(self, x, train=True):
        x = nn.Conv(4, (3, 3), padding=((1, 1), (1, 1)), use_bias=False, dtype=self.dtype, param_dtype=self.dtype)(x)
        x = BatchNorm(axis_name=self.bn_axis_name, dtype=self.dtype, param_dtype=self.dtype)(x, train)
        x = nn.relu(x).mean(axis=(1, 2))
        return nn.Dense(10, dtype=self.dtype, param_dtype=self.dtype)(x)


def numpy_init(model, size=8, seed=0):
    """Variables drawn with numpy (jit-compiling model.init costs more than the tests; eager is slower still)."""
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((2, size, size, 3), model.dtype)))
    rng = np.random.default_rng(seed)

    def draw(path, s):
        name = path[-1].key
        if name == "var":
            return rng.uniform(0.5, 1.5, s.shape).astype(s.dtype)
        fan_in = int(np.prod(s.shape[:-1])) if len(s.shape) > 1 else 1
        return (rng.normal(size=s.shape) / np.sqrt(fan_in) + (name == "scale")).astype(s.dtype)

    variables = jax.tree_util.tree_map_with_path(draw, shapes)
    return {"batch_stats": {}, **variables}


def random_batch(n, size=8, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, size, size, 3)).astype(dtype), rng.integers(0, 10, n).astype(np.int32)


def as_batch(images, labels, mask=None):
    """The classifier task's batch pytree (``jaxdp.loss.task.classifier``): host arrays, global batch."""
    batch = {"image": images, "label": labels}
    return batch if mask is None else {**batch, "mask": mask}


def model_state(variables):
    """The non-params collections of ``variables`` (a TrainState's ``model_state``)."""
    return {k: v for k, v in variables.items() if k != "params"}


def run_steps(strategy, state, batches):
    """``strategy.engine.step`` over host ``(images, labels)`` pairs; the final state and every step's metrics."""
    history = []
    for x, y in batches:
        state, metrics = strategy.engine.step(state, strategy.engine.shard_batch(as_batch(x, y)))
        history.append(metrics)
    return state, history


def canonical_history(strategy, variables, batches):
    """From full ``variables``, each step's (loss, canonical averaged grads) over host
    ``batches`` (the strategy built with ``return_grads=True``) and the final canonical state."""
    state = strategy.engine.init_state(variables)
    history = []
    for batch in batches:
        state, metrics = strategy.engine.step(state, strategy.engine.shard_batch(batch))
        history.append((float(metrics["loss"]), jax.device_get(conversions.canonical_grads(strategy, metrics["grads"]))))
    return history, jax.device_get(strategy.engine.canonical(state))


def stepped(strategy, state, batches):
    """``state`` after one step per host batch."""
    for batch in batches:
        state, _ = strategy.engine.step(state, strategy.engine.shard_batch(batch))
    return state


def resumed_on(a, b, variables, batches, split, directory):
    """``a`` trains from full ``variables`` on ``batches[:split]``, saves a checkpoint in
    ``directory``; ``b`` (another strategy or mesh) restores it into a target that builds
    nothing, trains on the rest and returns its canonical state (to compare with one run)."""
    from jaxdp.checkpoint import Checkpointer

    ckpt = Checkpointer(str(directory))
    ckpt.save(split, a.engine.stored(stepped(a, a.engine.init_state(variables), batches[:split])), {"step": split})
    restored, _ = ckpt.restore(b.engine.restore_target(batches[0]))
    return jax.device_get(b.engine.canonical(stepped(b, b.engine.from_stored(restored), batches[split:])))


def init(model, size=8, seed=0):
    return model.init(jax.random.key(seed), jnp.zeros((1, size, size, 3), model.dtype), train=False)


def max_rel_error(a, b):
    """Largest per-tensor relative error (max |a-b| / max |b|) over two matching trees."""
    errs = jax.tree_util.tree_map(
        lambda x, y: float(np.abs(np.asarray(x) - np.asarray(y)).max() / max(np.abs(np.asarray(y)).max(), 1e-300)),
        a, b,
    )
    return max(jax.tree_util.tree_leaves(errs), default=0.0)


def collectives_in_loops(hlo: str):
    """Collectives of a compiled program, split by where they run:
    ({op: count inside while-loop bodies}, {op: count elsewhere}). With accumulation the
    micro-batches compile to a loop, so what is inside runs once per micro-batch."""
    per_computation, bodies, current = {}, set(), None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if header and not line.startswith(" "):
            current = header.group(1)
            per_computation[current] = Counter()
        elif current:
            op = re.search(r"=.*\s(all-reduce|reduce-scatter|all-gather)(?:-start)?\(", line)
            if op:  # a bucket's result may be a tuple
                per_computation[current][op.group(1)] += 1
        bodies.update(re.findall(r"body=%?([\w.\-]+)", line))
    inside, outside = Counter(), Counter()
    for name, ops in per_computation.items():
        (inside if name in bodies else outside).update(ops)
    return dict(inside), dict(outside)


def step_collectives_by_axis(strategy, batch):
    """{(op, "model"|"data"): count} in ``strategy``'s compiled step on a data x model mesh
    (a collective whose replica groups are the mesh's rows runs over ``model``)."""
    state = strategy.engine.init(jax.random.key(0), batch)
    hlo = strategy.engine.lower_step(state, strategy.engine.shard_batch(batch)).compile().as_text()
    rows = strategy.mesh.devices.reshape(-1, strategy.mesh.shape["model"])
    model_groups = "{" + ",".join("{" + ",".join(str(d.id) for d in row) + "}" for row in rows) + "}"
    counts = Counter()
    for line in hlo.splitlines():
        op = re.search(r" (all-reduce|all-gather|reduce-scatter)(?:-start)?\(", line)
        if op:
            groups = re.search(r"replica_groups=(\{\{[\d,{}]*\}\})", line)
            counts[(op.group(1), "model" if groups and groups.group(1) == model_groups else "data")] += 1
    return counts


@contextlib.contextmanager
def jax_compile_log(lines):
    """jax's "Finished tracing / lowering / compilation of ..." lines, appended to ``lines``."""
    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler, logger = Keep(), logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles(True):
            yield
    finally:
        logger.removeHandler(handler)


def compiles_of(lines, name: str) -> int:
    """How many times ``jit(name)`` was compiled in a compile log."""
    return sum(line.startswith(f"Finished XLA compilation of jit({name})") for line in lines)


def fake_gpus(monkeypatch):
    """``fake(n)``: torch sees n CUDA GPUs (0: no CUDA), and no backend override or rank variables
    are set: a GPU host wherever nothing has to compute on the GPUs (NCCL is never started)."""
    import torch

    from torch_ref.dist import BACKEND_ENV

    monkeypatch.delenv(BACKEND_ENV, raising=False)
    for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)

    def fake(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: f"Fake GPU {i}")
    return fake


def require_plugin():
    """Skip without JAX's CUDA plugin for compile-only GPU targets, or fail where CI asks for it
    (``JAXDP_REQUIRE_GPU_TARGET``)."""
    import os

    import pytest

    from jaxdp.runtime import target as gpu_target

    if os.path.exists(os.path.join(gpu_target.plugin_dir(), "jax_plugins", "xla_cuda12")):
        return
    message = f"JAX's CUDA plugin is not installed in {gpu_target.plugin_dir()}: make install-gpu-target"
    if os.environ.get("JAXDP_REQUIRE_GPU_TARGET"):
        pytest.fail(message)
    pytest.skip(message)
