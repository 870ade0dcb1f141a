"""Deliberately broken jaxdp variants: each is a real porting mistake, and the harness must
catch it and name it.

Each bug is a context manager that monkeypatches one spot of jaxdp and restores it on
exit (also on an exception). Patch *before* the strategy traces its step (the runner
builds a fresh strategy and jit inside the ``with``), so the compiled step contains the bug.

===============  ==============================================  ===========================================
bug              the mistake                                     where the harness must see it first
===============  ==============================================  ===========================================
same_padding     ``padding="SAME"`` on the stride-2 3x3 convs:   step 0, ``loss`` (the forward already
                 XLA pads (0, 1), torch (1, 1)                   differs)
biased_var       running_var updated with the biased batch       step 0, ``buffers/...running_var`` (loss,
                 variance (flax's choice) instead of torch's     grads and params are unaffected: training
                 unbiased ``var * n / (n - 1)``                  mode normalises with batch statistics)
missing_1_over_n gradient all-reduce sums without dividing by N  step 0, ``grads/...`` (every gradient is N x)
wrong_shard_bn   BN running stats kept from the LAST device      step 0, ``buffers/...`` (DDP keeps rank 0's)
                 instead of rank 0 (DDP broadcasts rank 0's)
===============  ==============================================  ===========================================
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, Iterator


@contextlib.contextmanager
def _patched(obj, name: str, value) -> Iterator[None]:
    original = obj.__dict__[name] if isinstance(obj, type) else getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, original)


@contextlib.contextmanager
def same_padding() -> Iterator[None]:
    """Stride-2 3x3 convolutions with ``padding="SAME"`` (pads (0, 1) where torch pads (1, 1))."""
    import flax.linen as nn

    from jaxdp.models import resnet

    original = resnet._Layers.conv

    def conv(self, features, kernel, stride=1, name=None):
        if stride == 2 and kernel == 3:
            return nn.Conv(features, (kernel, kernel), strides=(stride, stride), padding="SAME",
                           use_bias=False, kernel_init=resnet.conv_init, dtype=self.dtype,
                           param_dtype=self.param_dtype, name=name)
        return original(self, features, kernel, stride, name)

    with _patched(resnet._Layers, "conv", conv):
        yield


@contextlib.contextmanager
def biased_var() -> Iterator[None]:
    """BatchNorm whose running_var takes the biased batch variance (flax.linen.BatchNorm's habit)."""
    import flax.linen as nn
    import jax

    from jaxdp.models import resnet
    from jaxdp.models.batchnorm import BatchNorm

    class BiasedVarBatchNorm(BatchNorm):
        @nn.compact
        def __call__(self, x, train: bool):
            features = x.shape[-1]
            scale = self.param("scale", nn.initializers.ones, (features,), self.param_dtype)
            bias = self.param("bias", nn.initializers.zeros, (features,), self.param_dtype)
            ra_mean = self.variable("batch_stats", "mean", lambda: jax.numpy.zeros((features,), self.param_dtype))
            ra_var = self.variable("batch_stats", "var", lambda: jax.numpy.ones((features,), self.param_dtype))
            xs = x.astype(jax.numpy.promote_types(self.dtype, jax.numpy.float32))
            if train:
                mean, var, _ = self._batch_stats(xs)
                if not self.is_initializing():
                    m = self.momentum
                    ra_mean.value = (1 - m) * ra_mean.value + m * mean.astype(self.param_dtype)
                    ra_var.value = (1 - m) * ra_var.value + m * var.astype(self.param_dtype)  # BUG: biased
            else:
                mean, var = ra_mean.value.astype(xs.dtype), ra_var.value.astype(xs.dtype)
            y = (xs - mean) * (jax.lax.rsqrt(var + self.epsilon) * scale.astype(xs.dtype)) + bias.astype(xs.dtype)
            return y.astype(self.dtype)

    with _patched(resnet, "BatchNorm", BiasedVarBatchNorm):
        yield


@contextlib.contextmanager
def missing_1_over_n() -> Iterator[None]:
    """DDP's bucket all-reduce sums the gradients without the 1/N: N times the average."""
    from jaxdp.strategies.ddp import DDP

    original = DDP.reduce_bucket

    def reduce_bucket(self, flat):
        # BUG: psum(g), not psum(g / N). Written as the real bucket reduction fed N*g, so it
        # follows DDP's code whatever its all-reduce is called (exact for N a power of 2).
        return original(self, flat * self.num_devices)

    with _patched(DDP, "reduce_bucket", reduce_bucket):
        yield


@contextlib.contextmanager
def wrong_shard_bn() -> Iterator[None]:
    """DDP keeps the last device's BN running stats instead of rank 0's."""
    import jax

    from jaxdp.strategies import ddp
    from jaxdp.strategies.base import broadcast_from

    def ddp_buffers(batch_stats, axis, sync_bn):
        if sync_bn:
            return batch_stats
        return broadcast_from(batch_stats, axis, source=jax.lax.axis_size(axis) - 1)  # BUG: not 0

    with _patched(ddp, "ddp_buffers", ddp_buffers):
        yield


@dataclass(frozen=True)
class Bug:
    name: str
    inject: Callable[[], contextlib.AbstractContextManager]
    step: int          # where the harness must report the first divergence
    category: str      # ... in which category
    leaf: str = ""     # ... and, if set, a tensor whose name ends with this
    what: str = ""


BUGS: Dict[str, Bug] = {b.name: b for b in (
    Bug("same_padding", same_padding, 0, "loss", what="'SAME' padding on the stride-2 convs"),
    Bug("biased_var", biased_var, 0, "buffers", "running_var", "biased variance in BN running_var"),
    Bug("missing_1_over_n", missing_1_over_n, 0, "grads", what="gradient all-reduce without 1/N"),
    Bug("wrong_shard_bn", wrong_shard_bn, 0, "buffers", what="BN running stats from the last device"),
)}
