"""DDP's gradient sync: every device gets the average, one collective per bucket.

``AllReduce`` is DDP's communication hook: it turns each device's gradient into the
average over the data axis, one collective per bucket (``buckets.py``: torch's order and
sizes). Its options are torch's hooks:

- ``allreduce="ring"``: each bucket summed with explicit ppermute ring steps
  (``jaxdp.strategies.sync.ring``) instead of XLA's all-reduce;
- ``compress="bf16"|"fp16"``: torch's ``bf16_compress_hook``/``fp16_compress_hook``;
- ``compress="powersgd"``: torch's ``powerSGD_hook`` (rank ``powersgd_rank``, other
  ``PowerSGDState`` settings in ``powersgd_options``) with its error feedback and Qs as
  the transform's state.

A transform as the package's others (``jaxdp.strategies.sync``); its state is PowerSGD's, or None.
Any strategy that all-reduces (DDP, async, ZeRO-1) composes it.
"""

from jaxdp import names
from jaxdp.strategies.sync import Where, buckets, low_precision, powersgd, ring
from jaxdp.strategies.errors import StrategyError


COMPRESSORS = (None,) + names.COMPRESSIONS  # none; low_precision.py's two; powersgd.py


class SyncError(StrategyError):
    """A gradient-synchronisation option that does not exist (a strategy option error)."""


class AllReduce:
    def __init__(self, *, bucket_cap_mb=None, allreduce: str = "psum", compress=None, powersgd_rank: int = 1,
                 powersgd_options=None):
        if compress not in COMPRESSORS:
            raise SyncError(f"unknown compress {compress!r}; choose bf16, fp16 or powersgd")
        self.limits = bucket_limits(bucket_cap_mb)
        try:
            self.sum_fn = ring.all_reduce_fn(allreduce)
            self.powersgd = (powersgd.PowerSGD(powersgd_rank, **(powersgd_options or {}))
                             if compress == "powersgd" else None)
        except ValueError as e:
            raise SyncError(str(e)) from None
        self.allreduce, self.compress = allreduce, compress

    @classmethod
    def of(cls, options, powersgd_options=None) -> "AllReduce":
        """DDP's all-reduce as a strategy's typed options say (``jaxdp.config.step.StrategyOptions``);
        ``powersgd_options``: PowerSGD's other settings (parity's shared initial Q), over the options'
        ``powersgd_start_iter`` (read only with ``compress="powersgd"``)."""
        return cls(bucket_cap_mb=options.bucket_cap_mb, allreduce=options.allreduce, compress=options.compress,
                   powersgd_rank=options.powersgd_rank,
                   powersgd_options={"start_iter": options.powersgd_start_iter, **(powersgd_options or {})})

    @property
    def stateful(self) -> bool:
        return self.powersgd is not None

    def init(self, params, n: int):
        return self.powersgd.init(params, n) if self.powersgd else None

    def specs(self, axis):
        return self.powersgd.specs(axis) if self.powersgd else None

    def stored(self, state):
        """The state's checkpoint form, which does not depend on the device count (global arrays)."""
        return self.powersgd.stored(state) if self.powersgd else state

    def from_stored(self, stored, n: int):
        """The checkpoint form -> the state for ``n`` devices (PowerSGD's rule: ``powersgd.py``)."""
        return self.powersgd.from_stored(stored, n) if self.powersgd else stored

    def reduce_bucket(self, grads, axis, n: int):
        """Average one bucket (a list of gradients) over ``axis``: one collective, as DDP's default hook."""
        if self.compress in low_precision.LOW_PRECISION:
            return low_precision.low_precision_reduce(grads, low_precision.LOW_PRECISION[self.compress], n, axis,
                                                    self.sum_fn)
        return self.sum_fn([g / n for g in grads], axis)

    def update(self, grads, state, where: Where):
        def vanilla(g):
            return buckets.bucketed(g, lambda b: self.reduce_bucket(b, where.axis, where.n), where.order, self.limits)
        if self.powersgd is None:
            return vanilla(grads), state
        # step counts updates = hook calls: torch's PowerSGDState.iter.
        return self.powersgd.reduce(grads, state, where.step, where.axis, self.sum_fn, vanilla)


def bucket_limits(bucket_cap_mb=None):
    """torch's bucket sizes in bytes for ``bucket_cap_mb`` (None: torch's defaults, 25 MiB with a 1 MiB
    first bucket; a number: every bucket that size), refused in one line where not positive."""
    if bucket_cap_mb is not None and bucket_cap_mb <= 0:
        raise SyncError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
    return buckets.bucket_limits(bucket_cap_mb)


def refuse_with_tensor_parallel(strategy, allreduce: str, compress) -> None:
    """Refuse the sync options whose collectives cannot run beside a model axis."""
    if strategy.model_split is None:
        return
    if allreduce == "ring":
        # The ring is traced with check_vma=False, and without the varying/invariant types JAX
        # would not insert tensor parallelism's backward all-reduces.
        raise StrategyError("allreduce='ring' does not combine with a model axis (tensor parallelism); use psum")
    if compress == "powersgd":
        raise StrategyError("compress='powersgd' does not combine with a model axis (tensor parallelism) yet")
