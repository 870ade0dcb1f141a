"""How your own Flax model runs split over the mesh's ``model`` and ``stage`` axes: the
protocol jaxdp's ViT, ResNet and toy model follow (docs/strategies.md, "Model parallelism for
your own model"; ``examples/custom_model_parallel.py`` shows it whole).

Tensor parallelism (``make_mesh(data=2, model=2)``):

- ``model_axis: Optional[str] = None``, a field: inside the step jaxdp runs
  ``model.clone(model_axis="model")``; at init it stays None and the whole model is built.
- a plan, ``{variable path pattern: Column() | Row()}``: ``TP_PLAN`` (or a method
  ``tp_plan(size)``) on the model's class or in its module, or ``tp_plan=`` as a strategy
  option. Paths are fnmatch patterns on ``collection/module/.../name``.
- the layers split themselves: a column-parallel layer makes ``column_features(features,
  self.model_axis)`` output features; the row-parallel layer after it sums its product over
  the axis (``dot_general=row_parallel(self.model_axis)``) and adds its bias once, after the sum.

Pipeline stages (``make_mesh(data=2, stage=2)``): ``pipeline_layers()`` returns the forward
as an ordered list of ``jaxdp.parallel.pipeline.Layer(name, paths, apply)``, each layer
owning whole params subtrees (``paths``) and mapping one activation to the next.

The loss takes the model jaxdp prepared as its first argument (``jaxdp.loss.model_task``).

``check_split`` turns a model that does not follow the protocol into one line, before the
first step compiles: a layer left whole where the plan cuts it, or a row-parallel layer
whose partial sums are never added up.
"""

import re
from typing import Optional

import jax
from jax.custom_derivatives import SymbolicZero
from flax import errors as flax_errors
from jax.sharding import PartitionSpec as P

from jaxdp.parallel.tensor import TensorParallelError, model_axis_size, summed_over

GUIDE = ("build column-parallel layers with column_features(features, self.model_axis) outputs and row-parallel ones "
         "with dot_general=row_parallel(self.model_axis) (jaxdp.parallel.protocol, docs/strategies.md)")


def column_features(features: int, axis: Optional[str]) -> int:
    """A column-parallel layer's output features on one model device (all of them without an axis)."""
    return features // model_axis_size(axis)


def row_parallel(axis: Optional[str], op=jax.lax.dot_general):
    """``dot_general=`` (or ``conv_general_dilated=`` with ``op``) for a row-parallel layer: its
    product summed over ``axis``; None (the layer's own) without an axis."""
    return None if axis is None else summed_over(axis, op)


def check_split(model, variables, specs, batch, model_inputs, mesh, axis: str, size: int, apply_kwargs) -> None:
    """Apply ``model`` (already cloned with ``model_axis``) to ``variables`` cut as ``specs`` say
    and ``model_inputs(batch)``, shapes only, on ``mesh``; raise ``TensorParallelError`` in one line if it does not take its
    slices or if its output still differs per model device. Other failures are left to the step."""
    name, varying = type(model).__name__, []

    def local(variables, batch):
        out = model.apply(variables, *model_inputs(batch), rngs={"dropout": jax.random.key(0)}, **apply_kwargs)
        varying.extend(axis in varying_axes(x) for x in jax.tree_util.tree_leaves(out))
        return 0.0

    try:
        jax.eval_shape(jax.shard_map(local, mesh=mesh, in_specs=(specs, P()), out_specs=P()), variables, batch)
    except flax_errors.ScopeParamShapeError as e:
        raise TensorParallelError(f"{name} does not split itself over {axis}={size}: {_mismatch(str(e))}; "
                                  f"{GUIDE}") from None
    except Exception:  # noqa: BLE001 - not a split problem: the step reports it as it is
        return
    if any(varying):
        raise TensorParallelError(f"{name}'s output differs on each {axis} device: a row-parallel layer's product "
                                  f"is never summed over {axis!r}; {GUIDE}")


def _mismatch(message: str) -> str:
    """Flax's ScopeParamShapeError, said in terms of the split."""
    found = re.search(r'parameter "(.+?)" in "(.+?)".*?shape (\(.*?\)),.*?shape (\(.*?\))', message)
    if not found:
        return message.split(" (https://")[0]
    param, scope, built, given = found.groups()
    return f"params{scope}/{param} is {given} on each device (its plan's cut), but the model builds it {built}"


def varying_axes(x) -> frozenset:
    """The mesh axes ``x`` (an array, or a ``custom_vjp``'s symbolic zero cotangent) varies over inside
    shard_map (jax 0.10: ``aval.mat.varying``)."""
    aval = x.aval if isinstance(x, SymbolicZero) else jax.typeof(x)
    vma = getattr(aval, "vma", None)
    return frozenset(vma if vma is not None else aval.mat.varying)
