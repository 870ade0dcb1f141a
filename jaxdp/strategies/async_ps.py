"""Bounded-staleness parameter server ("async"), simulated deterministically.

Against ``ddp.py``: the same all-reduce (``sync.AllReduce``), but each worker's gradient
is taken at params up to k updates old (step 1 below); everything else is DDP's.

Asynchronous SGD lets workers compute gradients on weights that are already
out of date by the time the server applies them. This strategy simulates it
with a bound k = ``staleness`` and a seeded, reproducible arrival schedule, so
runs can be repeated, resumed and compared with DDP.

The model. The server holds params theta_t, t = ``state.step`` = the number
of updates applied so far (theta_0 = init). Each device is one worker. Update
t is one round:

1. **what a worker reads**: worker i's gradient for round t was computed on
   the params it pulled d_{t,i} updates ago, theta_{max(0, t - d_{t,i})}, with
   its own staleness d_{t,i} in [0, k]. It evaluates loss and gradient on shard
   i of batch t (the data stream is DDP's: every sample once per epoch);
2. **the arrival schedule** is deterministic: d_{t,i} =
   ``jax.random.randint(fold_in(fold_in(key(staleness_seed), t), i), (), 0, k + 1)``,
   so at a given update some workers are fresh and others up to k updates
   behind, independently per worker and round, and a resume replays it;
3. **when the server applies**: once per round, when the N gradients of round t
   have arrived, it applies their average g_t = sum_i g_{t,i} / N (DDP's
   ``psum(g / N)``) with its optimizer to its *current* params:
   theta_{t+1} = opt(theta_t, g_t). Weight decay and AdamW's decoupled decay
   act on theta_t, not on a stale copy;
4. BN running stats are server state, moved in order as DDP's rank 0 moves
   them: r_{t+1} = (1-m) r_t + m s_t, with s_t worker 0's batch statistics
   (at the params worker 0 read). The logged loss is the workers' mean loss at
   the params each of them read.

Why k = 0 is DDP: every d_{t,i} = 0, so every worker reads theta_t and the
round is exactly DDP's step, through this module's own code (the test compares
it with ``ddp.py``'s, bit for bit). For k > 0 a round with all d = 0 is DDP's
step too (``jnp.where`` selects theta_t exactly).

History, and its memory. Update t needs theta_{t-k} .. theta_t. theta_t is
``state.params``; the other k live in ``TrainState.extra["history"]``, a ring
buffer with a leading axis of size k: slot j holds the most recent theta_v with
v = j mod k (all slots hold theta_0 at first, which is what max(0, .) reads).
Update t reads slot (t - d) mod k for a worker with d >= 1, then overwrites
slot t mod k with theta_t. The buffer is replicated like the params (in a real
parameter server it lives on the server; here every simulated worker can read
any version), so a device holds DDP's state plus k copies of the params: with
f32 Adam 16Psi + 4kPsi bytes. It is checkpointed as is (it already is in
canonical form); its schedule is keyed by device index, so resuming on another
device count continues with that count's schedule.
"""

import dataclasses

import jax
import jax.numpy as jnp

from jaxdp.strategies import ddp
from jaxdp.strategies.base import Strategy
from jaxdp.strategies.device_math import local_grads
from jaxdp.strategies.errors import StrategyError
from jaxdp.strategies.sync.allreduce import AllReduce

# DDP's facts (the history, k params copies, is replicated ``extra``), but a twin only for k = 0.
FACTS = dataclasses.replace(ddp.FACTS, name="async", twin_when={"staleness": 0},
                            twin="DDP, staleness 0 only (torch has no bounded-staleness parameter server)",
                            takes=frozenset({"staleness", "staleness_seed", "bucket_cap_mb", "allreduce", "compress"}))


class AsyncPS(Strategy):
    facts = FACTS
    model_parallel = False  # the whole model on every device

    def __init__(self, model, task, tx, mesh, options=None, *, staleness_seed: int = 0, **kwargs):
        super().__init__(model, task, tx, mesh, options, **kwargs)
        if self.options.compress == "powersgd":
            raise StrategyError("async does not combine with powersgd: the server averages plain gradients "
                                "(bf16/fp16 compression works)")
        self.sync = AllReduce.of(self.options)
        self.check_vma = self.options.allreduce != "ring"
        self.staleness_seed = staleness_seed

    def init_extra(self, params):
        """The history: every slot starts as theta_0, the params the state starts from (what
        max(0, t - d) reads before k updates exist)."""
        if self.options.staleness == 0:
            return None
        return {"history": jax.tree_util.tree_map(
            lambda x: jnp.broadcast_to(x, (self.options.staleness,) + tuple(x.shape)), params)}

    # -- per device (one worker) ----------------------------------------------------------------
    def worker_delay(self, step):
        """d_{t,i} in [0, k]: how many updates old the params are that this worker read for update ``step``."""
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.staleness_seed), step),
                                 jax.lax.axis_index(self.axis))
        return jax.random.randint(key, (), 0, self.options.staleness + 1)

    def params_read(self, state):
        """theta_{max(0, t - d)} for this worker: the current params or a ring-buffer slot."""
        current = jax.lax.pcast(state.params, self.axis, to="varying")
        if self.options.staleness == 0:
            return current
        delay = self.worker_delay(state.step)
        slot = (state.step - delay) % self.options.staleness  # t - d < 0 lands on a slot still holding theta_0
        return jax.tree_util.tree_map(
            lambda p, h: jnp.where(delay == 0, p, jax.lax.dynamic_index_in_dim(h, slot, 0, keepdims=False)),
            current, state.extra["history"])

    def local_step(self, state, batch):
        loss, grads, model_state, metrics = local_grads(
            self.step_task().loss_fn, self.params_read(state), state.model_state, batch, self.step_key(state.step),
            self.options.accum_steps)
        grads, _ = self.sync.update(grads, None, self.where(state.step))  # the server's average
        extra = state.extra
        if self.options.staleness:
            slot = state.step % self.options.staleness  # theta_t replaces theta_{t-k}, which no later update reads
            extra = {"history": jax.tree_util.tree_map(lambda h, p: jax.lax.dynamic_update_index_in_dim(h, p, slot, 0),
                                                       state.extra["history"], state.params)}
        return ddp.replicated_update(self, state, loss, grads, model_state, metrics, extra)
