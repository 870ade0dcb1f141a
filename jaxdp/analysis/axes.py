"""Per mesh axis: which axes each piece of state is cut over, and which axis each collective runs over.

On a mesh such as ``data=2 x model=2`` (``jaxdp inspect --mesh data=2,model=2``):

- **state**: every params leaf is placed by the strategy's ``Placement`` (tensor parallelism's
  cut over ``model``, then ZeRO's over ``data`` for the parts ``facts.sharded`` names); its
  bytes per device are its state shape over the sizes of the axes its PartitionSpec names.
  Grouped by those axes ("-": replicated, "model", "data", "data+model"), per part (params,
  grads, optimizer state: the optimizer's K bytes per param are placed as the params).
- **traffic**: each collective's replica groups (or a collective-permute's source/target
  pairs) are compared with the groups every subset of the mesh's axes forms, in XLA's
  logical device numbering (the mesh's devices in row-major order), so an all-reduce
  over ``[[0,1],[2,3]]`` on ``data=2 x model=2`` is a ``model`` op.
- **activations**: the compiled step's temp bytes (``memory_analysis``), per device.

Formulas (checked in tests/test_inspect.py; docs/strategies.md). Ψ_rep: params whole on every
model device (ViT: patch embedding, tokens, LayerNorms, head); Ψ_split: params cut over
``model`` (qkv, proj, fc1, fc2); M, N: the model and data axis sizes.

- params per device: p·Ψ_local with **Ψ_local = Ψ_rep + Ψ_split/M** (what one model device
  holds); the ZeRO table then applies to Ψ_local over N (zero3: p·Ψ_local/N).
- data axis: the strategy's own traffic formula over Ψ_local (DDP: 2(N-1)/N·p·Ψ_local, the
  all-reduce of the device's grads).
- model axis (Megatron, ``jaxdp.parallel.tensor``): each row-parallel layer's output is
  all-reduced in forward, and the gradient of its column-parallel partner's input in backward:
  ``model_traffic`` = 2(M-1)/M · (V_fwd + V_bwd)·b, the values declared beside the model
  (``summed_values``: ViT B·T·d per row layer each way, two per block or one when attention
  stays whole; ResNet each block's output forward and its input backward), b bytes per value.
- stage axis (GPipe, ``jaxdp.parallel.pipeline``): ``pipeline_accounting``: L·p params per
  device, M micro-batches' boundary activations in flight, and 2(M+S-1)·(B/M)·a bytes of
  collective-permutes per device (one per tick of the schedule, forward and backward).
"""

import itertools
from typing import Optional

import jax
import numpy as np

from jaxdp.parallel.tensor import beside, path_name

REPLICATED = "-"


def _label(axes) -> str:
    return "+".join(axes) if axes else REPLICATED


# ----------------------------------------------------------------------------- traffic

def axis_groups(shape, names, axes) -> frozenset:
    """The device groups a collective over ``axes`` has on a mesh of ``shape``/``names``,
    in logical device numbers (row-major positions in the mesh)."""
    ids = np.arange(int(np.prod(shape))).reshape(shape)
    dims = [list(names).index(a) for a in axes]
    moved = np.moveaxis(ids, dims, list(range(len(shape) - len(dims), len(shape))))
    return frozenset(frozenset(g) for g in moved.reshape(-1, int(np.prod([shape[d] for d in dims]))).tolist())


def axes_of_groups(groups, shape, names) -> str:
    """The mesh axes whose groups are ``groups`` ("-" for groups of one device, "?" if none match)."""
    if groups is None or max(len(g) for g in groups) == 1:
        return REPLICATED
    want = frozenset(frozenset(g) for g in groups)
    cut = [a for a, s in zip(names, shape) if s > 1]
    for k in range(1, len(cut) + 1):
        for axes in itertools.combinations(cut, k):
            if axis_groups(shape, names, axes) == want:
                return _label(axes)
    return "?"


def axes_of_pairs(pairs, shape, names) -> str:
    """The mesh axes along which a collective-permute's source and target differ."""
    moved = set()
    for src, dst in pairs:
        a, b = np.unravel_index(src, shape), np.unravel_index(dst, shape)
        moved.update(names[d] for d in range(len(shape)) if a[d] != b[d])
    return _label([n for n in names if n in moved])


def traffic_by_axis(collectives: dict, shape, names) -> dict:
    """``parse_collectives``' ops regrouped per mesh axis: {axes: {"count", "ring_bytes", "ops": {kind: ring}}}."""
    out = {}
    for kind, o in collectives["ops"].items():
        for g in o["by_groups"]:
            label = axes_of_pairs(g["pairs"], shape, names) if "pairs" in g else axes_of_groups(g["groups"], shape,
                                                                                                 names)
            entry = out.setdefault(label, {"count": 0, "ring_bytes": 0.0, "ops": {}})
            entry["count"] += g["count"]
            entry["ring_bytes"] += g["ring_bytes"]
            entry["ops"][kind] = entry["ops"].get(kind, 0.0) + g["ring_bytes"]
    return out


# ----------------------------------------------------------------------------- state

def spec_axes(spec) -> tuple:
    """The mesh axes a PartitionSpec cuts over, each once, in the order they appear."""
    axes = []
    for entry in spec:
        for a in (entry if isinstance(entry, tuple) else (entry,)):
            if a is not None and a not in axes:
                axes.append(a)
    return tuple(axes)


def state_by_axes(strategy, opt_bytes_per_param: int) -> dict:
    """{part: {axes: {"params": canonical count, "bytes": per device}}} for params, grads and opt,
    from the strategy's placement: each part is ZeRO-cut where ``facts.sharded`` says so."""
    place, mesh, sharded = strategy.placement, strategy.mesh, strategy.facts.sharded
    out = {"params": {}, "grads": {}, "opt": {}}
    for path, leaf in jax.tree_util.tree_leaves_with_path(strategy.shapes):
        name = "params/" + path_name(path)
        p = np.dtype(leaf.dtype).itemsize
        for part in out:
            zero = part in sharded
            axes = [a for a in spec_axes(place.spec(name, leaf.shape, zero)) if mesh.shape[a] > 1]
            cut = int(np.prod([mesh.shape[a] for a in axes]))
            per_value = opt_bytes_per_param if part == "opt" else p
            entry = out[part].setdefault(_label(sorted(axes, key=list(mesh.axis_names).index)),
                                         {"params": 0, "bytes": 0})
            entry["params"] += int(np.prod(leaf.shape))
            entry["bytes"] += int(np.prod(place.state_shape(name, leaf.shape, zero))) * per_value // cut
    return out


def split_counts(strategy) -> dict:
    """Ψ_rep (params whole on every model device), Ψ_split (cut over ``model``) and
    Ψ_local = Ψ_rep + Ψ_split/M, from the strategy's tensor-parallel plan."""
    tp = strategy.model_split
    split = 0
    if tp is not None:
        split = sum(int(np.prod(x.shape)) for path, x in jax.tree_util.tree_leaves_with_path(strategy.shapes)
                    if tp.dim("params/" + path_name(path), x.shape) is not None)
    total = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(strategy.shapes))
    m = 1 if tp is None else tp.size
    return {"psi_rep": total - split, "psi_split": split, "psi_local": total - split + split // m}


# ----------------------------------------------------------------------------- formulas

def model_traffic(model_size: int, summed_values: tuple, value_bytes: int) -> float:
    """Model-axis ring bytes per device per step: the (forward, backward) activation values
    all-reduced, 2(M-1)/M·S each."""
    m = model_size
    return 2 * (m - 1) / m * sum(summed_values) * value_bytes


def model_axis_formula(strategy, batch_per_rank: int, image_size: int) -> Optional[float]:
    """``model_traffic`` of the strategy's tensor-parallel model, from ``summed_values`` declared
    beside it (None without tensor parallelism, or for a model that declares none)."""
    net, tp = strategy.init_model, strategy.model_split
    values = beside(net, "summed_values")
    if tp is None or values is None:
        return None
    dtype = getattr(net, "dtype", np.float32)
    return model_traffic(tp.size, values(net, tp.size, batch_per_rank, image_size), np.dtype(dtype).itemsize)


def gpipe_bubble(stages: int, microbatches: int) -> float:
    """The idle fraction of each stage in GPipe: it computes on M of the M + S - 1 ticks."""
    return (stages - 1) / (microbatches + stages - 1)


def pipeline_accounting(strategy, batch_per_rank: int, example_input=None) -> Optional[dict]:
    """Pipeline stages' (``jaxdp/parallel/pipeline.py``) bytes and stage-axis traffic per device
    and step; None without a stage axis. ``example_input``: one example's ShapeDtypeStruct
    (what stage 0 takes), which fixes the activation size at the stage boundaries.

    S stages, M micro-batches of b = B/M examples, a = bytes per example of the buffer the
    stages exchange (the widest boundary's activation; every boundary travels padded to it):

    - params per device: L·p, L the longest stage's param count (the stacked (S, L) layout);
    - activations in flight per stage: GPipe keeps all M micro-batches' stage inputs for the
      backward, M·b·a = B·a;
    - stage traffic, useful: (S-1)·M activation sends forward and as many gradient sends
      backward over the pipeline, 2(S-1)·M·b·a;
    - stage traffic, per device as the schedule runs it: every tick of the scan is one
      ppermute of one micro-batch's buffer (bubble ticks send padding), forward and backward:
      2(M+S-1)·b·a. This is what the compiled HLO's collective-permutes over ``stage`` move.
    """
    pp = getattr(strategy, "pp", None)
    if pp is None:
        return None
    s, m = pp.size, pp.microbatches
    micro = batch_per_rank // m
    sent = {}
    if example_input is not None:
        width, dtype = pp.buffer(jax.ShapeDtypeStruct((micro, *example_input.shape), example_input.dtype))
        a = width * np.dtype(dtype).itemsize
        sent = {"activation_bytes_per_example": a, "activations_in_flight_bytes": m * micro * a,
                "stage_traffic_useful_bytes": 2 * (s - 1) * m * micro * a,
                "stage_traffic_bytes": 2 * (m + s - 1) * micro * a}
    return {"stages": s, "microbatches": m, "stage_length": pp.length,
            "params_bytes": pp.length * np.dtype(pp.dtype).itemsize, **sent, "bubble_formula": gpipe_bubble(s, m)}


def axis_report(strategy, collectives: Optional[dict], temp_bytes: Optional[int], opt_bytes_per_param: int,
                batch_per_rank: int, image_size: int, data_formula: Optional[float], example_input=None) -> dict:
    """Everything above for one strategy on its mesh, as ``measure`` adds it under "axes"."""
    mesh = strategy.mesh
    shape, names = tuple(mesh.devices.shape), tuple(mesh.axis_names)
    report = {"mesh": {n: int(s) for n, s in zip(names, shape)}, **split_counts(strategy),
              "state": state_by_axes(strategy, opt_bytes_per_param), "activations": temp_bytes,
              "pipeline": pipeline_accounting(strategy, batch_per_rank, example_input)}
    report["traffic_formula"] = {"data": data_formula,
                                 "model": model_axis_formula(strategy, batch_per_rank, image_size),
                                 "stage": (report["pipeline"] or {}).get("stage_traffic_bytes")}
    if collectives is not None:
        report["traffic"] = traffic_by_axis(collectives, shape, names)
    return report
