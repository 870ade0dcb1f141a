"""Where the bytes are: per-device model state, compiled memory and collective traffic.

``jaxdp inspect --strategy zero3 --devices 8 --model resnet18 --optimizer adam``
prints, for one strategy on N devices (about 1 min for ResNet-18 on a 2-core CPU,
most of it compiling the step; ``--no-compile`` skips that part):

1. **Model state per device**, measured, beside the ZeRO formulas. With Ψ
   params of p bytes (4 for f32) and K optimizer bytes per param (SGD momentum
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

2. **Compiled memory per device** of the training step: ``memory_analysis()``
   of ``strategy.lower_step(...).compile()`` (argument, output, alias, temp).

3. **Collectives per step** in the compiled HLO (``compiled.as_text()``):
   all-reduce, all-gather, reduce-scatter, collective-permute and all-to-all,
   including tuple (combined) ops, async ``-start`` forms and ops inside
   called computations, each counted as often as its computation runs (a
   ``while`` body times its known trip count). Per op and device: *input*
   bytes (what the device contributes: all-gather its chunk, reduce-scatter
   the full buffer) and *output* bytes (what it holds after: all-gather the
   full buffer, reduce-scatter its chunk), the replica groups, and the traffic
   in ring terms, bytes each device sends: all-reduce of S bytes 2(G-1)/G·S;
   all-gather or reduce-scatter of a full S (G-1)/G·S; collective-permute S
   (its buffer: for dp's gather to device 0, what device 0 receives per op);
   G = group size. The two branches of a ``conditional`` are alternatives:
   the total counts the larger, and each branch is listed (PowerSGD's step
   holds the plain average, run before ``start_iter``, and the compressed one).
   The same count over the HLO before XLA's passes, ``ring_bytes_as_written``,
   is printed where it differs: XLA:CPU promotes a bf16 all-reduce to f32.

   Formulas, in bytes (c = bytes per communicated gradient value: p, or 2 with
   ``--compress bf16|fp16``): ddp and async 2(N-1)/N·cΨ, also with
   ``--allreduce ring`` (2(N-1) ppermutes of a 1/N chunk per bucket); zero1
   (N-1)/N·(2cΨ + pΨ_pad) (DDP's all-reduce + an all-gather of the updated
   chunks, as torch's ZeroRedundancyOptimizer); zero2 2(N-1)/N·pΨ_pad
   (reduce-scatter + all-gather); zero3 (N-1)/N·p·(3Ψ_pad - Ψ_root): every FSDP
   unit's params are gathered in forward and again in backward and every gradient
   reduce-scattered once, but the root unit (the params outside every unit, e.g.
   the ResNet's stem and fc with ``units=fsdp_units(model)``; the whole model
   without units) is gathered once per step and kept through backward, as FSDP2
   keeps its root; hsdp the same within the S-device shard groups plus
   2(R-1)/R·pΨ_pad/S across the R replicas; dp (N-1) + ceil(log2 N) times pΨ (a
   gather to device 0 by N-1 permutes, a binomial broadcast tree); powersgd,
   compressed branch: 2(N-1)/N·p over the uncompressed tensors plus
   (rows + cols)·r per compressed one (zero1: plus its all-gather). Ψ_pad and
   Ψ_root are padded for the shard count. The measured total also holds the small
   BN-buffer broadcast and metric reductions every strategy does.

``inspect_strategy(...)`` returns all of it as a dict (``--json`` prints that).
"""

import json
import re
import sys
from typing import Optional, Sequence

import numpy as np

# What each strategy shards and its traffic formula are its facts (``jaxdp.strategies.facts``).
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
COMPRESSED_BYTES = {"bf16": 2, "fp16": 2}  # bytes per value on the wire with DDP's low-precision hooks


class InspectError(ValueError):
    """Options that cannot be inspected (one line on the command line)."""


# ----------------------------------------------------------------------------- model-state bytes

def param_count(model) -> int:
    """Ψ from the model's shapes alone (``jax.eval_shape``: nothing is allocated or compiled)."""
    import jax
    import jax.numpy as jnp

    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3), model.dtype),
                                               train=False))
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(shapes["params"])))


def padded_count(params, n: int) -> int:
    """Ψ_pad: params counted as sharded ``n`` ways (``layout.padded_shape``: only a tensor with no
    dimension divisible by ``n`` grows, along its largest dimension)."""
    import jax

    from jaxdp.strategies.layout import padded_shape

    return int(sum(np.prod(padded_shape(np.shape(x), n), dtype=np.int64) for x in jax.tree_util.tree_leaves(params)))


def root_params(strategy, params):
    """The params outside every FSDP unit of a ZeRO-3/HSDP strategy (gathered once per step):
    the whole tree when it has no units; None for other strategies."""
    import jax

    from jaxdp.strategies.buckets import leaf_path
    from jaxdp.strategies.units import in_unit

    if not strategy.sharded_params:
        return None
    units = strategy.unit_paths or []
    return [x for path, x in jax.tree_util.tree_leaves_with_path(params) if not in_unit(leaf_path(path), units)]


def device_bytes(tree) -> int:
    """Bytes of ``tree`` on the first device that holds each array."""
    import jax

    return int(sum(x.addressable_shards[0].data.nbytes for x in jax.tree_util.tree_leaves(tree)))


def state_bytes(state, strategy, params) -> dict:
    """Measured per-device bytes of params, optimizer state (split: per-param leaves, scalar
    counts) and ``extra``. Which optimizer leaves are scalars is read from DDP's layout
    (``tx.init(params)``): dp's leaves all carry a leading device axis."""
    import jax

    opt = jax.tree_util.tree_leaves(state.opt_state)
    scalar = [x.ndim == 0 for x in jax.tree_util.tree_leaves(jax.eval_shape(strategy.tx.init, params))]
    return {
        "params": device_bytes(state.params),
        "opt": device_bytes([x for x, s in zip(opt, scalar) if not s]),
        "opt_scalars": device_bytes([x for x, s in zip(opt, scalar) if s]),
        "extra": device_bytes(state.extra) if state.extra is not None else 0,
    }


class _SyncSpy:
    """A strategy's ``sync`` (``sync.AllReduce``) that records the bytes of what it returns."""

    def __init__(self, sync, seen: dict):
        self._sync, self._seen = sync, seen

    def __getattr__(self, name):
        return getattr(self._sync, name)

    def __call__(self, *args, **kwargs):
        grads, state = self._sync(*args, **kwargs)
        self._seen.setdefault("sync", _nbytes(grads))
        return grads, state


def _nbytes(tree) -> int:
    import jax

    return int(sum(g.size * g.dtype.itemsize for g in jax.tree_util.tree_leaves(tree)))


def kept_grad_bytes(strategy, state, batch) -> int:
    """Per-device bytes of the averaged gradient the strategy keeps (traced, not run).

    The strategy's own step is traced per device (``jax.eval_shape``) with its ``tx`` and
    ``sync`` wrapped to record shapes: the output of its all-reduce if it calls one (ddp,
    async, zero1), else the gradient it hands ``tx.update`` (zero2/3, hsdp: the chunk;
    dp: device 0's sum, in ``pmap``'s per-device shapes).
    """
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    seen = {}
    tx, sync = strategy.tx, getattr(strategy, "sync", None)

    def update(grads, opt_state, params=None, **extra_args):
        seen.setdefault("update", _nbytes(grads))
        return tx.update(grads, opt_state, params, **extra_args)

    def probe(state, batch):
        jax.tree_util.tree_leaves(step(state, batch))  # traced for its shapes only
        return jnp.zeros(())

    strategy.tx = optax.GradientTransformation(tx.init, update)
    if sync is not None:
        strategy.sync = _SyncSpy(sync, seen)
    try:
        if strategy.name == "dp":  # pmap hands each device its own state and batch
            step = strategy._device_step
            jax.eval_shape(jax.pmap(probe, axis_name=strategy.axis, devices=strategy.devices), state, batch)
        else:
            step = strategy.local_step
            jax.eval_shape(jax.shard_map(probe, mesh=strategy.mesh, out_specs=P(), check_vma=strategy.check_vma,
                                         in_specs=(strategy.state_specs(state), P(strategy.batch_axes))),
                           state, batch)
    finally:
        strategy.tx = tx
        if sync is not None:
            strategy.sync = sync
    return seen.get("sync", seen["update"])


def _powersgd(strategy):
    return getattr(getattr(strategy, "sync", None), "powersgd", None)


def extra_formula(strategy, params, p: int) -> int:
    """Bytes of ``extra`` per device: async's k params copies; PowerSGD's error (pΨ) and Qs (cols·r each)."""
    import jax

    from jaxdp.compression import leaf_name, matrix_shape

    psi = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
    powersgd = _powersgd(strategy)
    if powersgd is not None:
        shapes = {leaf_name(path): x.shape for path, x in jax.tree_util.tree_leaves_with_path(params)}
        q = sum(matrix_shape(shapes[name])[1] * r for name, r in powersgd.plan(params).items())
        return p * (psi * powersgd.use_error_feedback + q * powersgd.warm_start)
    return p * psi * getattr(strategy, "staleness", 0)


def formula_bytes(name: str, psi: int, psi_pad: int, shards: int, p: int, k: int, extra: int = 0) -> dict:
    """The ZeRO table: exact (Ψ/N) and with this layout's padding (Ψ_pad/N)."""
    from jaxdp.strategies import facts

    sharded = facts(name).sharded
    per_param = {"params": p, "grads": p, "opt": k}
    exact = {part: b * psi / shards if part in sharded else b * psi for part, b in per_param.items()}
    padded = {part: b * psi_pad // shards if part in sharded else b * psi for part, b in per_param.items()}
    return {"exact": {**exact, "extra": extra}, "padded": {**padded, "extra": extra}}


def powersgd_traffic_formula(strategy, params, n: int, p: int) -> float:
    """The compressed step's ring bytes: the uncompressed tensors all-reduced whole, each
    compressed one as its P (rows·r) and Q (cols·r)."""
    import jax

    from jaxdp.compression import leaf_name, matrix_shape

    plan = _powersgd(strategy).plan(params)
    values = 0
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        name = leaf_name(path)
        values += sum(matrix_shape(x.shape)) * plan[name] if name in plan else int(np.prod(x.shape))
    return 2 * (n - 1) / n * p * values


# ----------------------------------------------------------------------------- HLO collectives

_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9](?:fn|fnuz)?)?)\[([0-9,]*)\]")
_OP = re.compile(r"\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
# "%name (params) -> shape {" (optimized HLO) or "name {" (before XLA's passes), at column 0
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*)?\{\s*$")
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _shapes_bytes(text: str) -> float:
    total = 0.0
    for dtype, dims in _SHAPE.findall(text):
        if dtype.startswith("f8"):
            size = 1
        elif dtype in _DTYPE_BYTES:
            size = _DTYPE_BYTES[dtype]
        else:
            continue  # token[], opaque
        total += size * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_LIST_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")


def replica_groups(line: str, num_devices: int):
    """The op's device groups: explicit ``{{0,4},{1,5}}``, iota ``[G,S]<=[dims]T(perm)``
    (iota over dims, transposed by perm, cut into G groups of S), or every device (``{}``/absent)."""
    m = _IOTA_GROUPS.search(line)
    if m:
        dims = [int(d) for d in m.group(3).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(d) for d in m.group(4).split(",")])
        return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
    m = _LIST_GROUPS.search(line)
    if m and m.group(1):
        return [[int(d) for d in group.split(",") if d] for group in re.findall(r"\{([\d,]*)\}", m.group(1))]
    return [list(range(num_devices))]


def _result_text(line: str, op_start: int) -> str:
    return line[line.index("=") + 1:op_start]


def _top_level(text: str):
    """Elements of a tuple shape ``(a, (b, c), d)`` at depth 1; the text itself if not a tuple."""
    text = text.strip()
    if not text.startswith("("):
        return [text]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
            parts.append(text[start:i])
            start = i + 1
            if depth == 0:
                break
    return parts


def _async_output(kind: str, result: str) -> str:
    """The output part of an async ``-start`` result: all-gather-start gives (operands, outputs),
    collective-permute-start (operand, output, contexts); all-reduce-start just the outputs."""
    parts = _top_level(result)
    if kind == "all-gather" and len(parts) == 2:
        return parts[1]
    if kind == "collective-permute" and len(parts) >= 2:
        return parts[1]
    return result


def _split_computations(hlo_text: str):
    """({name: {"lines", "entry"}}, names in text order)."""
    computations, current, order = {}, None, []
    for line in hlo_text.splitlines():
        m = None if line[:1].isspace() else _COMPUTATION.match(line.rstrip())
        if m:
            current = m.group(1)
            computations[current] = {"lines": [], "entry": line.lstrip().startswith("ENTRY")}
            order.append(current)
        elif current is not None:
            computations[current]["lines"].append(line)
    return computations, order


def _branches(line: str):
    """The branch computations of a ``conditional`` line, in branch order (true, false for a predicate)."""
    names = [c.strip().lstrip("%") for group in _BRANCHES.findall(line) for c in group.split(",")]
    for key in ("true_computation", "false_computation"):
        m = re.search(key + r"=%?([\w.\-]+)", line)
        if m:
            names.append(m.group(1))
    return names


def _call_graph(computations, order):
    """How often each computation runs per step, and which conditional branch (if any) it is in.

    Returns (runs, branch_of {computation: (conditional id, branch index)}, branch counts
    {conditional id: branches}, while loops of unknown trip count). HLO text lists callees
    before callers, so callers are walked first; a computation inside a branch inherits it.
    """
    runs = {name: (1 if c["entry"] else 0) for name, c in computations.items()}
    branch_of, branch_counts, unknown = {}, {}, 0
    for name in reversed(order):
        for index, line in enumerate(computations[name]["lines"]):
            branches = _branches(line)
            callees = [c for c in _CALLS.findall(line) if c not in branches] + branches
            trip = 1
            if " while(" in line:
                m = _TRIP.search(line)
                trip = int(m.group(1)) if m else 1
                unknown += m is None
            if branches:
                branch_counts[(name, index)] = len(branches)
            for callee in callees:
                if callee not in runs:
                    continue
                is_body = re.search(r"\bbody=%?" + re.escape(callee) + r"\b", line) is not None
                runs[callee] += runs[name] * (trip if is_body else 1)
                tag = branch_of.get(name)  # nested conditionals count as their outermost branch
                if tag is None and callee in branches:
                    tag = ((name, index), branches.index(callee))
                if tag is not None:
                    branch_of.setdefault(callee, tag)
    return runs, branch_of, branch_counts, unknown


def _op_bytes(kind: str, out: float, g: int):
    """(input bytes, ring bytes sent) per device for an op whose per-device output is ``out`` bytes."""
    return {
        "all-reduce": (out, 2 * (g - 1) / g * out),
        "all-gather": (out / g, (g - 1) / g * out),
        "reduce-scatter": (out * g, (g - 1) * out),
        "collective-permute": (out, out),
        "all-to-all": (out, (g - 1) / g * out),
    }[kind]


def parse_collectives(hlo_text: str, num_devices: int) -> dict:
    """Count collectives in optimized HLO text; bytes per device, in ring terms (see module docstring).

    Returns ``{"ops": {kind: {"count", "input_bytes", "output_bytes", "ring_bytes", "by_groups"}},
    "ring_bytes": total, "conditionals": [ring bytes per branch, ...], "unknown_trip_counts": n}``.
    ``ops`` counts every op, in every branch; ``ring_bytes`` counts the larger branch of each
    conditional. ``by_groups``: per distinct replica-group layout (None for collective-permute).
    """
    computations, order = _split_computations(hlo_text)
    runs, branch_of, branch_counts, unknown = _call_graph(computations, order)
    ops = {kind: {"count": 0, "input_bytes": 0.0, "output_bytes": 0.0, "ring_bytes": 0.0, "by_groups": []}
           for kind in COLLECTIVES}
    unconditional, branch_ring = 0.0, {cid: [0.0] * n for cid, n in branch_counts.items()}
    for name, c in computations.items():
        for line in c["lines"]:
            m = _OP.search(line)
            if not m or "=" not in line[:m.start()]:
                continue
            kind, is_start = m.group(1), m.group(2) is not None
            result = _result_text(line, m.start())
            if is_start:
                result = _async_output(kind, result)
            out = _shapes_bytes(result)
            groups = None if kind == "collective-permute" else replica_groups(line, num_devices)
            g = max(len(groups[0]) if groups else num_devices, 1)
            inp, ring = _op_bytes(kind, out, g)
            k = runs.get(name, 1) or 1
            entry = ops[kind]
            entry["count"] += k
            entry["input_bytes"] += k * inp
            entry["output_bytes"] += k * out
            entry["ring_bytes"] += k * ring
            _add_to_groups(entry["by_groups"], groups, k, out, ring)
            if name in branch_of:
                cid, branch = branch_of[name]
                branch_ring[cid][branch] += k * ring
            else:
                unconditional += k * ring
    conditionals = [b for b in branch_ring.values() if any(b)]
    return {"ops": ops, "ring_bytes": unconditional + sum(max(b) for b in conditionals),
            "conditionals": conditionals, "unknown_trip_counts": unknown}


def _add_to_groups(by_groups: list, groups, k: int, out: float, ring: float) -> None:
    for entry in by_groups:
        if entry["groups"] == groups:
            break
    else:
        entry = {"groups": groups, "count": 0, "output_bytes": 0.0, "ring_bytes": 0.0}
        by_groups.append(entry)
    entry["count"] += k
    entry["output_bytes"] += k * out
    entry["ring_bytes"] += k * ring


def compiled_memory(compiled) -> dict:
    m = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
              "generated_code_size_in_bytes")
    return {f.replace("_size_in_bytes", ""): int(getattr(m, f, 0) or 0) for f in fields}


# ----------------------------------------------------------------------------- one strategy

def inspect_strategy(name: str, n: int, *, model: str = "resnet18", width: int = 64,
                     blocks: Optional[Sequence[int]] = None, stem: str = "cifar", optimizer: str = "sgd",
                     dtype: str = "float32", batch_per_device: int = 1, image_size: int = 32,
                     mesh_shape=None, options: Optional[dict] = None, compile: bool = True, seed: int = 0) -> dict:
    """Build strategy ``name`` on ``n`` devices (they must exist: simulate them before jax
    starts) for a freshly initialised model, and ``measure`` it. ``options``: the strategy's
    own (``allreduce``, ``compress``, ``powersgd_rank``, ``staleness``); zero3 and hsdp get
    the model's FSDP units (``jaxdp.models.fsdp_units``) unless ``options`` names ``units``."""
    import jax

    from jaxdp.mesh import make_mesh
    from jaxdp.models import create_model
    from jaxdp.optim import make_optimizer
    from jaxdp.strategies import create_strategy, options_of
    from jaxdp.task import classifier

    if batch_per_device < 1 or image_size < 1:
        raise InspectError(f"--batch-per-device and --image-size must be >= 1, got {batch_per_device}, {image_size}")
    if dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    net = create_model(model, width=width, blocks=blocks, stem=stem, dtype=dtype)
    check_batchnorm_has_values(net, batch_per_device, image_size)
    lr = 0.1 if optimizer == "sgd" else 1e-3
    tx = make_optimizer(optimizer, lr, momentum=0.9) if optimizer == "sgd" else make_optimizer(optimizer, lr)
    options = dict(options or {}, **({"mesh_shape": mesh_shape} if name == "hsdp" else {}))
    strategy = create_strategy(name, net, classifier(net), tx, make_mesh(n), **fsdp_options(name, net, options))
    rng = np.random.default_rng(seed)
    global_batch = batch_per_device * strategy.num_devices
    batch = {"image": rng.normal(size=(global_batch, image_size, image_size, 3)).astype(np.dtype(net.dtype)),
             "label": rng.integers(0, net.num_classes, global_batch).astype(np.int32)}
    report = measure(strategy, batch, seed=seed, compile=compile)
    report.update(model=model, width=width, blocks=list(getattr(net, "stage_sizes", ())), dtype=dtype,
                  optimizer=optimizer, options={k: v for k, v in options.items() if v is not None})
    if "units" in options_of(name):
        report.update(fsdp_units=[getattr(u, "__name__", u) for u in strategy.units.classes + strategy.units.patterns],
                      fsdp_unit_count=len(strategy.unit_paths))
    return report


def fsdp_options(name: str, model, options: Optional[dict] = None) -> dict:
    """``options`` plus, for a strategy that takes ``units`` (zero3, hsdp), ``units=fsdp_units(model)``
    (unless given): the model's own FSDP units, as torch_ref's FSDP2 wraps them."""
    from jaxdp.models import fsdp_units
    from jaxdp.strategies import options_of

    options = dict(options or {})
    if "units" in options_of(name) and "units" not in options:
        options["units"] = fsdp_units(model)
    return options


def check_batchnorm_has_values(net, batch_per_device: int, image_size: int) -> None:
    """InspectError if some BatchNorm would see 1 value per channel on a device: the unbiased
    running variance divides by count - 1. Found by tracing the model (no compute)."""
    import jax

    from jaxdp.models.batchnorm import BatchNorm

    def forward(x):
        variables = net.init(jax.random.key(0), x, train=False)
        _, state = net.apply(variables, x, train=False,
                             capture_intermediates=lambda module, _: isinstance(module, BatchNorm))
        return state.get("intermediates", {})  # none: the model has no BatchNorm

    x = jax.ShapeDtypeStruct((batch_per_device, image_size, image_size, 3), net.dtype)
    outputs = jax.tree_util.tree_leaves(jax.eval_shape(forward, x))
    smallest = min((o.shape for o in outputs), key=lambda shape: int(np.prod(shape[:-1])), default=None)
    if smallest is not None and np.prod(smallest[:-1]) < 2:
        h, w = smallest[1:3]
        raise InspectError(
            f"--image-size {image_size} with --batch-per-device {batch_per_device} leaves a BatchNorm "
            f"{batch_per_device} image(s) of {h}x{w} = 1 value per channel (its running variance divides "
            f"by count - 1); use --batch-per-device 2 or a larger --image-size")


def measure(strategy, batch, *, variables=None, state=None, seed: int = 0, compile: bool = True) -> dict:
    """Everything in the module docstring, for a built strategy and a host batch (a pytree of
    global numpy arrays, e.g. ``{"image", "label"}``). The state measured: ``state`` if given
    (a state of this strategy; nothing is run, so nothing is donated), else ``init_state(variables)``
    for full ``variables`` (``{"params", "batch_stats"}``), else ``strategy.init`` (sharded, from ``seed``)."""
    import jax

    strategy.learn_structure(batch)
    if state is None:
        state = strategy.init(jax.random.key(seed), batch) if variables is None else strategy.init_state(variables)
    params = strategy.shapes  # the full params' shapes and dtypes
    leaves = jax.tree_util.tree_leaves(params)
    psi = int(sum(np.prod(x.shape) for x in leaves))
    p = int(np.dtype(leaves[0].dtype).itemsize)
    shards = strategy.shards
    psi_pad = padded_count(params, shards)
    root = root_params(strategy, params)
    root_pad = padded_count(root, shards) if root is not None else None
    # K from the optimizer itself: its per-parameter state as DDP holds it.
    per_param = [x for x in jax.tree_util.tree_leaves(jax.eval_shape(strategy.tx.init, params)) if x.ndim]
    k = int(round(sum(x.size * x.dtype.itemsize for x in per_param) / psi))
    images = np.asarray(jax.tree_util.tree_leaves(batch)[0])
    sharded = strategy.shard_batch(batch)

    measured = state_bytes(state, strategy, params)
    measured["grads"] = kept_grad_bytes(strategy, state, sharded)
    formula = formula_bytes(strategy.name, psi, psi_pad, shards, p, k, extra_formula(strategy, params, p))
    mesh_shape = tuple(strategy.mesh.devices.shape) if strategy.mesh.devices.ndim == 2 else None
    report = {
        "strategy": strategy.name, "devices": strategy.num_devices, "mesh_shape": mesh_shape, "shards": shards,
        "psi": psi, "psi_padded": psi_pad, "psi_root_padded": root_pad, "param_bytes": p,
        "opt_bytes_per_param": k,
        "batch_per_device": int(images.shape[0]) // strategy.num_devices, "image_size": images.shape[-2],
        "state": {"measured": measured, "formula": formula["exact"], "formula_padded": formula["padded"]},
        "traffic_formula_bytes": strategy_traffic_formula(strategy, params, psi, psi_pad, p, mesh_shape,
                                                          root_pad or 0),
    }
    if compile:
        lowered = strategy.lower_step(state, sharded)
        compiled = lowered.compile()
        report["memory"] = compiled_memory(compiled)
        report["collectives"] = parse_collectives(compiled.as_text(), strategy.num_devices)
        # The program as written, before XLA's passes: XLA:CPU promotes a bf16 all-reduce to f32
        # (measured: 2x the bytes for --compress bf16; fp16 stays 2 bytes).
        written = parse_collectives(lowered.compiler_ir("hlo").as_hlo_text(), strategy.num_devices)
        report["ring_bytes_as_written"] = written["ring_bytes"]
    return report


def strategy_traffic_formula(strategy, params, psi, psi_pad, p, mesh_shape, root_pad: int = 0) -> Optional[float]:
    """The strategy's traffic formula (its ``facts.traffic``; None if it has none), with the ring bytes
    of its all-reduce as its options make them: 2(N-1)/N·cΨ, c = p or the compressed wire's, or PowerSGD's."""
    from jaxdp.strategies.factsheet import Sizes

    n, traffic = strategy.num_devices, strategy.facts.traffic
    if _powersgd(strategy) is not None:
        allreduce = powersgd_traffic_formula(strategy, params, n, p)
    else:
        c = COMPRESSED_BYTES.get(getattr(strategy.sync, "compress", None)) or p
        allreduce = 2 * (n - 1) / n * c * psi
    sizes = Sizes(psi, psi_pad, n, p, allreduce, mesh_shape, root_pad)
    return None if traffic is None else traffic(sizes)


# ----------------------------------------------------------------------------- the table

def _mb(x) -> str:
    return "n/a" if x is None else f"{round(x):,}"


def _formula_name(r: dict) -> str:
    """The strategy's ``facts.traffic_text``, its all-reduce written as its options make it."""
    from jaxdp.strategies import facts

    compress = r.get("options", {}).get("compress")
    if compress == "powersgd":
        allreduce = "compressed step: 2(N-1)/N·p·(uncompressed + Σ(rows+cols)·r)"
    elif compress in COMPRESSED_BYTES:
        allreduce = f"2Ψ·{COMPRESSED_BYTES[compress]}B(N-1)/N, {compress} on the wire"
    else:
        allreduce = "2Ψp(N-1)/N"
    return facts(r["strategy"]).traffic_text.format(allreduce=allreduce)


def format_report(r: dict) -> str:
    mesh = f" (mesh {r['mesh_shape'][0]}x{r['mesh_shape'][1]})" if r.get("mesh_shape") else ""
    size = f" width {r['width']} blocks {','.join(map(str, r['blocks']))}" if r.get("blocks") else ""  # a ResNet's
    what = f": {r['model']}{size}, {r['dtype']}, {r['optimizer']}" if "model" in r else ""
    options = "".join(f", {k} {v}" for k, v in r.get("options", {}).items() if k != "mesh_shape")
    lines = [
        f"{r['strategy']} on {r['devices']} devices{mesh}{what}{options} "
        f"(p = {r['param_bytes']} B, K = {r['opt_bytes_per_param']} B per param)",
        f"Ψ = {r['psi']:,} params; padded for {r['shards']} shards: {r['psi_padded']:,} "
        f"(+{r['psi_padded'] - r['psi']:,})"
        + (f"; root unit (outside every FSDP unit, gathered once per step): {r['psi_root_padded']:,}"
           if r.get("psi_root_padded") is not None else ""),
        "",
        f"{'bytes per device':<22}{'measured':>16}{'formula':>16}{'formula (padded)':>18}{'meas/formula':>14}",
    ]
    s = r["state"]
    parts = [("params", "params"), ("grads", "grads (kept) *"), ("opt", "optimizer state")]
    if s["measured"]["extra"] or s["formula"]["extra"]:
        parts.append(("extra", "extra state"))
    for part, label in parts:
        m, f, fp = s["measured"][part], s["formula"][part], s["formula_padded"][part]
        ratio = f"{m / f:.4f}" if m is not None and f else "-"
        lines.append(f"{label:<22}{_mb(m):>16}{_mb(f):>16}{_mb(fp):>18}{ratio:>14}")
    scalars = s["measured"]["opt_scalars"]
    lines.append(f"{'':<22}(+ {scalars} B of optimizer step counts, replicated)")
    lines.append("* grads live only inside the step: traced per-device shapes, not live arrays")
    if "memory" in r:
        m = r["memory"]
        lines += ["", "compiled step, bytes per device: " + ", ".join(
            f"{k} {_mb(v)}" for k, v in m.items() if k != "generated_code")
            + f"; argument+temp {_mb(m['argument'] + m['temp'])}"]
    if "collectives" in r:
        lines += [""] + _format_collectives(r)
    return "\n".join(lines)


def _format_collectives(r: dict) -> list:
    c = r["collectives"]
    lines = [f"{'collectives / step':<20}{'count':>7}{'input B / device':>18}{'output B / device':>19}"
             f"{'ring B / device':>18}  groups"]
    for kind, o in c["ops"].items():
        if o["count"]:
            sizes = sorted({len(g["groups"][0]) for g in o["by_groups"] if g["groups"]})
            groups = f"of {','.join(map(str, sizes))}" if sizes else "pairs"
            lines.append(f"{kind:<20}{o['count']:>7}{o['input_bytes']:>18,.0f}{o['output_bytes']:>19,.0f}"
                         f"{o['ring_bytes']:>18,.0f}  {groups}")
    for i, branches in enumerate(c.get("conditionals", [])):
        lines.append(f"conditional {i}: ring bytes per branch " + " / ".join(f"{b:,.0f}" for b in branches)
                     + " (the total counts the larger)")
    f = r["traffic_formula_bytes"]
    steady = _steady_ring_bytes(r)
    ratio = f" ({steady / f:.4f} of formula)" if f else ""
    lines.append(f"{'total':<20}{'':>7}{'':>18}{'':>19}{c['ring_bytes']:>18,.0f}")
    if steady != c["ring_bytes"]:
        lines.append(f"{'compressed step':<20}{'':>7}{'':>18}{'':>19}{steady:>18,.0f}  (the smaller branch)")
    lines.append(f"formula ({_formula_name(r)}, ring terms): {'n/a' if f is None else f'{round(f):,} bytes'}{ratio}")
    written = r.get("ring_bytes_as_written")
    if written and abs(written / c["ring_bytes"] - 1) > 0.01:
        of = f" ({written / f:.4f} of formula)" if f else ""
        lines.append(f"as written (HLO before XLA's passes): {written:,.0f} bytes{of}; the compiled program differs")
    if c["unknown_trip_counts"]:
        lines.append(f"note: {c['unknown_trip_counts']} while loop(s) of unknown trip count counted once")
    return lines


def _steady_ring_bytes(r: dict) -> float:
    """Ring bytes of the step that runs in steady state: PowerSGD's compressed branch (the smaller)."""
    c = r["collectives"]
    if r.get("options", {}).get("compress") != "powersgd":
        return c["ring_bytes"]
    return c["ring_bytes"] - sum(max(b) - min(b) for b in c.get("conditionals", []))


def _ints(text: str):
    return tuple(int(x) for x in text.split(","))


def add_inspect_args(p) -> None:
    from jaxdp import choices

    p.add_argument("--strategy", default="zero3", metavar=choices.listing(choices.STRATEGIES), help="data-parallel strategy")
    p.add_argument("--devices", type=int, default=8, help="devices (simulated on CPU)")
    p.add_argument("--mesh-shape", type=_ints, default=None, help="hsdp: replicas,shards")
    p.add_argument("--allreduce", default=None, metavar=choices.listing(choices.ALLREDUCES), help="ddp/async/zero1")
    p.add_argument("--compress", default=None, metavar=choices.listing(choices.COMPRESSIONS), help="ddp/zero1 (async: bf16, fp16)")
    p.add_argument("--powersgd-rank", type=int, default=None, help="ddp/zero1 --compress powersgd: matrix rank r")
    p.add_argument("--staleness", type=int, default=None, help="async: staleness bound k")
    p.add_argument("--model", default="resnet18", metavar=choices.listing(choices.MODELS), help="architecture")
    p.add_argument("--width", type=int, default=64, help="ResNet: channels of the first stage (64 = torchvision)")
    p.add_argument("--blocks", type=_ints, default=None, help="ResNet: blocks per stage, e.g. 1,1,1,1 (default: the model's)")
    p.add_argument("--stem", default="cifar", metavar=choices.listing(choices.STEMS), help="ResNet stem")
    p.add_argument("--optimizer", default="sgd", metavar=choices.listing(choices.OPTIMIZERS), help="sgd with momentum 0.9")
    p.add_argument("--dtype", default="float32", metavar=choices.listing(choices.DTYPES), help="params and compute")
    p.add_argument("--batch-per-device", type=int, default=1, help="images per device per step")
    p.add_argument("--image-size", type=int, default=32, help="square input images of this side")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="model-state bytes only (no compiled memory or HLO)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args) -> int:
    from jaxdp.strategies import StrategyError

    options = {k: getattr(args, k) for k in ("allreduce", "compress", "powersgd_rank", "staleness")
               if getattr(args, k) is not None}
    try:
        report = inspect_strategy(
            args.strategy, args.devices, model=args.model, width=args.width, blocks=args.blocks, stem=args.stem,
            optimizer=args.optimizer, dtype=args.dtype, batch_per_device=args.batch_per_device,
            image_size=args.image_size, mesh_shape=args.mesh_shape, options=options, compile=args.compile,
        )
    except (InspectError, StrategyError) as e:  # e.g. --compress on zero2/3: one line, exit 2
        print(f"jaxdp: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
