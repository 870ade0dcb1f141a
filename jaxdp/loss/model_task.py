"""A loss that receives the model: ``loss_fn(model, params, model_state, batch, rng)``.

Tensor parallelism, pipeline stages and SyncBN each run a model jaxdp prepares, not the one
the user built: a copy split over the mesh's ``model`` axis (``model_axis="model"``), the
model's layers cut into stages (``jaxdp.parallel.staged.StagedModel``), or a copy whose
BatchNorm reduces over the data axes. A loss that closes over its own model cannot see that
copy; a loss whose first parameter is named ``model`` gets it, and applies it as usual:

    def loss_fn(model, params, model_state, batch, rng):
        logits = model.apply({"params": params, **model_state}, batch["x"])
        return loss(logits, batch["y"]), (model_state, {})

The same holds for ``eval_fn(model, params, model_state, batch)``. Without a model axis, a
stage axis or SyncBN, the model passed is the one given to ``jaxdp.Trainer``.
"""

import inspect
from typing import Callable, Optional

from flax import errors as flax_errors

from jaxdp.loss.task import as_task as plain_task


class OuterModelError(ValueError):
    """The loss applied another model than the one it received."""


def takes_model(fn: Optional[Callable]) -> bool:
    """Whether ``fn``'s first parameter is named ``model`` (the documented convention)."""
    if fn is None:
        return False
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return False
    return bool(params) and params[0].name == "model"


class ModelTask:
    """The user's ``loss_fn``/``eval_fn`` with the model they receive bound; ``with_model`` rebinds it."""

    def __init__(self, model, loss_fn: Callable, eval_fn: Optional[Callable], model_inputs: Callable,
                 init_kwargs: dict, prepared: bool = False):
        self.model, self.user_loss_fn, self.user_eval_fn = model, loss_fn, eval_fn
        self.prepared = prepared  # the model is jaxdp's copy (split, staged, SyncBN), not the user's own
        self.model_inputs, self.init_kwargs = model_inputs, init_kwargs
        if eval_fn is None:
            self.eval_fn = None
        elif takes_model(eval_fn):
            self.eval_fn = lambda params, model_state, batch: eval_fn(self.model, params, model_state, batch)
        else:
            self.eval_fn = eval_fn

    def with_model(self, model) -> "ModelTask":
        return ModelTask(model, self.user_loss_fn, self.user_eval_fn, self.model_inputs, self.init_kwargs,
                         prepared=True)

    def loss_fn(self, params, model_state, batch, rng=None):
        try:
            return self.user_loss_fn(self.model, params, model_state, batch, rng)
        except (flax_errors.ScopeParamShapeError, flax_errors.ScopeParamNotFoundError) as e:
            if not self.prepared:
                raise
            # The model itself takes these params (checked at init): the loss applied another one.
            raise OuterModelError(f"the params arrive laid out for the model loss_fn receives: apply that `model`, "
                                  f"not one from outside it ({str(e).split(' (https://')[0]})") from None


def as_task(model, loss_fn: Callable, eval_fn=None, model_inputs=None, init_kwargs=None):
    """A ``ModelTask`` for a loss that takes the model, else the plain task (``jaxdp.loss.task.as_task``)."""
    if not takes_model(loss_fn):
        return plain_task(loss_fn, eval_fn, model_inputs, init_kwargs)
    return ModelTask(model, loss_fn, eval_fn, model_inputs or (lambda batch: (batch,)), dict(init_kwargs or {}))
