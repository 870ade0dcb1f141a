"""The loss contract for a Flax NNX model: ``loss_fn(model, batch, rng) -> loss | (loss, metrics)``.

NNX's own form: ``model`` is the user's ``nnx.Module`` holding this step's state, called as in a
plain NNX loop; the loss returns the loss, or the loss and a dict of scalar metrics
(``loss_fn(model, batch)`` takes no key).
``eval_fn(model, batch) -> {name: per-device sum}`` likewise. The strategies train the
contract of ``jaxdp.loss.task`` (``loss_fn(params, model_state, batch, rng)``), so each call
merges the module from the strategy's variables (``nnx_state.Parts``), runs the user's loss on
it, and reads back what the forward updated (``nnx.BatchStat``, ``nnx.RngCount``):

- **BatchNorm statistics** update as in a plain NNX loop, on each device's rows; the strategy
  keeps device 0's (DDP's buffers), as for a Linen model.
- **The model's own ``nnx.Rngs`` streams** (dropout) draw as in a plain NNX loop: key
  ``fold_in(stream key, count)``, the count advancing with each draw and carried in the state
  (``rng_counts``). Device 0 draws from the model's own keys, so one device draws exactly what a
  plain NNX loop draws; device ``d`` > 0 from ``fold_in(key, d)``, so no two devices share a
  mask. Micro-batches continue the count. A resumed run restores the counts with the state and
  takes the keys from the model it is given: built with the same seeds, it draws what the
  uninterrupted run would have.
- ``rng``: a key unique to the step, the device and the micro-batch (``Strategy.step_key``), as
  for a Linen loss, for draws the loss makes itself (``model(x, rngs=rng)``).

The model runs in the mode it had when the Trainer was made (``model.train()`` first, as before
a plain NNX loop); a loss may switch it (``model.eval()`` in ``eval_fn``).

What a step tells the loss, it tells explicitly, on a copy of the task made for that step: the
batch axes the device's index is taken over (``on_device``; outside a step, and in evaluation,
every device draws device 0's streams), and ZeRO-3's ``run_unit`` (``running_units``), which the
FSDP units of the model ZeRO-3 set up (``with_model``: each unit wrapped once, ``nnx_wrap``)
run through.
"""

import copy
import inspect
from typing import Callable, Optional, Sequence

import numpy as np

from jaxdp.loss.arraylike import is_array
from jaxdp.loss import nnx_wrap
from jaxdp.loss.nnx_state import Parts, keys_on_device
from jaxdp.loss.nnx_wrap import Path
from jaxdp.loss.reductions import device_index

LOSS_FORM = "loss_fn(model, batch, rng) -> loss or (loss, metrics)"
LINEN_FORM = "loss_fn(params, model_state, batch, rng) -> (loss, (model_state, metrics))"


class NNXLossError(ValueError):
    """A loss or model that cannot run as an NNX loss: one line that names the fix."""


class NNXModel:
    """An ``nnx.Module`` in the shape the strategies take a model: ``init`` gives its variables
    (``{"params", "batch_stats", "rng_counts"}``, as its constructor built them: nothing is
    drawn again) and ``merge`` a module holding given ones."""

    def __init__(self, module, units: Sequence[Path] = ()):
        self.module = module  # the user's, left as it is
        self.units = tuple(units)  # the FSDP units' paths (``nnx.iter_modules``'): each wrapped in the merged graph
        graph, names = nnx_wrap.wrapped(module, self.units) if self.units else (module, tuple)
        self.parts = Parts(graph, names=names)

    # Unhashable: the engine caches a Linen model's init program by model (engine._init_key); an NNX
    # model's only places the values it is given, and an entry would keep every module alive.
    __hash__ = None

    def with_units(self, units: Sequence[Path]) -> "NNXModel":
        """The same model, its submodules at ``units`` FSDP units (``nnx_wrap``): the same variables."""
        return NNXModel(self.module, units)

    def init(self, rng=None, *args, **kwargs):
        return self.parts.variables()

    def merge(self, variables, keys=None, run_unit: Optional[Callable] = None):
        """A module holding ``variables``; its units run through ``run_unit`` (``nnx_wrap.arm``), if given."""
        module = self.parts.merge(variables, keys)
        if run_unit is not None:
            nnx_wrap.arm(module, self.units, run_unit)
        return module

    def variables(self, module) -> dict:
        return self.parts.variables(module)


class NNXTask:
    """The user's NNX ``loss_fn``/``eval_fn`` as ``jaxdp.loss.task``'s contract."""

    init_kwargs: dict = {}
    batch_axes = None  # a step's (``on_device``): the device draws from its own rng streams; None: device 0's
    run_unit: Optional[Callable] = None  # ZeRO-3's, in its step (``running_units``)

    def __init__(self, model: NNXModel, loss_fn: Callable, eval_fn: Optional[Callable] = None):
        self.model, self.user_loss_fn, self.user_eval_fn = model, loss_fn, eval_fn
        names = positional(loss_fn)
        self.loss_takes_rng = names is None or len(names) >= 3  # loss_fn(model, batch) draws nothing of jaxdp's

    @staticmethod
    def model_inputs(batch):
        return (batch,)

    @property
    def eval_fn(self) -> Optional[Callable]:
        """``eval_fn(params, model_state, batch)``, or None without the user's (a property: a step's copy
        of the task evaluates as that copy)."""
        return None if self.user_eval_fn is None else self._eval

    def with_model(self, model: NNXModel) -> "NNXTask":
        """The same losses on ``model`` (ZeRO-3's, its units wrapped: ``NNXModel.with_units``)."""
        return NNXTask(model, self.user_loss_fn, self.user_eval_fn)

    def on_device(self, batch_axes) -> "NNXTask":
        """This task as a step runs it on one device: the model draws from that device's rng streams,
        by its index over ``batch_axes`` (this module's docstring)."""
        return self._with(batch_axes=batch_axes)

    def running_units(self, run_unit: Callable) -> "NNXTask":
        """This task with the model's FSDP units run through ``run_unit(at, call, variables, mutable,
        args, kwargs) -> (out, updated collections)`` (``nnx_wrap.UnitWrapper``)."""
        return self._with(run_unit=run_unit)

    def _with(self, **fields) -> "NNXTask":
        task = copy.copy(self)
        vars(task).update(fields)
        return task

    def loss_fn(self, params, model_state, batch, rng=None):
        module = self._merged(params, model_state)
        out = self._run(self.user_loss_fn, module, batch, *((rng,) if self.loss_takes_rng else ()))
        loss, metrics = _loss_and_metrics(out)
        new_state = self.model.variables(module)
        new_state.pop("params", None)
        return loss, (new_state, metrics)

    def _eval(self, params, model_state, batch):
        return self._run(self.user_eval_fn, self._merged(params, model_state), batch)

    def _merged(self, params, model_state):
        keys = self.model.parts.keys
        if keys:  # the device's own streams (this module's docstring)
            keys = keys_on_device(keys, 0 if self.batch_axes is None else device_index(self.batch_axes))
        return self.model.merge({"params": params, **model_state}, keys, self.run_unit)

    @staticmethod
    def _run(fn, module, *args):
        try:
            return fn(module, *args)
        except (ValueError, AttributeError, KeyError) as e:
            error = _rng_error(e)
            if error is None:
                raise
            raise error from None


def _loss_and_metrics(out):
    """(loss, metrics) from what an NNX loss returns: ``loss`` or ``(loss, metrics)``."""
    if is_array(out):
        loss, metrics = out, {}
    elif isinstance(out, (tuple, list)) and len(out) == 2 and is_array(out[0]):
        loss, metrics = out
    else:
        got = type(out).__name__ + (f" of {len(out)}" if isinstance(out, (tuple, list)) else "")
        raise NNXLossError(f"{LOSS_FORM}; it returned a {got}: return loss, or (loss, {{'name': value}})")
    if np.shape(loss) != ():
        raise NNXLossError(f"loss_fn's loss must be a scalar, got shape {np.shape(loss)}: reduce it over the batch "
                           "(e.g. losses.mean())")
    if not isinstance(metrics, dict):
        raise NNXLossError(f"loss_fn's metrics must be a dict of scalars, got {type(metrics).__name__}: "
                           "return loss, {'name': value}")
    return loss, metrics


def _rng_error(e: BaseException) -> Optional[NNXLossError]:
    """One line for a model that draws from ``nnx.Rngs`` it was not given (NNX's own error is a
    paragraph or an attribute error deep in the model); None for any other error."""
    text = str(e)
    if "no `rngs` argument was provided" in text or "No RngStream named" in text:
        gist = " ".join(text.split())[:160]
        return NNXLossError(f"the model draws random numbers from nnx.Rngs it was not given ({gist}): build it "
                            "with the streams it draws (nnx.Rngs(params=0, dropout=1)), pass one in the call "
                            "(model(x, rngs=rng), the loss's own key), or run it deterministic")
    return None



# ----------------------------------------------------------------------------- the loss's form

def positional(fn) -> Optional[list]:
    """The names of ``fn``'s positional parameters; None if it has no signature to read or takes ``*args``."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def is_nnx_form(fn) -> bool:
    """``fn`` reads as ``loss_fn(model, batch[, rng])``: NNX's form (the Linen forms take 4 or 5)."""
    names = positional(fn)
    return names is not None and 2 <= len(names) <= 3


def as_task(model: NNXModel, loss_fn: Callable, eval_fn=None) -> NNXTask:
    """The NNX task, or ``NNXLossError`` in one line for a loss (or eval_fn) in the Linen form."""
    names = positional(loss_fn)
    if names is not None and len(names) >= 4:
        raise NNXLossError(f"the model is an nnx.Module, whose loss is {LOSS_FORM}; this loss_fn takes "
                           f"({', '.join(names)}), the Flax Linen form ({LINEN_FORM}): take the module and call it")
    eval_names = None if eval_fn is None else positional(eval_fn)
    if eval_names is not None and len(eval_names) >= 3:
        raise NNXLossError(f"the model is an nnx.Module, whose eval_fn is eval_fn(model, batch) -> {{name: sum}}; "
                           f"this one takes ({', '.join(eval_names)}), the Flax Linen form")
    return NNXTask(model, loss_fn, eval_fn)


def linen_refusal(loss_fn) -> Optional[str]:
    """The one line for a Linen model given an NNX-form loss, else None."""
    if not is_nnx_form(loss_fn):
        return None
    return (f"the model is a Flax Linen module, whose loss is {LINEN_FORM} (or loss_fn(model, params, model_state, "
            f"batch, rng)); this loss_fn takes ({', '.join(positional(loss_fn))}), the NNX form: apply the model "
            "to params, or give the Trainer an nnx.Module")
