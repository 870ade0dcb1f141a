"""DDP: replicated params and optimizer state, gradients all-reduced in buckets.

The torch ``DistributedDataParallel`` recipe, per device:

1. forward/backward on the local shard (accumulating over ``accum_steps``
   micro-batches with no communication, as under ``no_sync``);
2. one all-reduce per bucket: multiply by 1/N, then sum (``psum(g / N)``;
   bit-identical to torch, where ``pmean`` is only for N a power of two).
   Buckets hold the gradients in reverse parameter definition order, sized as
   torch sizes them (``buckets.py``); the order is read from the model at the
   first ``step``/``lower_step``;
3. every device runs the same optimizer update on the same averaged gradient;
4. BN running stats: rank 0's (DDP broadcasts its buffers) or global with SyncBN.

Options (the algorithms live in ``jaxdp.collectives`` and ``jaxdp.compression``):
``allreduce="ring"`` sums each bucket with explicit ppermute ring steps instead
of XLA's all-reduce; ``compress="bf16"|"fp16"`` is torch's ``*_compress_hook``;
``compress="powersgd"`` is torch's ``powerSGD_hook`` (rank ``powersgd_rank``,
other ``PowerSGDState`` settings in ``powersgd_options``), with its Qs and
error feedback in ``TrainState.extra``.
"""

import jax
import optax
from jax.sharding import PartitionSpec as P

from jaxdp import collectives, compression
from jaxdp.strategies import buckets, flat
from jaxdp.strategies.base import Strategy, StrategyError, ddp_buffers, local_grads, train_metrics


class DDP(Strategy):
    name = "ddp"

    def __init__(self, model, tx, mesh, *, bucket_cap_mb=None, allreduce: str = "psum",
                 compress=None, powersgd_rank: int = 1, powersgd_options=None, **kwargs):
        super().__init__(model, tx, mesh, **kwargs)
        if bucket_cap_mb is not None and bucket_cap_mb <= 0:
            raise StrategyError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        if compress not in compression.COMPRESSORS:
            raise StrategyError(f"unknown compress {compress!r}; choose bf16, fp16 or powersgd")
        # None: torch's defaults, 25 MiB with a 1 MiB first bucket; a number: every bucket that size.
        self.bucket_limits = buckets.bucket_limits(bucket_cap_mb)
        self.param_order = None  # the model's parameter definition order, read at the first step
        try:
            self.allreduce_fn = collectives.all_reduce_fn(allreduce)
            self.powersgd = (compression.PowerSGD(powersgd_rank, **(powersgd_options or {}))
                             if compress == "powersgd" else None)
        except ValueError as e:
            raise StrategyError(str(e)) from None
        self.allreduce, self.compress = allreduce, compress

    def reduce_bucket(self, grads):
        """Average one bucket (a list of gradients) over the data axis, as DDP's default hook:
        one collective for the bucket (``buckets.py``)."""
        if self.compress in compression.LOW_PRECISION:
            return compression.low_precision_reduce(
                grads, compression.LOW_PRECISION[self.compress], self.num_devices, self.axis, self.allreduce_fn)
        return self.allreduce_fn([g / self.num_devices for g in grads], self.axis)

    def all_reduce(self, grads, extra=None, step=0):
        """(averaged grads, new ``extra``): PowerSGD keeps state there, the other hooks do not."""
        def vanilla(g):
            return buckets.bucketed(g, self.reduce_bucket, self.definition_order(), self.bucket_limits)
        if self.powersgd is None:
            return vanilla(grads), extra
        return self.powersgd.reduce(grads, extra, step, self.axis, self.allreduce_fn, vanilla)

    def bucket_groups(self, tree):
        """The same buckets as leaf-index groups of a params-shaped tree (ZeRO-1/2 move shards in them)."""
        return flat.bucket_groups(tree, self.definition_order(), self.bucket_limits)

    def definition_order(self):
        if self.param_order is None:
            raise StrategyError(f"{self.name}: the bucket order is read from the model at the first "
                                "step or lower_step (or call learn_parameter_order(images) first)")
        return self.param_order

    def learn_parameter_order(self, images):
        """Read the model's parameter definition order once (gradients arrive key-sorted; see buckets.py)."""
        if self.param_order is None:
            self.param_order = buckets.definition_order(self.model, images)

    def step(self, state, images, labels):
        self.learn_parameter_order(images)
        return super().step(state, images, labels)

    def lower_step(self, state, images, labels):
        self.learn_parameter_order(images)
        return super().lower_step(state, images, labels)

    def init_extra(self, params):
        return self.powersgd.init(params, self.num_devices) if self.powersgd else None

    def state_specs(self, state):
        if self.powersgd is None:
            return P()
        return state.replace(step=P(), params=P(), batch_stats=P(), opt_state=P(),
                             extra=self.powersgd.specs(self.axis))

    def _step_fn(self, state):
        # A ring sum comes out of ppermutes, which JAX types as "varying" although every
        # device holds the same value, and there is no cast back to replicated: so the
        # ring step is traced with check_vma=False (gradients stay local: see base.py).
        if self.allreduce == "ring" and self._jit_step is None:
            specs, batch = self.state_specs(state), P(self.batch_axes)
            self._jit_step = jax.jit(jax.shard_map(
                self.local_step, mesh=self.mesh, in_specs=(specs, batch, batch),
                out_specs=(specs, P()), check_vma=False), donate_argnums=0)
        return super()._step_fn(state)

    def local_step(self, state, images, labels):
        params = jax.lax.pcast(state.params, self.axis, to="varying")
        loss, grads, batch_stats, correct = local_grads(
            self.model, params, state.batch_stats, images, labels, self.accum_steps
        )
        # state.step counts updates = hook calls: torch's PowerSGDState.iter.
        grads, extra = self.all_reduce(grads, state.extra, state.step)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        new_state = state.replace(
            step=state.step + 1,
            params=optax.apply_updates(state.params, updates),
            batch_stats=ddp_buffers(batch_stats, self.axis, self.sync_bn),
            opt_state=opt_state,
            extra=extra,
        )
        return new_state, train_metrics(loss, correct, images.shape[0], self.axis,
                                        grads if self.return_grads else None)
