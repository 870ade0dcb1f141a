"""The Python API's input checks: one line that names the fix, before anything compiles.

``batch_rows`` and ``batch_splits`` run on every host batch the Trainer places (shapes only). ``loss_fn`` runs once, at
``init`` or ``restore``: the user's loss is traced abstractly (``jax.eval_shape``, nothing
computed) on one device's micro-batch, and its output is checked against the contract
``(loss, (model_state, metrics))``. A loss that only runs inside the mesh (it reduces over the
batch axes) cannot be traced outside it: its check is left to the step.
"""

import jax
import numpy as np

from jaxdp.loss import nnx_state, nnx_task
from jaxdp.loss.arraylike import is_array
from jaxdp.strategies.layout import shapes_of

CONTRACT = "loss_fn must return (loss, (model_state, metrics))"


class UsageError(ValueError):
    """A batch or a loss_fn that cannot work with the Trainer; the message names the fix."""


def batch_rows(trainer_batch) -> int:
    """The rows every leaf of a host batch shares (checked before the batch is split)."""
    leaves = jax.tree_util.tree_leaves_with_path(trainer_batch)
    if not leaves:
        raise UsageError("the batch has no arrays: pass a pytree of arrays with a leading batch dimension")
    rows = {jax.tree_util.keystr(path) or "batch": (np.shape(x)[0] if np.ndim(x) else None) for path, x in leaves}
    if None in rows.values():
        scalar = next(name for name, r in rows.items() if r is None)
        raise UsageError(f"batch leaf {scalar} is a scalar: every leaf needs a leading batch dimension")
    if len(set(rows.values())) > 1:
        listed = ", ".join(f"{name}: {r}" for name, r in rows.items())
        raise UsageError(f"batch leaves have different numbers of rows ({listed}): "
                         "every leaf needs the same leading batch dimension")
    return next(iter(rows.values()))


def batch_splits(size: int, num_devices: int, accum_steps: int = 1) -> None:
    """A host batch of ``size`` rows splits evenly over this process's devices and the micro-batches."""
    local = max(1, num_devices // jax.process_count())  # each process passes its own rows
    need = local * accum_steps
    if size % need:
        per = f"{local} device(s)" + (f" x {accum_steps} accumulation steps" if accum_steps > 1 else "")
        lower, upper = size // need * need, (size // need + 1) * need
        raise UsageError(f"a batch of {size} rows does not split over {per}: use a multiple of {need} "
                         f"(e.g. {upper}{f' or {lower}' if lower else ''})")


def loss_fn(strategy, example_batch, default_inputs: bool) -> None:
    """Trace the user's ``loss_fn`` abstractly and check what it returns.

    ``default_inputs``: the Trainer got no ``model_inputs``, so ``model.init`` receives the whole
    batch; if that fails on a batch that is not one array, the fix is ``model_inputs``.
    """
    abstract = shapes_of(example_batch)
    try:
        variables = jax.eval_shape(strategy.init_fn, jax.random.key(0), abstract)
    except Exception as e:  # the user's model: name the likely fix, else let its error through
        if default_inputs and not is_array(example_batch):
            key = repr(next(iter(example_batch))) if isinstance(example_batch, dict) and example_batch else "0"
            raise UsageError(
                f"model.init failed on the whole {type(example_batch).__name__} batch ({_first_line(e)}): pass "
                f"model_inputs=lambda batch: (batch[{key}],) to Trainer, the model's inputs taken from a batch"
            ) from None
        raise
    variables = dict(variables)
    params = variables.pop("params", {})
    micro = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct((_micro_rows(s.shape[0], strategy),) + s.shape[1:],
                                                                  s.dtype), abstract)
    try:
        out = jax.eval_shape(strategy.task.loss_fn, params, variables, micro, jax.random.key(0))
    except NameError:  # an axis name (psum over the batch axes): it runs only inside the mesh
        return
    except (nnx_task.NNXLossError, nnx_state.NNXStateError) as e:  # an NNX loss's or model's own check
        raise UsageError(str(e)) from None
    check_output(out)


def check_output(out) -> None:
    """The abstract output of ``loss_fn`` has the contract's structure, a scalar loss and dict metrics."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        got = "a single array" if is_array(out) else type(out).__name__
        raise UsageError(f"{CONTRACT}; it returned {got}: return loss, (model_state, {{}})")
    loss, aux = out
    if not isinstance(aux, (tuple, list)) or len(aux) != 2:
        got = f"(loss, {type(aux).__name__})" if not is_array(aux) else "(loss, array)"
        raise UsageError(f"{CONTRACT}; it returned {got}: return loss, (model_state, metrics)")
    if not is_array(loss) or np.shape(loss) != ():
        raise UsageError(f"loss_fn's loss must be a scalar, got shape {np.shape(loss)}: "
                         "reduce it over the batch (e.g. losses.mean())")
    metrics = aux[1]
    if not isinstance(metrics, dict):
        got = "an array" if is_array(metrics) else type(metrics).__name__
        raise UsageError(f"loss_fn's metrics must be a dict of scalars, got {got}: "
                         "return loss, (model_state, {'name': value}) ({} for none)")


def _micro_rows(rows: int, strategy) -> int:
    """One device's micro-batch rows for a global batch of ``rows`` (at least 1)."""
    return max(1, rows // (strategy.num_devices * strategy.options.accum_steps))


def _first_line(e: BaseException, limit: int = 300) -> str:
    """The gist of the model's error: its first line, capped."""
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    return line if len(line) <= limit else line[:limit] + "..."


