"""BatchNorm with PyTorch's exact semantics.

``flax.linen.BatchNorm`` differs from ``torch.nn.BatchNorm2d`` in three ways that
break parity: it keeps the *biased* variance in the running stats, its momentum
is the decay of the old value (0.99 vs torch's 0.1 weight of the new value), and
it computes the variance as E[x^2] - E[x]^2. This module follows torch instead:

- normalise with the biased batch variance, computed two-pass as E[(x - mean)^2];
- running_var is updated with the *unbiased* variance var * n / (n - 1);
- running = (1 - momentum) * running + momentum * batch, momentum = 0.1;
- statistics are kept in at least float32 when the compute dtype is bfloat16.

With ``axis_name`` set, the statistics are global over that mesh axis
(SyncBatchNorm); without it each device normalises with its own shard, which
is DDP's behaviour.
"""

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxdp.models.errors import ModelError


class BatchNorm(nn.Module):
    momentum: float = 0.1
    epsilon: float = 1e-5
    axis_name: Optional[str] = None  # set for SyncBatchNorm semantics
    dtype: Any = jnp.float32  # compute dtype
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool):
        features = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (features,), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (features,), self.param_dtype)
        running_mean = self.variable(
            "batch_stats", "mean", lambda: jnp.zeros((features,), self.param_dtype)
        )
        running_var = self.variable(
            "batch_stats", "var", lambda: jnp.ones((features,), self.param_dtype)
        )

        stats_dtype = jnp.promote_types(self.dtype, jnp.float32)
        xs = x.astype(stats_dtype)
        if train:
            mean, var, count = self._batch_stats(xs)
            if not self.is_initializing():
                unbiased = var * (count / (count - 1))
                m = self.momentum
                running_mean.value = (1 - m) * running_mean.value + m * mean.astype(self.param_dtype)
                running_var.value = (1 - m) * running_var.value + m * unbiased.astype(self.param_dtype)
        else:
            mean = running_mean.value.astype(stats_dtype)
            var = running_var.value.astype(stats_dtype)

        inv_std = jax.lax.rsqrt(var + self.epsilon)
        y = (xs - mean) * (inv_std * scale.astype(stats_dtype)) + bias.astype(stats_dtype)
        return y.astype(self.dtype)

    def _batch_stats(self, xs):
        """Biased mean/var over N, H, W, and the element count behind them."""
        reduce_axes = tuple(range(xs.ndim - 1))
        count = 1
        for a in reduce_axes:
            count *= xs.shape[a]
        mean = xs.mean(reduce_axes)
        if self.axis_name is not None:
            # Equal shard sizes, so the mean of means is the global mean.
            mean = jax.lax.pmean(mean, self.axis_name)
            count *= jax.lax.axis_size(self.axis_name)
        if count < 2:  # the unbiased running variance divides by count - 1
            raise ModelError(f"BatchNorm in training needs more than 1 value per channel (batch x height x width"
                             f"{' x devices' if self.axis_name else ''}), got {count} for input shape {xs.shape}")
        var = jnp.square(xs - mean).mean(reduce_axes)
        if self.axis_name is not None:
            var = jax.lax.pmean(var, self.axis_name)
        return mean, var, count
