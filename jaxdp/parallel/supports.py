"""What a model can do on a mesh, and the one check that refuses the rest.

Beside data parallelism a mesh can ask three things of a model: a ``model`` axis (tensor
parallelism), a ``stage`` axis (pipeline stages), and ``sync_bn`` (BatchNorm statistics reduced
over the batch axes). A model declares which it takes, ``supports`` reads it:

- a Flax Linen model by the protocol it follows (``jaxdp.parallel.protocol``): a tensor-parallel
  plan and a ``model_axis`` field its layers split by; a ``pipeline_layers()`` method; a
  BatchNorm that takes its reduction axes as ``bn_axis_name``;
- a Flax NNX model none of them: a built ``nnx.Module`` cannot be cloned split over a mesh axis
  the way jaxdp prepares a Linen model, and ``nnx.BatchNorm(axis_name=...)`` reduces over the
  devices itself.

``refusal`` is the one check: the Trainer asks it first, and every strategy when it is built (so
the parity harness, which builds strategies itself, meets it too). Its line names the user's class
(never jaxdp's ``NNXModel`` that carries an NNX module) and the fix.
"""

from dataclasses import dataclass
from typing import Optional

from jaxdp.loss.nnx_state import is_nnx
from jaxdp.loss.nnx_task import NNXModel
from jaxdp.parallel import tensor
from jaxdp.runtime.mesh import MODEL_AXIS, STAGE_AXIS, MeshDims


@dataclass(frozen=True)
class Supports:
    """What one model takes on a mesh beside data parallelism: None where it does, else why not (one line)."""

    name: str  # the user's class
    model_axis: Optional[str]
    stage_axis: Optional[str]
    sync_bn: Optional[str]


def supports(model, mesh, tp_plan=None) -> Supports:
    """What ``model`` (a Linen module, an ``nnx.Module``, or the ``NNXModel`` carrying one) takes on
    ``mesh``; ``tp_plan``: the strategy's own tensor-parallel plan, if given."""
    module = model.module if isinstance(model, NNXModel) else model
    name = type(module).__name__
    if is_nnx(module):
        split = (f"tensor and pipeline parallelism split Flax Linen models (jaxdp.parallel.protocol), and {name} is "
                 "an nnx.Module; train an nnx.Module data-parallel, on a mesh of data axes (jaxdp.make_mesh(data=N)): "
                 "ZeRO-3 with units shards its params and gathers them block by block")
        return Supports(name, split, split, (
            f"sync_bn swaps a Linen model's BatchNorm for one that reduces over the data axes; {name}, an "
            "nnx.Module, does it itself: build it with nnx.BatchNorm(..., axis_name='data') and leave sync_bn off"))
    return Supports(name, _model_axis(model, name, MeshDims.of(mesh).size(MODEL_AXIS), tp_plan),
                    None if hasattr(model, "pipeline_layers") else (
                        f"{name} has no pipeline plan for the mesh's stage axis: give it a `pipeline_layers()` method "
                        "that lists its layers (docs/strategies.md, jaxdp.parallel.protocol)"),
                    None if hasattr(model, "bn_axis_name") else (
                        f"sync_bn needs a model whose BatchNorm takes its reduction axes as `bn_axis_name`; {name} "
                        "has no such field: give it one (as jaxdp's ResNet) or leave sync_bn off"))


def _model_axis(model, name: str, size: int, tp_plan) -> Optional[str]:
    """Why a Linen model cannot run split ``size`` ways over the model axis, or None."""
    if size == 1:
        return None  # no model axis to split over
    if (tp_plan if tp_plan is not None else tensor.plan_of(model, size)) is None:
        return (f"{name} has no tensor-parallel plan for the mesh's model axis: give its class a TP_PLAN = {{path "
                "pattern: Column() or Row()}} (docs/strategies.md, jaxdp.parallel.protocol) or pass tp_plan=")
    reason = model.check_model_split(size) if hasattr(model, "check_model_split") else None
    if reason:
        return reason
    if not hasattr(model, "model_axis"):
        return (f"{name} cannot run split over the model axis: give it a field `model_axis: Optional[str] = None` "
                "that its layers split by (docs/strategies.md, jaxdp.parallel.protocol)")
    return None


def refusal(model, mesh, sync_bn: bool = False, tp_plan=None) -> Optional[str]:
    """The one line refusing what ``model`` cannot do on ``mesh`` (with ``sync_bn``), or None."""
    dims = MeshDims.of(mesh)
    if dims.size(MODEL_AXIS) == 1 and dims.size(STAGE_AXIS) == 1 and not sync_bn:
        return None  # data parallelism only: every model takes it (and nothing is read of it)
    s = supports(model, mesh, tp_plan)
    for asked, why_not in ((dims.size(MODEL_AXIS) > 1, s.model_axis), (dims.size(STAGE_AXIS) > 1, s.stage_axis),
                           (sync_bn, s.sync_bn)):
        if asked and why_not:
            return why_not
    return None
