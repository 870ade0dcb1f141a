"""ZeRO-2: ZeRO-1 with the gradients reduce-scattered instead of all-reduced.

Per device, against ``zero1.py``, one line moves: the bucketed all-reduce
``psum(g / N)`` becomes a bucketed reduce-scatter ``psum_scatter(g / N)``, so
each device receives (and keeps) only the averaged chunk it updates. The
reduction is elementwise, so every chunk equals the matching slice of DDP's
average. (torch FSDP reduce-scatters with AVG; dividing first is DDP's form.)

Model state per device: params 4Ψ + grads 4Ψ/N + optimizer KΨ/N. Traffic:
reduce-scatter Ψ + all-gather Ψ = 2Ψ·(N-1)/N per device, the same as DDP.

Accumulation (``accum_steps`` K) sums the local gradients over the K
micro-batches, as DDP's ``no_sync``, and reduce-scatters once; the full local
gradient lives only during the step.
"""

import jax
import optax

from jaxdp.strategies import flat
from jaxdp.strategies.base import ddp_buffers, local_grads, train_metrics
from jaxdp.strategies.zero1 import ZeRO1


class ZeRO2(ZeRO1):
    name = "zero2"

    def averaged_grads(self, state, images, labels):
        params = jax.lax.pcast(state.params, self.axis, to="varying")
        loss, grads, batch_stats, correct = local_grads(
            self.model, params, state.batch_stats, images, labels, self.accum_steps
        )
        return loss, self.reduce_scatter(grads), batch_stats, correct  # was: all_reduce

    def local_step(self, state, images, labels):
        loss, grads, batch_stats, correct = self.averaged_grads(state, images, labels)
        mine = self.my_chunks
        updates, opt_state = self.tx.update(grads, state.opt_state, mine(state.params))  # grads: already mine
        new_state = state.replace(
            step=state.step + 1,
            params=self.gather(optax.apply_updates(mine(state.params), updates)),
            batch_stats=ddp_buffers(batch_stats, self.axis, self.sync_bn),
            opt_state=opt_state,
        )
        return new_state, train_metrics(loss, correct, images.shape[0], self.axis,
                                        self.gather(grads) if self.return_grads else None)

    def reduce_scatter(self, grads):
        """Each device's chunk of the averaged gradient ``psum_scatter(g / N)``, one collective per DDP bucket."""
        scaled = jax.tree_util.tree_map(lambda g: g / self.num_devices, grads)
        return flat.scatter_tree(scaled, self.axis, self.shards, self.bucket_groups(self.shapes))
