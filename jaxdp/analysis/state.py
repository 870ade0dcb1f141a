"""Model state per device, measured, beside the ZeRO formulas; and each strategy's traffic formula.

With Ψ params of p bytes (4 for f32) and K optimizer bytes per param (SGD momentum
K = p, Adam K = 2p, plain SGD 0):

========  ======  ======  ======  ==========================
strategy  params  grads   opt     extra
========  ======  ======  ======  ==========================
ddp, dp   pΨ      pΨ      KΨ      powersgd: pΨ error + p·ΣQ
async     pΨ      pΨ      KΨ      k·pΨ (the last k params)
zero1     pΨ      pΨ      KΨ/N    powersgd: as ddp
zero2     pΨ      pΨ/N    KΨ/N
zero3     pΨ/N    pΨ/N    KΨ/N
hsdp      pΨ/S    pΨ/S    KΨ/S    (S devices per shard group)
========  ======  ======  ======  ==========================

- params, optimizer state and ``extra`` (async's history, PowerSGD's error
  feedback and Qs): the live arrays, ``addressable_shards[0].data.nbytes``
  summed over leaves (device 0's share);
- grads: the averaged gradient each device keeps for the update. It lives only
  inside the step, so there is no array to measure: we *trace* the strategy's own
  step (``jax.eval_shape``, no compile) and read the per-device shapes of what its
  all-reduce returns (ddp, async, zero1: the full average, which ZeRO-1 then cuts
  to its chunk) or, for a strategy without one, of the gradient it hands the
  optimizer (zero2/3, hsdp: this device's chunk; dp: device 0's sum);
- padding: each sharded tensor is cut along one of its own dimensions
  (``strategies/layout.py``): the largest one N divides, or, if none does, its
  largest dimension zero-padded to a multiple of N. So a sharded part holds
  ``Ψ_pad/N`` with ``Ψ_pad = Σ prod(padded_shape(shape, N))`` over the tensors:
  only a tensor with no dimension divisible by N is padded (ResNet-18 at N = 8:
  only the fc bias, 10 -> 16). The optimizer state also holds scalar step counts
  (4 bytes each, replicated). Measured bytes equal the padded formula plus those
  scalars exactly.

Traffic formulas, in ring bytes each device sends per step (c = bytes per communicated
gradient value: p, or 2 with ``--compress bf16|fp16``): ddp and async 2(N-1)/N·cΨ, also
with ``--allreduce ring`` (2(N-1) ppermutes of a 1/N chunk per bucket); zero1
(N-1)/N·(2cΨ + pΨ_pad) (DDP's all-reduce + an all-gather of the updated chunks, as
torch's ZeroRedundancyOptimizer); zero2 2(N-1)/N·pΨ_pad (reduce-scatter + all-gather);
zero3 (N-1)/N·p·(3Ψ_pad - Ψ_root): every FSDP unit's params are gathered in forward and
again in backward and every gradient reduce-scattered once, but the root unit (the params
outside every unit, e.g. the ResNet's stem and fc with ``units=fsdp_units(model)``; the
whole model without units) is gathered once per step and kept through backward, as FSDP2
keeps its root; hsdp the same within the S-device shard groups plus 2(R-1)/R·pΨ_pad/S
across the R replicas; dp (N-1) + ceil(log2 N) times pΨ (a gather to device 0 by N-1
permutes, a binomial broadcast tree); powersgd, compressed branch: 2(N-1)/N·p over the
uncompressed tensors plus (rows + cols)·r per compressed one (zero1: plus its
all-gather). Ψ_pad and Ψ_root are padded for the shard count. The measured total also
holds the small BN-buffer broadcast and metric reductions every strategy does. What each
strategy shards and its traffic formula are its facts (``jaxdp.strategies.facts``).
"""

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxdp.runtime.mesh import DATA_AXIS, REPLICA_AXIS
from jaxdp.strategies import facts
from jaxdp.strategies.factsheet import Sizes
from jaxdp.strategies.layout import padded_shape
from jaxdp.strategies.sync.buckets import leaf_path
from jaxdp.strategies.sync.powersgd import leaf_name, matrix_shape
from jaxdp.strategies.units import in_unit

COMPRESSED_BYTES = {"bf16": 2, "fp16": 2}  # bytes per value on the wire with DDP's low-precision hooks


def param_count(model) -> int:
    """Ψ from the model's shapes alone (``jax.eval_shape``: nothing is allocated or compiled)."""
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3), model.dtype),
                                               train=False))
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(shapes["params"])))


def padded_count(params, n: int) -> int:
    """Ψ_pad: params counted as sharded ``n`` ways (``layout.padded_shape``: only a tensor with no
    dimension divisible by ``n`` grows, along its largest dimension)."""
    return int(sum(np.prod(padded_shape(np.shape(x), n), dtype=np.int64) for x in jax.tree_util.tree_leaves(params)))


def root_params(strategy, params):
    """The params outside every FSDP unit of a ZeRO-3/HSDP strategy (gathered once per step):
    the whole tree when it has no units; None for other strategies."""
    if not strategy.sharded_params:
        return None
    units = strategy.unit_paths or []
    return [x for path, x in jax.tree_util.tree_leaves_with_path(params) if not in_unit(leaf_path(path), units)]


def device_bytes(tree) -> int:
    """Bytes of ``tree`` on the first device that holds each array (shapes with a sharding: what a
    device would hold)."""
    return int(sum(_shard_bytes(x) for x in jax.tree_util.tree_leaves(tree)))


def _shard_bytes(x) -> int:
    if isinstance(x, jax.ShapeDtypeStruct):
        return int(np.prod(x.sharding.shard_shape(x.shape), dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return x.addressable_shards[0].data.nbytes


def state_bytes(state, strategy, params) -> dict:
    """Measured per-device bytes of params, optimizer state (split: per-param leaves, scalar
    counts) and ``extra``. Which optimizer leaves are scalars is read from DDP's layout
    (``tx.init(params)``): dp's leaves all carry a leading device axis."""
    opt = jax.tree_util.tree_leaves(state.opt_state)
    scalar = [x.ndim == 0 for x in jax.tree_util.tree_leaves(jax.eval_shape(strategy.tx.init, params))]
    return {
        "params": device_bytes(state.params),
        "opt": device_bytes([x for x, s in zip(opt, scalar) if not s]),
        "opt_scalars": device_bytes([x for x, s in zip(opt, scalar) if s]),
        "extra": device_bytes(state.extra) if state.extra is not None else 0,
    }


class _SyncSpy:
    """A strategy's ``sync`` (``jaxdp.strategies.sync``) that records the bytes of what it returns."""

    def __init__(self, sync, seen: dict):
        self._sync, self._seen = sync, seen

    def __getattr__(self, name):
        return getattr(self._sync, name)

    def update(self, *args, **kwargs):
        grads, state = self._sync.update(*args, **kwargs)
        self._seen.setdefault("sync", _nbytes(grads))
        return grads, state


def _nbytes(tree) -> int:
    return int(sum(g.size * g.dtype.itemsize for g in jax.tree_util.tree_leaves(tree)))


def kept_grad_bytes(strategy, state, batch) -> int:
    """Per-device bytes of the averaged gradient the strategy keeps (traced, not run).

    The strategy's own step is traced per device (``jax.eval_shape``) with its ``tx`` and
    ``sync`` wrapped to record shapes: the output of its all-reduce if it calls one (ddp,
    async, zero1), else the gradient it hands ``tx.update`` (zero2/3, hsdp: the chunk;
    dp: device 0's sum, in ``pmap``'s per-device shapes).
    """
    seen = {}
    tx, sync = strategy.tx, getattr(strategy, "sync", None)

    def update(grads, opt_state, params=None, **extra_args):
        seen.setdefault("update", _nbytes(grads))
        return tx.update(grads, opt_state, params, **extra_args)

    def probe(state, batch):
        jax.tree_util.tree_leaves(strategy.local_step(state, batch))  # traced for its shapes only
        return jnp.zeros(())

    strategy.tx = optax.GradientTransformation(tx.init, update)
    if sync is not None:
        strategy.sync = _SyncSpy(sync, seen)
    try:
        strategy.engine.per_device_shapes(probe, state, batch)  # per device, as its engine runs the step
    finally:
        strategy.tx = tx
        if sync is not None:
            strategy.sync = sync
    return seen.get("sync", seen["update"])


def _powersgd(strategy):
    return getattr(getattr(strategy, "sync", None), "powersgd", None)


def extra_formula(strategy, params, p: int) -> int:
    """Bytes of ``extra`` per device: async's k params copies; PowerSGD's error (pΨ) and Qs (cols·r each)."""
    psi = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
    powersgd = _powersgd(strategy)
    if powersgd is not None:
        shapes = {leaf_name(path): x.shape for path, x in jax.tree_util.tree_leaves_with_path(params)}
        q = sum(matrix_shape(shapes[name])[1] * r for name, r in powersgd.plan(params).items())
        return p * (psi * powersgd.use_error_feedback + q * powersgd.warm_start)
    return p * psi * strategy.options.staleness


def formula_bytes(name: str, psi: int, psi_pad: int, shards: int, p: int, k: int, extra: int = 0,
                  unsharded_grads: bool = False) -> dict:
    """The ZeRO table: exact (Ψ/N) and with this layout's padding (Ψ_pad/N). ``unsharded_grads``
    (zero3/hsdp with ``accum_reduce="once"``): the gradients summed whole over the micro-batches, pΨ
    more inside the step (``"unsharded_grads"``; 0 otherwise)."""
    sharded = facts(name).sharded
    per_param = {"params": p, "grads": p, "opt": k}
    exact = {part: b * psi / shards if part in sharded else b * psi for part, b in per_param.items()}
    padded = {part: b * psi_pad // shards if part in sharded else b * psi for part, b in per_param.items()}
    whole = p * psi if unsharded_grads else 0
    return {"exact": {**exact, "extra": extra, "unsharded_grads": whole},
            "padded": {**padded, "extra": extra, "unsharded_grads": whole}}


def powersgd_traffic_formula(strategy, params, n: int, p: int) -> float:
    """The compressed step's ring bytes: the uncompressed tensors all-reduced whole, each
    compressed one as its P (rows·r) and Q (cols·r)."""
    plan = _powersgd(strategy).plan(params)
    values = 0
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        name = leaf_name(path)
        values += sum(matrix_shape(x.shape)) * plan[name] if name in plan else int(np.prod(x.shape))
    return 2 * (n - 1) / n * p * values


def strategy_traffic_formula(strategy, params, psi, psi_pad, p, mesh_shape, root_pad: int = 0) -> Optional[float]:
    """The strategy's traffic formula (its ``facts.traffic``; None if it has none), with the ring bytes
    of its all-reduce as its options make them: 2(N-1)/N·cΨ, c = p or the compressed wire's, or PowerSGD's."""
    n, traffic = strategy.num_devices, strategy.facts.traffic
    if _powersgd(strategy) is not None:
        allreduce = powersgd_traffic_formula(strategy, params, n, p)
    else:
        c = COMPRESSED_BYTES.get(getattr(strategy.sync, "compress", None)) or p
        allreduce = 2 * (n - 1) / n * c * psi
    sizes = Sizes(psi, psi_pad, n, p, allreduce, mesh_shape, root_pad)
    return None if traffic is None else traffic(sizes)


def model_state_bytes(formula: dict) -> int:
    """The model state a device keeps between steps, from a ZeRO table (``formula_bytes``): params,
    optimizer state and the strategy's extra (the gradients live inside the step)."""
    return formula["params"] + formula["opt"] + formula["extra"]


def strategy_formulas(strategy) -> dict:
    """Everything the formulas say about a built strategy (its ``shapes`` known), from shapes alone:
    Ψ (whole model) and Ψ_local, Ψ_pad, Ψ_root, p, K (from the optimizer itself: its per-parameter
    state as DDP holds it), the ZeRO table per device (exact and padded) and the traffic per step.
    The table and the data-parallel traffic apply to what one device of the model axis holds
    (the full params without one: Ψ_local = Ψ; ``jaxdp.analysis.axes``)."""
    params = strategy.local_shapes
    leaves = jax.tree_util.tree_leaves(params)
    psi = int(sum(np.prod(x.shape) for x in leaves))
    p = int(np.dtype(leaves[0].dtype).itemsize)
    shards = strategy.shards
    psi_pad = padded_count(params, shards)
    root = root_params(strategy, params)
    root_pad = padded_count(root, shards) if root is not None else None
    per_param = [x for x in jax.tree_util.tree_leaves(jax.eval_shape(strategy.tx.init, params)) if x.ndim]
    k = int(round(sum(x.size * x.dtype.itemsize for x in per_param) / psi))
    unsharded = strategy.sharded_params and getattr(strategy.options, "accum_reduce", "each") == "once"
    formula = formula_bytes(strategy.facts.name, psi, psi_pad, shards, p, k, extra_formula(strategy, params, p),
                            unsharded)
    names = strategy.mesh.axis_names
    mesh_shape = (strategy.mesh.shape[REPLICA_AXIS], strategy.mesh.shape[DATA_AXIS]) if REPLICA_AXIS in names else None
    return {"mesh_shape": mesh_shape, "psi": int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(strategy.shapes))),
            "psi_local": psi, "psi_padded": psi_pad, "psi_root_padded": root_pad, "param_bytes": p,
            "opt_bytes_per_param": k, "formula": formula["exact"], "formula_padded": formula["padded"],
            "traffic_formula_bytes": strategy_traffic_formula(strategy, params, psi, psi_pad, p, mesh_shape,
                                                              root_pad or 0)}
