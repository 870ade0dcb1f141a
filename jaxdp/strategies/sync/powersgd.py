"""torch's PowerSGD DDP communication hook (``powerSGD_hook``): low-rank gradient compression with error
feedback, the hook's state kept in ``TrainState.extra``.

Each function runs per device inside ``jax.shard_map`` and takes the SUM
all-reduce to use (``sum_fn(x, axis)``: ``jax.lax.psum`` or
``jaxdp.strategies.sync.ring.ring_all_reduce``), so compression and the all-reduce
algorithm combine freely.

PowerSGD (``ddp_comm_hooks/powerSGD_hook.py``, Vogels et al. 2019)
    Per step, after ``start_iter`` steps of plain averaging (``psum(g / N)``):

    1. error feedback: ``x = g + e`` (this device's error, zero at first);
    2. every gradient is viewed in torch's layout as ``M = x.view(shape[0], -1)``
       (a conv kernel HWIO -> OIHW -> (O, I*H*W); a Dense kernel -> (out, in));
       with ``r = min(rows, cols, rank)`` it is compressed only if
       ``(rows + cols) * r * min_compression_rate < rows * cols``. Vectors never are;
    3. the rest are concatenated, SUM all-reduced and divided by N;
    4. ``Q`` (warm start: last step's averaged Q; else fresh normal) is
       orthogonalized, ``P = M Q``, all P's are SUM all-reduced (no division),
       orthogonalized, ``Q = M^T P``, all Q's SUM all-reduced and divided by N,
       and the gradient is ``P Q^T``;
    5. the new error is ``x - output``, for every element of the bucket,
       the uncompressed ones included (as torch computes it).

    Orthogonalization is torch's: Gram-Schmidt for rank <= 2 (``col /= norm``,
    or ``norm + epsilon``), Householder QR (LAPACK, as ``torch.linalg.qr``) above.
    Defaults are torch's ``PowerSGDState`` defaults: ``start_iter=1000``,
    ``min_compression_rate=2``, ``orthogonalization_epsilon=0``, error feedback
    and warm start on.

    Buckets. torch runs the hook per DDP bucket, but every step of the
    algorithm is per tensor (compression decision, P/Q, orthogonalization) or
    elementwise (error, the uncompressed average), so the result does not
    depend on how gradients are bucketed: bucketing changes only how many
    collectives run (here one for the uncompressed gradients, one for all P's,
    one for all Q's). What *does* depend on torch's bucket layout is its random
    initial Q (drawn bucket by bucket, tensors grouped by shape, from
    ``torch.manual_seed(np.random.RandomState(seed).randint(1e9))``), which JAX
    cannot reproduce; for parity, read torch's Qs and pass them as
    ``initial_q`` (or write ours into torch's ``q_memory_dict``). With
    ``warm_start=False`` fresh Qs are drawn from ``jax.random`` every step.

    State (``TrainState.extra``): ``{"q": {name: (cols, r)}, "error": params-shaped
    tree with a leading device axis}``. The error is per device (sharded over the
    data axis); Q is replicated (it is the output of an all-reduce).

    Checkpoints and elastic resume: only the mean error matters. Every step
    depends on the devices' errors only through their mean ``ē = Σ e_i / N``:
    with ``x_i = g_i + e_i``, the uncompressed tensors' output is ``Σ x_i / N``
    and the compressed ones' is ``P Pᵀ M̄`` with ``P = orth(Σ M_i Q) = orth(M̄ Q)``
    (orthogonalization drops the scale), ``M̄ = Σ M_i / N``; the new errors
    ``x_i - out`` have mean ``x̄ - out``. So (params, Q, ē) evolve as a function
    of (params, Q, ē) and the global batch's mean gradient alone, whatever N and
    however the error is split over the devices. The checkpoint form
    (``stored``) therefore holds Q and the mean error, params-shaped, which no
    longer depends on N; a restore at any device count (``from_stored``) gives
    every device that mean. The rule: **resumed on N' devices, each of them
    starts with the error ē the N devices had on average**, and the run
    continues as the uninterrupted one would have (exactly, in exact
    arithmetic; to rounding in floating point, since ``Σ (g_i + ē)`` rounds
    differently from ``Σ (g_i + e_i)``: this holds at the same N too, so a
    PowerSGD resume agrees with an uninterrupted run to rounding, not bit for
    bit). Two assumptions are the elastic resume's own: the same global batch,
    and a mean gradient that does not depend on N (no per-device BatchNorm).
    tests/test_compression.py resumes a run saved on 4 devices on 2.
"""

from typing import Callable, Dict, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

def leaf_name(path) -> str:
    """'layer1.0.conv1.kernel' for a tree path (dots: torch-like, and safe as a checkpoint key)."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def to_matrix(x):
    """torch's ``tensor.view(tensor.shape[0], -1)`` of a Flax leaf in torch layout.

    Flax kernels keep (..., in, out); torch keeps (out, in, ...): move the last two
    axes to the front, reversed. Vectors become (n, 1).
    """
    if x.ndim >= 2:
        x = jnp.transpose(x, (x.ndim - 1, x.ndim - 2) + tuple(range(x.ndim - 2)))
    return x.reshape(x.shape[0], -1)


def from_matrix(m, like_shape):
    """Inverse of ``to_matrix``."""
    nd = len(like_shape)
    if nd < 2:
        return m.reshape(like_shape)
    torch_shape = (like_shape[-1], like_shape[-2]) + tuple(like_shape[:-2])
    inverse = tuple(range(2, nd)) + (1, 0)
    return jnp.transpose(m.reshape(torch_shape), inverse)


def matrix_shape(shape):
    if len(shape) == 0:
        return (1, 1)
    if len(shape) == 1:
        return (shape[0], 1)
    rows = shape[-1]
    return rows, int(np.prod(shape)) // rows


def orthogonalize(m, epsilon: float = 0.0):
    """torch's ``_orthogonalize`` of one (rows, r) matrix: Gram-Schmidt for r <= 2, else QR."""
    r = m.shape[1]
    if r > 2:
        return jnp.linalg.qr(m, mode="reduced")[0]
    for i in range(r):
        col = m[:, i:i + 1]
        norm = jnp.linalg.norm(col, axis=0, keepdims=True)
        col = col / (norm + epsilon) if epsilon else col / norm
        m = m.at[:, i:i + 1].set(col)
        if i + 1 < r:
            rest = m[:, i + 1:]
            m = m.at[:, i + 1:].set(rest - jnp.sum(col * rest, axis=0, keepdims=True) * col)
    return m


def _concat(parts, dtype):
    return jnp.concatenate([p.ravel() for p in parts]) if parts else jnp.zeros((0,), dtype)


def _split(flat, shapes):
    out, offset = [], 0
    for shape in shapes:
        size = int(np.prod(shape))
        out.append(flat[offset:offset + size].reshape(shape))
        offset += size
    return out


class PowerSGD:
    """torch's ``PowerSGDState`` hyperparameters plus the JAX state layout.

    ``initial_q``: optional ``{leaf name: (cols, r) array}`` (torch layout) used as
    the first Q instead of our random draw, e.g. torch's Qs for a parity run.
    """

    def __init__(self, rank: int = 1, *, start_iter: int = 1000, min_compression_rate: float = 2,
                 use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0.0, seed: int = 0,
                 initial_q: Optional[Mapping[str, np.ndarray]] = None):
        if rank < 1:
            raise ValueError(f"powersgd rank must be >= 1, got {rank}")
        if (use_error_feedback or warm_start) and start_iter <= 1:
            # torch refuses this too (DDP rebuilds its buckets after iteration 1).
            raise ValueError("powersgd start_iter must be > 1 with error feedback or warm start (torch's rule)")
        self.rank = rank
        self.start_iter = start_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.epsilon = orthogonalization_epsilon
        self.seed = seed
        self.initial_q = dict(initial_q or {})

    def plan(self, params) -> Dict[str, int]:
        """{leaf name: matrix rank r} for the leaves that get compressed (torch's ``_should_compress``)."""
        plan = {}
        for path, x in jax.tree_util.tree_leaves_with_path(params):
            if x.ndim == 0:
                continue
            rows, cols = matrix_shape(x.shape)
            r = min(rows, cols, self.rank)
            if (rows + cols) * r * self.min_compression_rate < rows * cols:
                plan[leaf_name(path)] = r
        return plan

    def _random_q(self, name_index: int, cols: int, r: int, dtype, step=None):
        key = jax.random.fold_in(jax.random.key(self.seed), name_index)
        if step is not None:
            key = jax.random.fold_in(key, step)
        return jax.random.normal(key, (cols, r), dtype)

    def init(self, params, num_devices: int):
        """The initial ``extra``: zero errors (one per device) and the first Qs."""
        extra = {}
        if self.use_error_feedback:
            extra["error"] = jax.tree_util.tree_map(
                lambda x: np.zeros((num_devices,) + x.shape, x.dtype), params)
        if self.warm_start:
            plan, shapes = self.plan(params), _shapes_by_name(params)
            unknown = set(self.initial_q) - set(plan)
            if unknown:
                raise ValueError(f"initial_q for leaves that are not compressed: {sorted(unknown)}")
            q = {}
            for i, (name, r) in enumerate(plan.items()):
                shape, dtype = shapes[name]
                cols = matrix_shape(shape)[1]
                if name in self.initial_q:
                    value = np.asarray(self.initial_q[name], dtype)
                    if value.shape != (cols, r):
                        raise ValueError(f"initial_q[{name!r}] has shape {value.shape}, expected {(cols, r)}")
                    q[name] = value
                else:
                    q[name] = self._random_q(i, cols, r, dtype)
            extra["q"] = q
        return extra

    def specs(self, axis):
        """PartitionSpec prefix for ``extra``: the error is per device, Q replicated."""
        specs = {}
        if self.use_error_feedback:
            specs["error"] = P(axis)
        if self.warm_start:
            specs["q"] = P()
        return specs

    def stored(self, extra):
        """``extra`` -> its checkpoint form, independent of N: the devices' mean error
        (params-shaped) and Q (see the module docstring). Global arrays in, global arrays
        out (under ``jit`` the mean is one all-reduce)."""
        out = dict(extra)
        if "error" in out:
            out["error"] = jax.tree_util.tree_map(lambda e: jnp.mean(e, axis=0), out["error"])
        return out

    def from_stored(self, stored, num_devices: int):
        """The checkpoint form -> ``extra`` for ``num_devices`` devices: each device gets the
        saved mean error (the rule in the module docstring), Q as saved."""
        out = dict(stored)
        if "error" in out:
            out["error"] = jax.tree_util.tree_map(
                lambda e: jnp.broadcast_to(e[None], (num_devices,) + e.shape), out["error"])
        return out

    def reduce(self, grads, extra, step, axis, sum_fn: Callable, vanilla: Callable):
        """Per device: (averaged grads, new extra). ``vanilla(grads)`` is the plain DDP average."""
        return jax.lax.cond(
            step < self.start_iter,
            lambda g, e: (vanilla(g), e),
            lambda g, e: self._compress(g, e, step, axis, sum_fn),
            grads, extra,
        )

    def _compress(self, grads, extra, step, axis, sum_fn):
        n = jax.lax.axis_size(axis)
        named, treedef = jax.tree_util.tree_flatten_with_path(grads)
        names = [leaf_name(p) for p, _ in named]
        xs = [g for _, g in named]
        if self.use_error_feedback:
            xs = [x + e[0] for x, e in zip(xs, jax.tree_util.tree_leaves(extra["error"]))]
        plan = self.plan(grads)
        dtype = xs[0].dtype
        out = list(xs)

        # Uncompressed tensors: one SUM all-reduce, then divide (torch's order).
        plain = [i for i, name in enumerate(names) if name not in plan]
        for i, y in zip(plain, _split(sum_fn(_concat([xs[i] for i in plain], dtype), axis) / n,
                                      [xs[i].shape for i in plain])):
            out[i] = y

        packed = [i for i, name in enumerate(names) if name in plan]
        ms = [to_matrix(xs[i]) for i in packed]
        if self.warm_start:
            qs = [extra["q"][names[i]] for i in packed]
        else:
            order = list(plan)
            qs = [self._random_q(order.index(names[i]), m.shape[1], plan[names[i]], dtype, step)
                  for i, m in zip(packed, ms)]
        qs = [orthogonalize(q, self.epsilon) for q in qs]
        ps = [m @ q for m, q in zip(ms, qs)]
        ps = _split(sum_fn(_concat(ps, dtype), axis), [p.shape for p in ps])
        ps = [orthogonalize(p, self.epsilon) for p in ps]
        qs = [m.T @ p for m, p in zip(ms, ps)]
        qs = _split(sum_fn(_concat(qs, dtype), axis) / n, [q.shape for q in qs])
        for i, p, q in zip(packed, ps, qs):
            out[i] = from_matrix(p @ q.T, xs[i].shape)

        new_extra = {}
        if self.use_error_feedback:
            new_extra["error"] = jax.tree_util.tree_unflatten(
                treedef, [(x - y)[None] for x, y in zip(xs, out)])
        if self.warm_start:
            new_extra["q"] = {names[i]: q for i, q in zip(packed, qs)}
        return jax.tree_util.tree_unflatten(treedef, out), new_extra


def _shapes_by_name(tree):
    return {leaf_name(p): (x.shape, x.dtype) for p, x in jax.tree_util.tree_leaves_with_path(tree)}
