"""ZeRO stages 1, 2 and 3 and HSDP: DDP with the model state sharded over the data axis.

One module, parameterised by the stage and the mesh. Against ``ddp.py``, per device:

- **stage 1** (torch ``ZeroRedundancyOptimizer``): forward/backward and the bucketed
  all-reduce as DDP (its compression hooks too); **new**: each device takes its chunk
  (``layout.py``) of every gradient and parameter and runs the optimizer on that chunk
  with its 1/N of the optimizer state; **new**: the updated chunks are all-gathered,
  bucket by bucket, into the full replicated params.
- **stage 2**: one line moves: the bucketed all-reduce becomes a bucketed
  reduce-scatter ``psum_scatter(g / N)``: each device receives only the averaged chunk
  it updates (torch FSDP with ``reshard_after_forward=False``).
- **stage 3** (FSDP): the params are chunks at rest too. The forward runs the user's loss
  function with every FSDP unit's params gathered just before the unit runs, and
  gathered again in backward (``units.py``); the root unit (params outside every unit)
  is gathered once per step. **Gone**: the explicit reduce-scatter (the transpose of the
  forward's all-gather is ``psum_scatter``: only divide by N) and the final all-gather
  (each device updates its chunk, and the chunks are the params).
- **HSDP** = stage 3 on an (R, S) mesh ("replica", "data"): sharded within each group of
  S devices, and the reduce-scattered chunks all-reduced across the R replicas,
  ``psum(g / N, "replica")`` with N = R·S. The params are cast to per-device along
  "replica" (the check_vma trap). The batch is split over both axes, device (r, s)
  taking slice r·S + s, so batches and BN buffers (global device 0's) follow DDP.

Model state per device (f32, K optimizer bytes per param): stage 1: 4Ψ + 4Ψ + KΨ/N;
stage 2: 4Ψ + 4Ψ/N + KΨ/N; stage 3: (8 + K)Ψ/N; HSDP: (8 + K)Ψ/S.
Traffic per device in ring terms: stage 1: 3Ψ(N-1)/N (all-reduce + all-gather, as torch's
ZeroRedundancyOptimizer); stage 2: 2Ψ(N-1)/N; stage 3: 3Ψ(N-1)/N (gather, re-gather,
reduce-scatter: 1.5x DDP); HSDP: 3Ψ(S-1)/S + 2(Ψ/S)(R-1)/R.

Accumulation (``accum_steps`` K): stages 1 and 2 sum the local gradients over the K
micro-batches and communicate once, as DDP's ``no_sync``. Stage 3 gathers, re-gathers and
reduce-scatters every micro-batch and sums the chunks (torch FSDP without ``no_sync``):
one reduction per K micro-batches needs the full local gradient to accumulate into,
exactly the 4Ψ per device ZeRO-3 exists to remove. ``accum_reduce="once"`` makes that
trade on request (``accum_once.py``). The sum is linear, so the result is DDP's either way. Only elementwise optimizers shard this way (all of ``jaxdp.optim``'s): a
transform that reduces over whole tensors would see only a chunk, so it is refused at init
(``jaxdp.loss.reductions.check_shardable``); ``jaxdp.clip_by_global_norm`` is the sharded clip.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from jaxdp.runtime.mesh import DATA_AXIS, REPLICA_AXIS, MeshDims, MeshError
from jaxdp.strategies import accum_once, casts, ddp, layout
from jaxdp.strategies.accum_once import Unsharded
from jaxdp.strategies.base import Strategy
from jaxdp.strategies.device_math import ddp_buffers, local_grads, train_metrics
from jaxdp.strategies.errors import StrategyError
from jaxdp.strategies.sync.buckets import bucket_groups, leaf_path
from jaxdp.strategies.factsheet import Facts
from jaxdp.strategies.options import refuse_untaken
from jaxdp.strategies.sync.allreduce import AllReduce, bucket_limits, refuse_with_tensor_parallel
from jaxdp.strategies.sync.sharded import GatherOnUse, ReduceScatter, all_gather
from jaxdp.strategies.nnx_units import units_for
from jaxdp.strategies.units import Lead, fsdp_unit, in_unit

# Why a stage refuses an option another name takes (its facts' ``why_not``; ``strategies.options`` says it).
REASONS = {
    **dict.fromkeys(("allreduce", "compress", "powersgd_rank", "powersgd_start_iter", "powersgd_options"),
                    "allreduce/compress are all-reduce hooks: zero{stage} reduce-scatters instead (use ddp or zero1)"),
    "units": "units are ZeRO-3's gather-on-use units; zero{stage} keeps params whole",
    "remat": "remat is ZeRO-3's choice for its FSDP units; zero{stage} keeps params whole",
    "bucket_cap_mb": "bucket_cap_mb sizes all-reduce/reduce-scatter buckets; zero{stage} moves params and grads per "
                     "FSDP unit",
    "mesh_shape": "mesh_shape is hsdp's (replicas, shards)",
    "reduce_dtype": "reduce_dtype is ZeRO-3's, whose gradients leave the gathers' transposes; zero{stage} reduces "
                    "them as its params' dtype",
    "accum_reduce": "accum_reduce is ZeRO-3's choice under accumulation; zero{stage} reduces once per update already",
}
SHARDED = frozenset({"units", "remat", "reduce_dtype", "accum_reduce"})  # ZeRO-3's own options


def why_not(stage: int, takes) -> dict:
    return {option: reason.format(stage=stage) for option, reason in REASONS.items() if option not in takes}


# Each stage's facts as a diff against the one before; traffic in ring bytes per device per step (see above).
ZERO1 = Facts("zero1", twin="DDP (optional comm hook) + ZeroRedundancyOptimizer",
              sharded=("opt",), takes=ddp.ALL_REDUCE_OPTIONS, why_not=why_not(1, ddp.ALL_REDUCE_OPTIONS),
              traffic=lambda s: s.allreduce + (s.n - 1) / s.n * s.p * s.psi_pad,  # DDP's + gather the updated chunks
              traffic_text="{allreduce} + (N-1)/N·pΨ_pad all-gather")
ZERO2 = dataclasses.replace(
    ZERO1, name="zero2", twin="FSDP2 fully_shard(reshard_after_forward=False)",
    sharded=("grads", "opt"), traffic=lambda s: 2 * (s.n - 1) / s.n * s.p * s.psi_pad, traffic_text="2Ψ_pad·p(N-1)/N",
    takes=frozenset({"bucket_cap_mb"}), why_not=why_not(2, {"bucket_cap_mb"}))  # no all-reduce to hook
ZERO3 = dataclasses.replace(
    ZERO2, name="zero3", twin="FSDP2 fully_shard(reshard_after_forward=True)",
    sharded=("params", "grads", "opt"), takes=SHARDED, why_not=why_not(3, SHARDED),
    traffic=lambda s: (s.n - 1) / s.n * s.p * (3 * s.psi_pad - s.root_pad),  # units gathered twice, the root once
    traffic_text="(3Ψ_pad - Ψ_root)p(N-1)/N")  # units, not buckets
STAGES = {1: ZERO1, 2: ZERO2, 3: ZERO3}


def hsdp_traffic(s) -> float:
    """Stage 3 within the S-device shard groups, plus each chunk all-reduced across the R replicas."""
    r, g = s.mesh_shape
    return (g - 1) / g * s.p * (3 * s.psi_pad - s.root_pad) + 2 * (r - 1) / r * s.p * s.psi_pad / g


HSDP = dataclasses.replace(ZERO3, name="hsdp", twin="FSDP2 on a 2-D DeviceMesh (replicate, shard)",
                           takes=ZERO3.takes | {"mesh_shape"}, why_not=why_not(3, ZERO3.takes | {"mesh_shape"}),
                           traffic=hsdp_traffic, traffic_text="(3Ψ_pad - Ψ_root)p(S-1)/S + 2(Ψ_pad p/S)(R-1)/R")


def facts_for(stage: int = 3, hsdp: bool = False) -> Facts:
    if stage not in STAGES:
        raise StrategyError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
    if hsdp and stage != 3:
        raise StrategyError("hsdp is ZeRO stage 3 on a 2-D mesh")
    return HSDP if hsdp else STAGES[stage]


class ZeRO(Strategy):
    facts_for = staticmethod(facts_for)

    def __init__(self, model, task, tx, mesh, options=None, *, stage: int = 3, hsdp: bool = False, units=(),
                 powersgd_options=None, **kwargs):
        # Replicate x shard is a degree of the mesh: ZeRO-3 on a mesh with replica > 1 is HSDP.
        hsdp = hsdp or (stage == 3 and MeshDims.of(mesh).size(REPLICA_AXIS) > 1)
        self.stage, self.hsdp = stage, hsdp
        self.facts = facts_for(stage, hsdp)
        refuse_untaken(self.facts, [k for k, v in (("units", units), ("powersgd_options", powersgd_options)) if v])
        if hsdp:
            self.batch_axes = (REPLICA_AXIS, DATA_AXIS)
        super().__init__(model, task, tx, mesh, options, **kwargs)
        o = self.options
        if units and self.pp is not None:
            raise StrategyError("zero3 units are gathered module by module; on pipeline stages each stage's "
                                "params are one vector, gathered whole: drop units")
        refuse_with_tensor_parallel(self, o.allreduce, o.compress)
        self.limits = bucket_limits(o.bucket_cap_mb)  # the params' all-gather and zero2's reduce-scatter buckets
        if o.accum_reduce == "once" and self.pp is not None:
            raise StrategyError("accum_reduce once keeps each FSDP unit's unsharded gradient; on pipeline stages "
                                "there are no units: drop it")
        self.reduce_dtype = jnp.dtype(o.reduce_dtype) if o.reduce_dtype else None  # None: the params' own
        self.sync = (AllReduce.of(o, powersgd_options) if stage == 1
                     else ReduceScatter() if stage == 2 else GatherOnUse(REPLICA_AXIS if hsdp else None,
                                                                         self.reduce_dtype))
        self.check_vma = o.allreduce != "ring"
        self.units = units_for(model, units)  # Linen's or an NNX model's (nnx_units.py)
        self.task, self.eval_task = self.units.prepared(self.task), self.units.prepared(self.eval_task)
        # What a unit keeps for backward, bound where the option is read: each unit runs
        # fsdp_unit with it (--remat reaches it in three calls: docs/architecture.md).
        self.run_unit = functools.partial(fsdp_unit, remat=o.remat)
        self.unit_paths = None

    def mesh_for(self, mesh):
        """HSDP: the data-parallel devices as (replicas, shards), ``mesh_shape`` or the default."""
        return hsdp_mesh(mesh, self.options.mesh_shape) if self.hsdp else mesh

    def learn_units(self, init, batch):
        self.unit_paths = []
        if not self.units:
            return super().learn_units(init, batch)
        self.unit_paths, shapes = self.units.locate(init, batch)  # traces init once: the order too
        return shapes

    # -- per device -----------------------------------------------------------------------------
    def local_step(self, state, batch):
        whole = not self.sharded_params  # stages 1 and 2 hold the params whole; stage 3 and HSDP as chunks
        task = self.step_task()
        loss_fn = task.loss_fn if whole else self.gathering_loss(task, lambda t: t.loss_fn)
        params = self.differentiated(state.params)
        once = not whole and self.options.accum_reduce == "once"
        if once:
            accum_once.refuse_unless_it_fits(self.mesh.devices.flat[0], state, self.local_shapes)
        loss, grads, model_state, metrics = local_grads(
            loss_fn, Unsharded(params, None) if once else params, state.model_state, batch,
            self.step_key(state.step), self.options.accum_steps,
            grad_at=(lambda: accum_once.unsharded_zeros(params, self.local_shapes, self.axis, self.shards),
                     lambda p, z: Unsharded(p.chunks, z)) if once else None)
        if once:  # the summed whole gradients, reduce-scattered once per update
            grads = accum_once.scatter_unit_by_unit(grads, self.local_shapes, self.unit_paths, self.axis,
                                                    self.shards, self.reduce_dtype)
        grads, extra = self.chunk_of_average(grads, state)
        my_params = self.my_chunks(state.params) if whole else state.params
        updates, opt_state = self.tx.update(grads, state.opt_state, my_params)
        new_params = optax.apply_updates(my_params, updates)
        new_state = state.replace(
            step=state.step + 1,
            params=self.gather(new_params) if whole else new_params,  # stage 3: the chunks are the params
            model_state=ddp_buffers(model_state, self.batch_axes, self.options.sync_bn),
            opt_state=opt_state,
            extra=extra,
        )
        full_grads = self.gather(grads, per_tensor=not whole) if self.return_grads else None
        return new_state, self.with_grad_norm(train_metrics(loss, metrics, self.batch_axes, full_grads), grads,
                                              chunked=True)

    def differentiated(self, params):
        """The params the gradient is taken at, per device along the axes they are replicated over
        (the check_vma trap: base.py): data for whole params; HSDP's chunks, along replica."""
        if not self.sharded_params:
            return jax.lax.pcast(params, self.axis, to="varying")
        return jax.lax.pcast(params, REPLICA_AXIS, to="varying") if self.hsdp else params

    def chunk_of_average(self, grads, state):
        """This device's chunk of the averaged gradient, and the sync's new state: zero2, zero3 and
        HSDP sync straight to chunks; zero1 all-reduces as DDP, then takes its chunk."""
        where = self.where(state.step, shards=self.shards, groups=self.bucket_groups())
        grads, extra = self.sync.update(grads, state.extra, where)
        return (grads if "grads" in self.facts.sharded else self.my_chunks(grads)), extra

    def local_eval(self, state, batch):
        # As in training, one unit's params at a time: evaluation must fit where training does.
        if not self.sharded_params:
            return self.eval_task.eval_fn(state.params, state.model_state, batch)
        evaluating = self.gathering_loss(self.eval_task, lambda t: lambda p, ms, b, _: t.eval_fn(p, ms, b))
        return evaluating(state.params, state.model_state, batch, None)

    # -- collectives ------------------------------------------------------------------------------
    def gathering_loss(self, task, loss_of):
        """``loss_of(task)``, a loss function, on param chunks: the root unit gathered up front, every
        unit on use (``units.py``).

        Each param is gathered in the dtype the loss casts it to (``casts.single_casts``: bfloat16 under
        bfloat16 compute, the norm layers' params as they are), and its gradient reduce-scattered in
        ``reduce_dtype``. ``params`` may be ``(chunks, unsharded)`` (``accum_reduce="once"``): then the
        gradient goes whole to ``unsharded``, zeros of the full shapes, and nothing is reduce-scattered."""
        axis, n, shapes = self.axis, self.shards, self.local_shapes  # one model slice of each param
        reduce_dtype, cast_to = self.reduce_dtype, []  # cast_to: per leaf, read from the loss on first use

        def gather_leaf(c, s, dtype, unsharded=None):
            if unsharded is None:
                return layout.gather_as(c, s.shape, axis, n, dtype, reduce_dtype)
            return layout.gather_unsharded_grad(c, unsharded, s.shape, axis, n, dtype)

        def gather_tree(chunks, full, dtypes, unsharded):
            if unsharded is None:
                return jax.tree_util.tree_map(gather_leaf, chunks, full, dtypes)
            return jax.tree_util.tree_map(gather_leaf, chunks, full, dtypes, unsharded)

        def gather_unit(leads, unsharded, module, call, variables, mutable, args, kwargs):
            full, dtypes, mine = shapes, cast_to[0], unsharded
            for k in module.path:
                full, dtypes, mine = full[k], dtypes[k], None if mine is None else mine[k]
            state = {c: v for c, v in variables.items() if c != "params"}
            chunks = variables["params"] if mine is None else (variables["params"], mine)
            gather = (lambda c: gather_tree(c, full, dtypes, None)) if mine is None else \
                (lambda pair: gather_tree(pair[0], full, dtypes, pair[1]))
            # Each unit's collectives wait for the previous unit's Lead: one unit ahead (units.Lead).
            out, updated, lead = self.run_unit(call, gather, chunks, state, args, kwargs, mutable, lead=leads[-1])
            leads.append(lead)
            return out, updated

        def run(params, model_state, batch, key):
            chunks, unsharded = params if isinstance(params, Unsharded) else (params, None)
            if not cast_to:  # pipeline stages read their one params vector by slices: no single cast to find
                cast_to.append(casts.none_of(shapes) if self.pp is not None else
                               casts.single_casts(loss_of(task), shapes, model_state, batch, key))

            def root_gather(path, c, s, dtype, *whole):
                return c if in_unit(leaf_path(path), self.unit_paths) else gather_leaf(c, s, dtype, *whole)
            params = jax.tree_util.tree_map_with_path(root_gather, chunks, shapes, cast_to[0],
                                                      *(() if unsharded is None else (unsharded,)))
            leads = [Lead.of_root()]  # then each unit's, in order
            with self.units.on_use(task, functools.partial(gather_unit, leads, unsharded)) as gathering:
                return loss_of(gathering)(params, model_state, batch, key)
        return run

    def my_chunks(self, tree):
        """This device's chunk of every tensor of a tree all devices hold whole."""
        return jax.tree_util.tree_map(lambda x: layout.my_chunk(x, self.axis, self.shards), tree)

    def gather(self, chunks, per_tensor: bool = False):
        """Full tensors from every device's chunks: one all-gather per DDP-sized bucket (or per tensor)."""
        shapes = [s.shape for s in jax.tree_util.tree_leaves(self.local_shapes)]
        groups = [[i] for i in range(len(shapes))] if per_tensor else self.bucket_groups()
        return all_gather(chunks, shapes, groups, self.axis, self.shards)

    def bucket_groups(self):
        """DDP's buckets (reverse definition order, torch's sizes) as groups of leaf indices."""
        return bucket_groups(self.local_shapes, self.param_order, self.limits, self.model_split)


def default_hsdp_shape(devices) -> tuple:
    """(replicas, shards) for these devices when the user names none: one shard group per host
    (``MeshDims.hsdp_default``, the one definition torch_ref, bench and gpu-check read too)."""
    return MeshDims.hsdp_default(len(devices), len({d.process_index for d in devices}))


def hsdp_mesh(mesh, mesh_shape=None) -> Mesh:
    """The (replicas, shards) mesh over ``mesh``'s data-parallel devices, host by host (one host's
    devices are consecutive, so a row of the default mesh is a host). Axes beside data
    (``model``, ``stage``) are kept as they are: each of their positions gets the same split."""
    names = tuple(mesh.axis_names)
    if mesh_shape is None and REPLICA_AXIS in names and DATA_AXIS in names:
        return mesh  # named by the user (--mesh replica=2,data=2,model=2)
    beside = tuple(a for a in names if a not in (REPLICA_AXIS, DATA_AXIS))
    devices = np.asarray(mesh.devices).reshape(-1, *[mesh.shape[a] for a in beside])  # (replica x data, ...)
    hosts = [int(d.process_index) for d in devices.reshape(devices.shape[0], -1)[:, 0]]
    devices = devices[np.argsort(hosts, kind="stable")]
    wanted = mesh_shape or default_hsdp_shape(list(devices.reshape(devices.shape[0], -1)[:, 0]))
    try:
        dims = MeshDims.of(mesh).with_replicas(wanted, f"hsdp mesh_shape {','.join(map(str, wanted))}")
    except MeshError as e:
        raise StrategyError(str(e)) from None
    return Mesh(devices.reshape(dims.replica, dims.data, *devices.shape[1:]), (REPLICA_AXIS, DATA_AXIS) + beside)
