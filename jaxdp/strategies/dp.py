"""Classic single-controller data parallelism: torch's ``nn.DataParallel``, with ``jax.pmap``.

``nn.DataParallel`` runs in one process and, every step:

1. scatters the batch in equal chunks over the devices and replicates the
   module from device 0 (params and BN buffers);
2. runs each replica on its chunk, BN normalising with that chunk's statistics;
3. gathers the outputs onto device 0 and computes the loss there: the *mean over
   the full batch* B. Backward splits the output gradient back to the chunks,
   so chunk i's gradient is (b_i / B) * grad(chunk mean loss), and the replicate
   step's backward (``ReduceAddCoalesced``) SUMS them onto device 0;
4. steps the optimizer on device 0 only; the optimizer state lives there;
5. keeps device 0's BN running stats (replica 0 updates the module's own
   buffers; the other replicas' updates are discarded).

``pmap`` is used on purpose: it is the single-controller API, one Python call
driving every device, as DataParallel is. (It is in maintenance mode; in
JAX 0.10 it lowers through ``jit(shard_map)``, so the program XLA sees is the
same kind as for the other strategies.)

How XLA represents it. XLA compiles *one* SPMD program that every device runs,
so "only device 0" is data-dependent control flow, not a different program:

- gather to device 0: N-1 ``collective-permute`` ops with
  ``source_target_pairs={{j,0}}`` (one per other device; no other device
  receives anything), carrying the whole flat gradient;
- sum and optimizer update: a ``conditional`` on ``axis_index == 0``; the other
  devices take the empty branch and keep a stale copy of the optimizer state
  that is never read (pmap's layout has a slot on every device);
  ``canonical`` returns device 0's;
- broadcast from device 0: a binomial tree of ceil(log2 N)
  ``collective-permute`` ops (round k: devices [0, 2^k) send to [2^k, 2^(k+1))),
  carrying params and BN stats. Torch's replicate step (``Broadcast``/NCCL
  broadcast) happens at the start of the next forward; doing it at the end of
  the step gives the same numbers and keeps the state replicated between steps.

There is no all-reduce of gradient size. Scalar metrics (loss, accuracy) are
``psum``-ed for the trainer's convenience; torch computes them on device 0.

Numbers: identical to DDP's except the gradient arithmetic, sum_i (g_i * b/B)
in device order rather than psum(g_i / N); float64 agrees to ~1e-16.
Single process only (as ``nn.DataParallel``); use ``ddp`` across hosts.
"""

import math

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree

from jaxdp.strategies.base import Strategy
from jaxdp.strategies.device_math import local_grads, train_metrics
from jaxdp.strategies.errors import StrategyError
from jaxdp.strategies.factsheet import Facts
from jaxdp.strategies.pmap_engine import PmapEngine
from jaxdp.loss.task import batch_size


def gather_to_first(x, axis, n: int):
    """[x_0, x_1, ..., x_{n-1}] on device 0 (zeros elsewhere): one collective-permute j -> 0 per device."""
    return [x] + [jax.lax.ppermute(x, axis, [(j, 0)]) for j in range(1, n)]


def broadcast_from_first(x, axis, n: int):
    """Device 0's ``x`` on every device, by a binomial tree of ceil(log2 n) collective-permutes."""
    i = jax.lax.axis_index(axis)
    k = 1
    while k < n:
        received = jax.lax.ppermute(x, axis, [(j, j + k) for j in range(k) if j + k < n])
        x = jnp.where((i >= k) & (i < 2 * k), received, x)
        k *= 2
    return x


def traffic(s) -> float:
    """The gradient gathered to device 0 by N-1 permutes, params sent back down a ceil(log2 N) tree."""
    return (s.n - 1 + math.ceil(math.log2(s.n))) * s.p * s.psi


FACTS = Facts("dp", twin="nn.DataParallel",
              traffic=traffic, traffic_text="(N-1 + ceil(log2 N))Ψp: gather to device 0, broadcast tree")


class DataParallel(Strategy):
    facts = FACTS
    model_parallel = False  # the whole model on every device
    engine_class = PmapEngine  # pmap's layout: a copy of the state per device

    def __init__(self, model, task, tx, mesh, options=None, **kwargs):
        super().__init__(model, task, tx, mesh, options, **kwargs)
        if self.options.sync_bn:
            raise StrategyError("dp: nn.DataParallel has no SyncBatchNorm; use ddp --sync-bn")
        if jax.process_count() > 1:
            raise StrategyError("dp is single-process (one controller, like nn.DataParallel); use ddp")

    def local_step(self, state, batch):
        """One device's step under pmap: its chunk's gradient gathered to device 0, summed and applied
        there, the params and model state broadcast back from device 0."""
        n, axis = self.num_devices, self.axis
        loss, grads, model_state, metrics = local_grads(
            self.step_task().loss_fn, state.params, state.model_state, batch, self.step_key(state.step),
            self.options.accum_steps)
        # Full-batch mean loss: this chunk's share of the gradient is (b/B) * grad(chunk mean).
        b = batch_size(batch)
        flat, unravel = ravel_pytree(grads)
        parts = gather_to_first(flat * (b / (b * n)), axis, n)

        def update(params, opt_state):  # device 0 only: ReduceAdd in device order, then the optimizer
            total = parts[0]
            for g in parts[1:]:
                total = total + g
            updates, opt_state = self.tx.update(unravel(total), opt_state, params)
            return optax.apply_updates(params, updates), opt_state, total

        def idle(params, opt_state):
            return params, opt_state, jnp.zeros_like(flat)

        is_first = jax.lax.axis_index(axis) == 0
        params, opt_state, total = jax.lax.cond(is_first, update, idle, state.params, state.opt_state)
        # Replicate params and the model state from device 0 (its BN stats are chunk 0's).
        flat_state, unravel_state = ravel_pytree((params, model_state))
        params, model_state = unravel_state(broadcast_from_first(flat_state, axis, n))
        new_state = state.replace(step=state.step + 1, params=params, model_state=model_state,
                                  opt_state=opt_state)
        out = train_metrics(loss, metrics, axis)
        if self.return_grads:  # parity checks only: device 0's summed gradient
            out["grads"] = unravel(broadcast_from_first(total, axis, n))
        return new_state, out
