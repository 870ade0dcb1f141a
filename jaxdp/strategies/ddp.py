"""DDP: replicated params and optimizer state, gradients all-reduced in buckets.

The torch ``DistributedDataParallel`` recipe, per device:

1. forward/backward on the local shard (accumulating over ``accum_steps``
   micro-batches with no communication, as under ``no_sync``);
2. one all-reduce per bucket: multiply by 1/N, then sum (``psum(g / N)``;
   bit-identical to torch, where ``pmean`` is only for N a power of two);
3. every device runs the same optimizer update on the same averaged gradient;
4. BN running stats: rank 0's (DDP broadcasts its buffers) or global with SyncBN.
"""

import jax
import optax

from jaxdp.strategies.base import Strategy, StrategyError, ddp_buffers, local_grads, train_metrics
from jaxdp.strategies.buckets import bucketed


class DDP(Strategy):
    name = "ddp"

    def __init__(self, model, tx, mesh, *, bucket_cap_mb: float = 25.0, **kwargs):
        super().__init__(model, tx, mesh, **kwargs)
        if bucket_cap_mb <= 0:
            raise StrategyError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.bucket_cap_mb = bucket_cap_mb

    def reduce_bucket(self, flat):
        """Average one flat gradient bucket over the data axis, as DDP's default hook."""
        return jax.lax.psum(flat / self.num_devices, self.axis)

    def all_reduce(self, grads):
        return bucketed(grads, self.reduce_bucket, self.bucket_cap_mb)

    def local_step(self, state, images, labels):
        params = jax.lax.pcast(state.params, self.axis, to="varying")
        loss, grads, batch_stats, correct = local_grads(
            self.model, params, state.batch_stats, images, labels, self.accum_steps
        )
        grads = self.all_reduce(grads)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        new_state = state.replace(
            step=state.step + 1,
            params=optax.apply_updates(state.params, updates),
            batch_stats=ddp_buffers(batch_stats, self.axis, self.sync_bn),
            opt_state=opt_state,
        )
        return new_state, train_metrics(loss, correct, images.shape[0], self.axis,
                                        grads if self.return_grads else None)
