"""torch's bf16/fp16 DDP communication hooks: each gradient cast down, divided by N, SUM all-reduced
and copied back.

Each function runs per device inside ``jax.shard_map`` and takes the SUM
all-reduce to use (``sum_fn(x, axis)``: ``jax.lax.psum`` or
``jaxdp.strategies.sync.ring.ring_all_reduce``), so compression and the all-reduce
algorithm combine freely.

bf16 / fp16 (``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``)
    ``buffer.to(dtype).div_(world_size)``, SUM all-reduce, copy back into the
    full-precision buffer: the cast comes first, so the division by N rounds in
    low precision too. How the SUM rounds is the all-reduce's business, in torch
    as here. Measured on XLA:CPU (JAX 0.10.2): a bf16 all-reduce is promoted to
    f32 and rounded once; an f16 one adds in f16, rounding at each hop in device
    order; gloo and NCCL round at each hop in their own order. For N = 2 all of
    them agree exactly; for N > 2 they differ by the rounding of the partial
    sums (at most (N-1)·u·sum|g_i/N|, u the unit roundoff).
    ``allreduce="ring"`` rounds at every hop in ring order.
"""

import jax
import jax.numpy as jnp

LOW_PRECISION = {"bf16": jnp.bfloat16, "fp16": jnp.float16}


def low_precision_reduce(grads, dtype, n: int, axis, sum_fn=jax.lax.psum):
    """torch's ``bf16_compress_hook`` / ``fp16_compress_hook`` on one bucket (an array or a
    list of them, summed by one ``sum_fn``).

    torch divides the low-precision values in float32 and rounds the quotient to ``dtype``
    (ATen's scalar division for reduced floats). Written out, XLA keeps it exact: it turned
    ``x / n`` in ``dtype`` into a product with 1/n (fp16: with 0.33325, 1/3 rounded to
    fp16), and, without the barrier, dropped the quotient's rounding before an all-reduce
    it promotes to f32 (bf16). Both gave 1-ulp differences, none for n a power of 2.
    """
    parts = jax.tree_util.tree_map(lambda g: (_to_low(g, dtype).astype(jnp.float32) / n).astype(dtype), grads)
    summed = sum_fn(jax.lax.optimization_barrier(parts), axis)
    return jax.tree_util.tree_map(lambda s, g: s.astype(g.dtype), summed, grads)


def _to_low(g, dtype):
    """``g.to(dtype)`` as torch rounds it: c10's Half and BFloat16 are built from a float, so a
    float64 gradient is rounded to float32 first, then to ``dtype``. A direct f64 -> f16
    convert rounds once, and XLA emits one where the CPU has it (avx512_fp16): 1-ulp
    differences in the rare elements where rounding twice differs from rounding once."""
    return g.astype(jnp.float32).astype(dtype)
