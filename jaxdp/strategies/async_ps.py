"""Bounded-staleness parameter server ("async"), simulated deterministically.

Asynchronous SGD lets workers compute gradients on weights that are already
out of date by the time the server applies them. This strategy simulates the
bounded-staleness model at its bound, with a fixed delay k = ``staleness``, so
runs are reproducible and comparable with DDP:

    server update t = 0, 1, 2, ... (t = ``state.step``), params theta_t, theta_0 = init:
      every worker i computes g_i = grad L(theta_{max(0, t-k)}; shard i of batch t)
      the server averages them, g = sum_i g_i / N (DDP's psum(g / N)),
      and steps its optimizer: theta_{t+1} = opt(theta_t, g)

so each applied gradient is exactly k updates stale (the first k use theta_0).
k = 0 is DDP, op for op. Details the simulation fixes:

- the optimizer runs on the server, on the *current* params: weight decay and
  AdamW's decoupled decay use theta_t, not the stale copy;
- BN running stats are server state, updated in order: r_{t+1} = (1-m) r_t +
  m * s_t, with s_t worker 0's batch statistics (computed with the stale
  weights), as DDP keeps rank 0's;
- the logged loss is the workers' loss at the stale weights they used.

The last k versions live in ``TrainState.extra["history"]``: a ring buffer with a
leading axis of size k, slot j holding the most recent theta_v with v = j mod k
(all slots hold theta_0 at first). Update t reads slot t mod k, which holds
theta_{max(0, t-k)}, and then overwrites it with theta_t. The buffer is
replicated like the params (in a real parameter server it lives on the server;
here every simulated worker reads the same version), costing k x params per
device, and is checkpointed as is (it is already in canonical form).
"""

import jax
import optax

from jaxdp.strategies.base import StrategyError, ddp_buffers, local_grads, train_metrics
from jaxdp.strategies.ddp import DDP


class AsyncPS(DDP):
    name = "async"

    def __init__(self, model, tx, mesh, *, staleness: int = 0, bucket_cap_mb: float = 25.0,
                 allreduce: str = "psum", compress=None, **kwargs):
        super().__init__(model, tx, mesh, bucket_cap_mb=bucket_cap_mb, allreduce=allreduce,
                         compress=compress, **kwargs)
        if staleness < 0:
            raise StrategyError(f"staleness must be >= 0, got {staleness}")
        if self.powersgd is not None:
            raise StrategyError("async does not combine with powersgd (both keep state in extra)")
        self.staleness = staleness

    def init_extra(self, params):
        if self.staleness == 0:
            return None
        return {"history": jax.tree_util.tree_map(
            lambda x: jax.numpy.broadcast_to(x, (self.staleness,) + x.shape), params)}

    def local_step(self, state, images, labels):
        k = self.staleness
        if k:
            slot = state.step % k
            stale = jax.tree_util.tree_map(
                lambda h: jax.lax.dynamic_index_in_dim(h, slot, 0, keepdims=False), state.extra["history"])
        else:
            stale = state.params
        params = jax.lax.pcast(stale, self.axis, to="varying")
        loss, grads, batch_stats, correct = local_grads(
            self.model, params, state.batch_stats, images, labels, self.accum_steps
        )
        grads, _ = self.all_reduce(grads)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        extra = state.extra
        if k:  # theta_t goes where theta_{t-k} was: update t+k reads it
            extra = {"history": jax.tree_util.tree_map(
                lambda h, p: jax.lax.dynamic_update_index_in_dim(h, p, slot, 0),
                state.extra["history"], state.params)}
        new_state = state.replace(
            step=state.step + 1,
            params=optax.apply_updates(state.params, updates),
            batch_stats=ddp_buffers(batch_stats, self.axis, self.sync_bn),
            opt_state=opt_state,
            extra=extra,
        )
        return new_state, train_metrics(loss, correct, images.shape[0], self.axis,
                                        grads if self.return_grads else None)
