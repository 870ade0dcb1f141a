"""DDP: replicated params and optimizer state, gradients all-reduced in buckets.

The torch ``DistributedDataParallel`` recipe, per device:

1. forward/backward on the local shard of the batch (accumulating over
   ``accum_steps`` micro-batches with no communication, as under ``no_sync``);
2. one all-reduce per bucket: multiply by 1/N, then sum (``psum(g / N)``;
   bit-identical to torch, where ``pmean`` is only for N a power of two).
   Buckets hold the gradients in reverse parameter definition order, sized as
   torch sizes them (``buckets.py``); ring all-reduce and torch's compression
   hooks are options of the same transform (``sync.AllReduce``);
3. every device runs the same optimizer update on the same averaged gradient;
4. the model state (BN running stats): rank 0's (DDP broadcasts its buffers
   before every forward), or already global with SyncBN.

Model state per device: params 4Ψ + grads 4Ψ + optimizer KΨ (f32; K = 4 for SGD
momentum, 8 for Adam). Traffic: all-reduce Ψ = 2Ψ·(N-1)/N per device.
"""

import jax
import optax

from jaxdp.strategies.base import Strategy
from jaxdp.strategies.device_math import ddp_buffers, local_grads, train_metrics
from jaxdp.strategies.factsheet import Facts
from jaxdp.strategies.sync.allreduce import AllReduce, refuse_with_tensor_parallel

# DDP's all-reduce and its hooks: the options DDP (and zero1, which all-reduces as DDP) takes.
ALL_REDUCE_OPTIONS = frozenset({"bucket_cap_mb", "allreduce", "compress", "powersgd_rank", "powersgd_start_iter",
                                "powersgd_options"})
FACTS = Facts("ddp", twin="DistributedDataParallel (broadcast_buffers; optional comm hook)", takes=ALL_REDUCE_OPTIONS,
              traffic=lambda s: s.allreduce, traffic_text="{allreduce}")  # nothing is sharded: one all-reduce


class DDP(Strategy):
    facts = FACTS

    def __init__(self, model, task, tx, mesh, options=None, *, powersgd_options=None, **kwargs):
        super().__init__(model, task, tx, mesh, options, **kwargs)
        o = self.options
        refuse_with_tensor_parallel(self, o.allreduce, o.compress)
        self.sync = AllReduce.of(o, powersgd_options)
        # A ring sum comes out of ppermutes, which JAX types as "varying" although every
        # device holds the same value, and there is no cast back to replicated: so the
        # ring step is traced with check_vma=False (gradients stay local: see base.py, the check_vma trap).
        self.check_vma = o.allreduce != "ring"

    def local_step(self, state, batch):
        params = jax.lax.pcast(state.params, self.axis, to="varying")  # each device's own grads
        loss, grads, model_state, metrics = local_grads(
            self.step_task().loss_fn, params, state.model_state, batch, self.step_key(state.step),
            self.options.accum_steps)
        grads, extra = self.sync.update(grads, state.extra, self.where(state.step))
        return replicated_update(self, state, loss, grads, model_state, metrics, extra)


def replicated_update(strategy, state, loss, grads, model_state, metrics, extra):
    """DDP's steps 3 and 4 on one device, given the averaged ``grads``: the same optimizer update
    everywhere, rank 0's (or SyncBN's) buffers, and the step's metrics (also ``async_ps``'s)."""
    updates, opt_state = strategy.tx.update(grads, state.opt_state, state.params)
    new_state = state.replace(
        step=state.step + 1,
        params=optax.apply_updates(state.params, updates),
        model_state=ddp_buffers(model_state, strategy.axis, strategy.options.sync_bn),
        opt_state=opt_state,
        extra=extra,
    )
    out = train_metrics(loss, metrics, strategy.axis, grads if strategy.return_grads else None)
    return new_state, strategy.with_grad_norm(out, grads, chunked=False)
