"""ZeRO-1: DDP with the optimizer state sharded over the data axis.

Per device, against ``ddp.py``:

1. forward/backward and the bucketed all-reduce ``psum(g / N)``: as DDP;
2. **new**: each device takes its 1/N chunk of every (flat, padded) gradient
   and parameter and runs the optimizer on that chunk with its 1/N of the
   optimizer state (see ``flat.py`` for the layout);
3. **new**: the updated chunks are all-gathered, bucket by bucket, into the
   full replicated params.

Model state per device: params 4Ψ + grads 4Ψ + optimizer KΨ/N (f32; K = 4 for
SGD momentum, 8 for Adam). Traffic: all-reduce Ψ + all-gather Ψ, i.e. 3Ψ·(N-1)/N
per device in ring terms, as torch's ``ZeroRedundancyOptimizer`` (DDP's
all-reduce, then a broadcast of each rank's updated params). ZeRO-2 replaces
the all-reduce by a reduce-scatter and gets to 2Ψ.

This class also owns the sharded-state bookkeeping the later stages inherit:
where each part lives (``state_specs``), and the conversion to and from DDP's
layout (``canonical``/``from_canonical``) for parity checks and inspection.
(Checkpoints use ZeRO-3's layout, ``Strategy.stored``: nothing is gathered to save.)
Only elementwise optimizers shard this way (all of ``jaxdp.optim``'s do); a
global-norm clip would see only a chunk.
"""

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxdp.state import TrainState
from jaxdp.strategies import flat
from jaxdp.strategies.base import StrategyError, ddp_buffers, local_grads, train_metrics
from jaxdp.strategies.ddp import DDP


class ZeRO1(DDP):
    name = "zero1"
    flat_opt_state = True  # ZeRO-3 keeps the params flat and sharded at rest too

    def __init__(self, model, tx, mesh, *, bucket_cap_mb=None, **kwargs):
        # An explicit signature: DDP-only options (compression, ring all-reduce) are not ZeRO's.
        super().__init__(model, tx, mesh, bucket_cap_mb=bucket_cap_mb, **kwargs)

    # -- per device -----------------------------------------------------------------------------
    def averaged_grads(self, state, images, labels):
        """(loss, the averaged gradient this device keeps, BN stats, correct): DDP's full average."""
        params = jax.lax.pcast(state.params, self.axis, to="varying")
        loss, grads, batch_stats, correct = local_grads(
            self.model, params, state.batch_stats, images, labels, self.accum_steps
        )
        grads, _ = self.all_reduce(grads)  # as DDP
        return loss, grads, batch_stats, correct

    def local_step(self, state, images, labels):
        loss, grads, batch_stats, correct = self.averaged_grads(state, images, labels)
        mine = self.my_chunks
        updates, opt_state = self.tx.update(mine(grads), state.opt_state, mine(state.params))
        new_state = state.replace(
            step=state.step + 1,
            params=self.gather(optax.apply_updates(mine(state.params), updates)),
            batch_stats=ddp_buffers(batch_stats, self.axis, self.sync_bn),
            opt_state=opt_state,
        )
        return new_state, train_metrics(loss, correct, images.shape[0], self.axis,
                                        grads if self.return_grads else None)

    def my_chunks(self, tree):
        """This device's chunk of every tensor of a tree all devices hold whole."""
        return jax.tree_util.tree_map(lambda x: flat.my_chunk(x, self.axis, self.shards), tree)

    def gather(self, chunks):
        """Full tensors from every device's chunks: one all-gather per DDP-sized bucket."""
        return flat.gather_tree(chunks, self.shapes, self.axis, self.bucket_groups(self.shapes))

    # -- placement and the canonical (DDP) layout ----------------------------------------------
    def state_specs(self, state):
        shard = P(self.axis)
        return state.replace(
            step=P(), batch_stats=P(), extra=P(),
            params=shard if self.flat_params else P(),
            opt_state=flat.opt_state_specs(state.opt_state, shard, P()),
        )

    def init_state(self, variables) -> TrainState:
        params = variables["params"]
        return self.from_canonical(TrainState(
            step=jnp.zeros((), jnp.int32), params=params, batch_stats=variables.get("batch_stats", {}),
            opt_state=self.tx.init(params), extra=None,
        ))

    def from_canonical(self, state: TrainState) -> TrainState:
        """DDP's layout -> this strategy's, for this mesh (any N)."""
        if state.extra is not None:
            raise StrategyError(f"{self.name} keeps no extra state, the checkpoint has some")
        self.shapes = flat.shapes_of(state.params)
        # Onto this mesh first: a plain transfer, where jit would compile a resharding per tensor shape.
        state = jax.device_put(state, NamedSharding(self.mesh, P()))
        return flat.to_flat_state(state, self.tx, self.shards, self.state_shardings,
                                  params=self.flat_params, opt_state=True)

    def canonical(self, state: TrainState) -> TrainState:
        """This layout -> DDP's: full params and optimizer state, replicated."""
        if self.shapes is None:
            raise StrategyError(f"{self.name}: build the state with init_state/from_canonical first")
        replicated = NamedSharding(self.mesh, P())
        return flat.from_flat_state(state, self.tx, self.shapes, lambda s: jax.tree_util.tree_map(lambda _: replicated, s),
                                    params=self.flat_params, opt_state=True)
