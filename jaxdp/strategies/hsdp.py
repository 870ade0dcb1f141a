"""HSDP: ZeRO-3 within a shard group, plain data parallelism across groups.

The devices form an (R, S) mesh ("replica", "data"): R replicas of the model,
each sharded ZeRO-3 style over its S devices. Per device, against ``zero3.py``:

1. **new**: the params are cast to per-device along "replica" (the check_vma
   trap: replicated params would come back with gradients already summed over
   the replicas by an implicit psum);
2. gather-on-use within the group, as ZeRO-3; the backward reduce-scatters
   over "data", within the group;
3. **new**: the reduce-scattered chunks are all-reduced across replicas,
   ``psum(g / N, "replica")`` with N = R·S: DDP's average over all devices.

The batch is split over both axes, device (r, s) taking the (r·S + s)-th slice,
so batches and BN buffers (global device 0's) follow DDP exactly; SyncBN
normalises over both axes. Model state per device: (4 + 4 + K)Ψ/S. Traffic:
3Ψ·(S-1)/S within the group + 2(Ψ/S)·(R-1)/R across replicas.

The trainer hands every strategy a 1-D mesh; HSDP reshapes its devices to
``mesh_shape = (R, S)`` (default R = 2 when N is even, else R = 1, i.e. ZeRO-3),
so the trainer does not need to know about 2-D meshes.
"""

import jax
import numpy as np
from jax.sharding import Mesh

from jaxdp.mesh import DATA_AXIS, REPLICA_AXIS
from jaxdp.strategies.base import StrategyError, local_grads
from jaxdp.strategies.zero3 import GatherOnUse, ZeRO3


class HSDP(ZeRO3):
    name = "hsdp"
    batch_axes = (REPLICA_AXIS, DATA_AXIS)

    def __init__(self, model, tx, mesh, *, mesh_shape=None, **kwargs):
        super().__init__(model, tx, hsdp_mesh(mesh, mesh_shape), **kwargs)

    def averaged_grads(self, state, images, labels):
        params = jax.lax.pcast(state.params, REPLICA_AXIS, to="varying")  # new: each replica's own grads
        loss, grads, batch_stats, correct = local_grads(
            GatherOnUse(self), params, state.batch_stats, images, labels, self.accum_steps
        )
        # Reduce-scattered within the group by the gathers' transposes; new: all-reduced across replicas.
        grads = jax.lax.psum(jax.tree_util.tree_map(lambda g: g / self.num_devices, grads), REPLICA_AXIS)
        return loss, grads, batch_stats, correct


def hsdp_mesh(mesh, mesh_shape=None) -> Mesh:
    """The (replicas, shards) mesh over ``mesh``'s devices, in their order."""
    if mesh_shape is None and tuple(mesh.axis_names) == (REPLICA_AXIS, DATA_AXIS):
        return mesh
    devices = np.asarray(mesh.devices).reshape(-1)
    n = devices.size
    if mesh_shape is None:
        mesh_shape = (2, n // 2) if n % 2 == 0 else (1, n)
    mesh_shape = tuple(int(d) for d in mesh_shape)
    if len(mesh_shape) != 2 or min(mesh_shape) < 1 or mesh_shape[0] * mesh_shape[1] != n:
        raise StrategyError(f"hsdp mesh_shape {mesh_shape} must be two positive sizes R,S with R*S = {n} devices")
    return Mesh(devices.reshape(mesh_shape), (REPLICA_AXIS, DATA_AXIS))
