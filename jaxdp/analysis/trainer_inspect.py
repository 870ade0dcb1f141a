"""``Trainer.inspect``: a user's own Trainer, its step compiled for GPUs that are not there.

    trainer = jaxdp.Trainer(TinyLM(rngs=nnx.Rngs(0)), loss_fn, optax.adamw(3e-3), jaxdp.ZeRO(stage=3, units=(Block,)),
                            jaxdp.make_mesh(data=2))
    report = trainer.inspect(example_batch, target="h100", devices=8, hosts=2)   # 2 hosts x 8 H100s

The Trainer's strategy (its name, options, model, loss and optimizer) is built again over the
target's compile-only devices (``jaxdp.runtime.target``), with the Trainer's axis names whatever
mesh it was built on: a ``data`` mesh of all the target's GPUs, or HSDP's ``replica x data``
(one shard group per host, ``MeshDims.hsdp_default``); the example batch keeps its rows per
device. The report is ``measure``'s: what ``jaxdp inspect --target ... --json`` prints (and
``jaxdp inspect --trainer MODULE:FUNCTION`` prints this one). Data-parallel meshes only: a
``model`` or ``stage`` axis is refused in one line.
"""

import dataclasses
from typing import Callable, Optional

import jax
import numpy as np

from jaxdp.analysis.measure import InspectError, measure
from jaxdp.analysis.options import InspectOptions
from jaxdp.analysis.plot import require_matplotlib
from jaxdp.runtime.mesh import MODEL_AXIS, REPLICA_AXIS, STAGE_AXIS, MeshDims, make_mesh
from jaxdp.runtime.target import Target, compile_only_devices

TRAINER_FIELDS = ("compile", "schedule", "plot", "seed", "batch_per_device")  # what a Trainer's inspect takes


def inspect_trainer(strategy, strategy_on: Callable, example_batch, target, devices: Optional[int] = None,
                    hosts: Optional[int] = None, **fields) -> dict:
    """The report of ``strategy`` (a Trainer's) compiled for ``target`` (a name, with ``devices`` GPUs per
    host on ``hosts`` hosts, or a ``Target``). ``strategy_on(mesh)``: the same strategy built on another
    mesh. ``fields``: ``TRAINER_FIELDS`` of ``InspectOptions``."""
    unknown = sorted(set(fields) - set(TRAINER_FIELDS))
    if unknown:
        raise TypeError(f"inspect() got unexpected options {unknown}; it takes {', '.join(TRAINER_FIELDS)}")
    target = target if isinstance(target, Target) else Target.parse(target, devices, hosts)
    how = InspectOptions(target=target, **fields)
    if how.plot:
        require_matplotlib()
    on_target = strategy_on(target_mesh(strategy.mesh, target))
    batch = batch_for(example_batch, strategy.num_devices, on_target.num_devices, how.batch_per_device)
    return measure(on_target, batch, seed=how.seed, compile=how.compile, schedule=how.schedule, target=target,
                   plot=how.plot)


def target_mesh(mesh, target: Target):
    """``mesh``'s axes over the target's compile-only GPUs: ``data`` over all of them, or ``replica x
    data`` as HSDP shards by default (within a host, replicated across hosts)."""
    dims = MeshDims.of(mesh)
    if dims.size(MODEL_AXIS) > 1 or dims.size(STAGE_AXIS) > 1:
        raise InspectError("inspect compiles a Trainer for a GPU target on data-parallel meshes (data, or "
                           "replica x data); this one has model or stage axes")
    devices = compile_only_devices(target)
    if REPLICA_AXIS in mesh.axis_names:
        replicas, shards = MeshDims.hsdp_default(target.devices, target.hosts)
        return make_mesh(replica=replicas, data=shards, devices=devices)
    return make_mesh(data=target.devices, devices=devices)


def batch_for(example_batch, devices: int, target_devices: int, batch_per_device: Optional[int] = None):
    """The example batch's rows per device (or ``batch_per_device``) on ``target_devices``: its rows
    repeated (a target's step reads only shapes)."""
    leaves = jax.tree_util.tree_leaves(example_batch)
    rows = int(np.shape(leaves[0])[0]) if leaves else 0
    per_device = batch_per_device or rows // devices
    if per_device < 1:
        raise InspectError(f"the example batch has {rows} rows for {devices} devices: give batch_per_device=")
    wanted = per_device * target_devices
    return jax.tree_util.tree_map(lambda x: np.take(np.asarray(x), np.arange(wanted) % rows, axis=0), example_batch)


def without_mesh_shape(options: dict, config):
    """A strategy's keyword options and typed config without hsdp's ``mesh_shape``: a target's mesh
    names its replicas itself."""
    options = {k: v for k, v in options.items() if k != "mesh_shape"}
    if config is not None and getattr(config, "mesh_shape", None) is not None:
        config = dataclasses.replace(config, mesh_shape=None)
    return options, config
