"""Where the bytes are: per-device model state, compiled memory and collective traffic.

``jaxdp inspect --strategy zero3 --devices 8 --model resnet18 --optimizer adam``
prints, for one strategy on N devices (about 1 min for ResNet-18 on a 2-core CPU,
most of it compiling the step; ``--no-compile`` skips that part):

1. **Model state per device**, measured, beside the ZeRO formulas. With Ψ
   params of p bytes (4 for f32) and K optimizer bytes per param (SGD momentum
   K = p, Adam K = 2p, plain SGD 0):

   ========  ======  ======  ======
   strategy  params  grads   opt
   ========  ======  ======  ======
   ddp       pΨ      pΨ      KΨ
   zero1     pΨ      pΨ      KΨ/N
   zero2     pΨ      pΨ/N    KΨ/N
   zero3     pΨ/N    pΨ/N    KΨ/N
   hsdp      pΨ/S    pΨ/S    KΨ/S     (S devices per shard group)
   ========  ======  ======  ======

   - params and optimizer state: the live arrays, ``addressable_shards[0].data.nbytes``
     summed over leaves (device 0's share);
   - grads: the averaged gradient each device keeps for the update (ZeRO-1's
     is DDP's full all-reduce result, ZeRO-2/3's only the device's chunk). It
     lives only inside the step, so there is no array to measure: we trace the
     strategy's ``averaged_grads`` inside ``shard_map`` (``jax.eval_shape``, no
     compile) and sum the per-device shapes it produces.
   - padding: sharded tensors are flat and padded to a multiple of the shard
     count (``strategies/flat.py``), so a sharded part holds ``Ψ_pad/N`` with
     ``Ψ_pad = Σ ceil(size/N)·N`` (at most N-1 extra per tensor). The
     optimizer state also holds scalar step counts (4 bytes each, replicated).
     Measured bytes equal the padded formula plus those scalars exactly.

2. **Compiled memory per device** of the training step: ``memory_analysis()``
   of ``strategy.lower_step(...).compile()`` (argument, output, alias, temp).

3. **Collectives per step** in the compiled HLO (``compiled.as_text()``):
   all-reduce, all-gather, reduce-scatter, collective-permute and all-to-all,
   including tuple (combined) ops, async ``-start`` forms and ops inside
   called computations, each counted as often as its computation runs (a
   ``while`` body times its known trip count). Traffic is in ring terms, bytes
   each device sends: all-reduce of S bytes 2(G-1)/G·S; all-gather or
   reduce-scatter of a full S (G-1)/G·S; collective-permute S; G = group size.
   Formulas (pΨ bytes): ddp 2, zero2 2, zero1 3 (all-reduce + all-gather, as
   torch's ZeroRedundancyOptimizer), zero3 3 (forward gather, backward
   re-gather, reduce-scatter), all times (N-1)/N; hsdp 3(S-1)/S +
   2(R-1)/R·1/S. The measured total also holds the small BN-buffer broadcast
   and metric reductions every strategy does.

``inspect_strategy(...)`` returns all of it as a dict (``--json`` prints that).
"""

import json
import re
from typing import Optional, Sequence

import numpy as np

# Which parts of the model state each strategy shards (over all N devices, or S for hsdp).
SHARDED = {
    "ddp": (),
    "zero1": ("opt",),
    "zero2": ("grads", "opt"),
    "zero3": ("params", "grads", "opt"),
    "hsdp": ("params", "grads", "opt"),
}
# Ring traffic per step in units of (param bytes) x (G-1)/G for the shard group G.
TRAFFIC = {"ddp": 2, "zero1": 3, "zero2": 2, "zero3": 3, "hsdp": 3}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


# ----------------------------------------------------------------------------- model-state bytes

def param_count(model) -> int:
    """Ψ from the model's shapes alone (``jax.eval_shape``: nothing is allocated or compiled)."""
    import jax
    import jax.numpy as jnp

    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3), model.dtype),
                                               train=False))
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(shapes["params"])))


def padded_count(params, n: int) -> int:
    from jaxdp.strategies.flat import padded_size

    import jax

    return int(sum(padded_size(int(np.prod(x.shape)), n) for x in jax.tree_util.tree_leaves(params)))


def device_bytes(tree) -> int:
    """Bytes of ``tree`` on the first device that holds each array."""
    import jax

    return int(sum(x.addressable_shards[0].data.nbytes for x in jax.tree_util.tree_leaves(tree)))


def state_bytes(state) -> dict:
    """Measured per-device bytes of params and optimizer state (split: per-param leaves, scalars)."""
    import jax

    opt = jax.tree_util.tree_leaves(state.opt_state)
    return {
        "params": device_bytes(state.params),
        "opt": device_bytes([x for x in opt if x.ndim]),
        "opt_scalars": device_bytes([x for x in opt if not x.ndim]),
    }


def kept_grad_bytes(strategy, state, images, labels) -> Optional[int]:
    """Per-device bytes of the averaged gradient the strategy keeps (traced, not run).

    ZeRO strategies expose ``averaged_grads``; DDP's is its ``all_reduce`` of the
    local gradient. Other strategies: None.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jaxdp.strategies.base import local_grads

    seen = []

    def probe(state, x, y):
        if hasattr(strategy, "averaged_grads"):
            grads = strategy.averaged_grads(state, x, y)[1]
        else:
            params = jax.lax.pcast(state.params, strategy.axis, to="varying")
            grads = local_grads(strategy.model, params, state.batch_stats, x, y, strategy.accum_steps)[1]
            grads = strategy.all_reduce(grads)
            grads = grads[0] if isinstance(grads, tuple) else grads
        seen.append(sum(g.size * g.dtype.itemsize for g in jax.tree_util.tree_leaves(grads)))
        return jnp.zeros(())

    if not (hasattr(strategy, "averaged_grads") or hasattr(strategy, "all_reduce")):
        return None
    batch = P(strategy.batch_axes)
    jax.eval_shape(jax.shard_map(probe, mesh=strategy.mesh, in_specs=(strategy.state_specs(state), batch, batch),
                                 out_specs=P()), state, images, labels)
    return int(seen[0])


def formula_bytes(name: str, psi: int, psi_pad: int, shards: int, p: int, k: int) -> dict:
    """The ZeRO table: exact (Ψ/N) and with this layout's padding (Ψ_pad/N)."""
    sharded = SHARDED.get(name, ())
    per_param = {"params": p, "grads": p, "opt": k}
    exact = {part: b * psi / shards if part in sharded else b * psi for part, b in per_param.items()}
    padded = {part: b * psi_pad // shards if part in sharded else b * psi for part, b in per_param.items()}
    return {"exact": exact, "padded": padded}


def traffic_formula(name: str, psi: int, psi_pad: int, n: int, p: int, mesh_shape=None) -> Optional[float]:
    """Ring bytes each device sends per step (see the module docstring)."""
    if name == "hsdp":
        r, s = mesh_shape
        return 3 * (s - 1) / s * p * psi_pad + 2 * (r - 1) / r * p * psi_pad / s
    if name not in TRAFFIC or n == 1:
        return 0.0 if name in TRAFFIC else None
    if name == "zero1":  # all-reduce of the gradient, all-gather of the padded chunks
        return (n - 1) / n * p * (2 * psi + psi_pad)
    return TRAFFIC[name] * (n - 1) / n * p * (psi if name == "ddp" else psi_pad)


# ----------------------------------------------------------------------------- HLO collectives

_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9](?:fn|fnuz)?)?)\[([0-9,]*)\]")
_OP = re.compile(r"\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\{\s*$")  # "%name (params) -> shape {"
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


def _group_size(line: str, num_devices: int) -> int:
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)  # iota form: [groups, size]<=[...]
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([^}]*)\}", line)  # explicit: {{0,1,2,3},{4,5,6,7}}
    if m:
        return len(m.group(1).split(","))
    return num_devices  # {} or absent: every device


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


def parse_collectives(hlo_text: str, num_devices: int) -> dict:
    """Count collectives in optimized HLO text; bytes per device, in ring terms (see module docstring).

    Returns ``{"ops": {kind: {"count", "operand_bytes", "result_bytes", "ring_bytes"}},
    "ring_bytes": total, "unknown_trip_counts": n}``.
    """
    computations, current, order = {}, None, []
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line.strip())
        if m:
            current = m.group(1)
            computations[current] = {"lines": [], "entry": line.lstrip().startswith("ENTRY")}
            order.append(current)
        elif current is not None:
            computations[current]["lines"].append(line)

    # How many times each computation runs: callers first (HLO text lists callees before callers).
    runs = {name: (1 if c["entry"] else 0) for name, c in computations.items()}
    unknown = 0
    for name in reversed(order):
        for line in computations[name]["lines"]:
            callees = _CALLS.findall(line)
            for group in _BRANCHES.findall(line):
                callees += [c.strip().lstrip("%") for c in group.split(",")]
            trip = 1
            if " while(" in line:
                m = _TRIP.search(line)
                trip = int(m.group(1)) if m else 1
                unknown += m is None
            for callee in callees:
                if callee in runs:
                    is_body = re.search(r"\bbody=%?" + re.escape(callee) + r"\b", line) is not None
                    runs[callee] += runs[name] * (trip if is_body else 1)

    ops = {kind: {"count": 0, "operand_bytes": 0.0, "result_bytes": 0.0, "ring_bytes": 0.0} for kind in COLLECTIVES}
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
            g = max(_group_size(line, num_devices), 1)
            operand, ring = {
                "all-reduce": (out, 2 * (g - 1) / g * out),
                "all-gather": (out / g, (g - 1) / g * out),
                "reduce-scatter": (out * g, (g - 1) * out),
                "collective-permute": (out, out),
                "all-to-all": (out, (g - 1) / g * out),
            }[kind]
            k = runs.get(name, 1) or 1
            entry = ops[kind]
            entry["count"] += k
            entry["operand_bytes"] += k * operand
            entry["result_bytes"] += k * out
            entry["ring_bytes"] += k * ring
    return {"ops": ops, "ring_bytes": sum(o["ring_bytes"] for o in ops.values()), "unknown_trip_counts": unknown}


def compiled_memory(compiled) -> dict:
    m = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
              "generated_code_size_in_bytes")
    return {f.replace("_size_in_bytes", ""): int(getattr(m, f, 0) or 0) for f in fields}


# ----------------------------------------------------------------------------- one strategy

def inspect_strategy(name: str, n: int, *, model: str = "resnet18", width: int = 64,
                     blocks: Optional[Sequence[int]] = None, stem: str = "cifar", optimizer: str = "sgd",
                     dtype: str = "float32", batch_per_device: int = 1, image_size: int = 32,
                     mesh_shape=None, compile: bool = True, seed: int = 0) -> dict:
    """Build strategy ``name`` on ``n`` devices (they must exist: simulate them before jax
    starts) for a freshly initialised model, and ``measure`` it."""
    import jax

    from jaxdp.mesh import make_mesh
    from jaxdp.models import create_model
    from jaxdp.optim import make_optimizer
    from jaxdp.strategies import create_strategy
    from jaxdp.train import init_variables

    if dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    net = create_model(model, width=width, blocks=blocks, stem=stem, dtype=dtype)
    lr = 0.1 if optimizer == "sgd" else 1e-3
    tx = make_optimizer(optimizer, lr, momentum=0.9) if optimizer == "sgd" else make_optimizer(optimizer, lr)
    options = {"mesh_shape": mesh_shape} if name == "hsdp" else {}
    strategy = create_strategy(name, net, tx, make_mesh(n), **options)
    variables = init_variables(strategy.model, seed, (image_size, image_size, 3))
    rng = np.random.default_rng(seed)
    global_batch = batch_per_device * strategy.num_devices
    images = rng.normal(size=(global_batch, image_size, image_size, 3))
    labels = rng.integers(0, net.num_classes, global_batch).astype(np.int32)
    report = measure(strategy, variables, images, labels, compile=compile)
    report.update(model=model, width=width, blocks=list(net.stage_sizes), dtype=dtype, optimizer=optimizer)
    return report


def measure(strategy, variables, images, labels, *, compile: bool = True) -> dict:
    """Everything in the module docstring, for a built strategy, initial variables and a host batch."""
    import jax

    state = strategy.init_state(variables)
    params = variables["params"]
    leaves = jax.tree_util.tree_leaves(params)
    psi = int(sum(x.size for x in leaves))
    p = int(np.dtype(leaves[0].dtype).itemsize)
    shards = strategy.mesh.shape[strategy.axis]
    psi_pad = padded_count(params, shards)
    # K from the optimizer itself: its per-parameter state as DDP holds it.
    per_param = [x for x in jax.tree_util.tree_leaves(jax.eval_shape(strategy.tx.init, params)) if x.ndim]
    k = int(round(sum(x.size * x.dtype.itemsize for x in per_param) / psi))
    images, labels = strategy.shard_batch(np.asarray(images, leaves[0].dtype), np.asarray(labels, np.int32))

    measured = state_bytes(state)
    measured["grads"] = kept_grad_bytes(strategy, state, images, labels)
    formula = formula_bytes(strategy.name, psi, psi_pad, shards, p, k)
    mesh_shape = tuple(strategy.mesh.devices.shape) if strategy.mesh.devices.ndim == 2 else None
    report = {
        "strategy": strategy.name, "devices": strategy.num_devices, "mesh_shape": mesh_shape, "shards": shards,
        "psi": psi, "psi_padded": psi_pad, "param_bytes": p, "opt_bytes_per_param": k,
        "batch_per_device": images.shape[0] // strategy.num_devices, "image_size": images.shape[1],
        "state": {"measured": measured, "formula": formula["exact"], "formula_padded": formula["padded"]},
        "traffic_formula_bytes": traffic_formula(strategy.name, psi, psi_pad, strategy.num_devices, p, mesh_shape),
    }
    if compile:
        compiled = strategy.lower_step(state, images, labels).compile()
        report["memory"] = compiled_memory(compiled)
        report["collectives"] = parse_collectives(compiled.as_text(), strategy.num_devices)
    return report


# ----------------------------------------------------------------------------- the table

def _mb(x) -> str:
    return "n/a" if x is None else f"{round(x):,}"


def format_report(r: dict) -> str:
    mesh = f" (mesh {r['mesh_shape'][0]}x{r['mesh_shape'][1]})" if r.get("mesh_shape") else ""
    what = (f": {r['model']} width {r['width']} blocks {','.join(map(str, r['blocks']))}, {r['dtype']}, "
            f"{r['optimizer']}" if "model" in r else "")
    lines = [
        f"{r['strategy']} on {r['devices']} devices{mesh}{what} "
        f"(p = {r['param_bytes']} B, K = {r['opt_bytes_per_param']} B per param)",
        f"Ψ = {r['psi']:,} params; padded for {r['shards']} shards: {r['psi_padded']:,} "
        f"(+{r['psi_padded'] - r['psi']:,})",
        "",
        f"{'bytes per device':<22}{'measured':>16}{'formula':>16}{'+padding':>16}{'meas/formula':>14}",
    ]
    s = r["state"]
    for part, label in (("params", "params"), ("grads", "grads (kept)"), ("opt", "optimizer state")):
        m, f, fp = s["measured"][part], s["formula"][part], s["formula_padded"][part]
        ratio = f"{m / f:.4f}" if m is not None and f else "-"
        lines.append(f"{label:<22}{_mb(m):>16}{_mb(f):>16}{_mb(fp):>16}{ratio:>14}")
    scalars = s["measured"]["opt_scalars"]
    lines.append(f"{'':<22}(+ {scalars} B of optimizer step counts, replicated)")
    if "memory" in r:
        m = r["memory"]
        lines += ["", "compiled step, bytes per device: " + ", ".join(
            f"{k} {_mb(v)}" for k, v in m.items() if k != "generated_code")
            + f"; argument+temp {_mb(m['argument'] + m['temp'])}"]
    if "collectives" in r:
        c = r["collectives"]
        lines += ["", f"{'collectives / step':<22}{'count':>8}{'operand bytes':>18}{'ring bytes / device':>22}"]
        for kind, o in c["ops"].items():
            if o["count"]:
                lines.append(f"{kind:<22}{o['count']:>8}{o['operand_bytes']:>18,.0f}{o['ring_bytes']:>22,.0f}")
        f = r["traffic_formula_bytes"]
        ratio = f" ({c['ring_bytes'] / f:.4f} of formula)" if f else ""
        lines.append(f"{'total':<22}{'':>8}{'':>18}{c['ring_bytes']:>22,.0f}")
        what = ("3Ψp(S-1)/S + 2(Ψp/S)(R-1)/R" if r["strategy"] == "hsdp"
                else f"{TRAFFIC[r['strategy']]}Ψp(N-1)/N" if r["strategy"] in TRAFFIC else "unknown")
        lines.append(f"formula ({what}, ring terms): {'n/a' if f is None else f'{round(f):,} bytes'}{ratio}")
        if c["unknown_trip_counts"]:
            lines.append(f"note: {c['unknown_trip_counts']} while loop(s) of unknown trip count counted once")
    return "\n".join(lines)


def add_inspect_args(p) -> None:
    p.add_argument("--strategy", default="zero3", help="ddp | zero1 | zero2 | zero3 | hsdp")
    p.add_argument("--devices", type=int, default=8, help="devices (simulated on CPU)")
    p.add_argument("--mesh-shape", type=lambda t: tuple(int(x) for x in t.split(",")), default=None,
                   help="hsdp: replicas,shards")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--blocks", type=lambda t: tuple(int(x) for x in t.split(",")), default=None)
    p.add_argument("--stem", default="cifar")
    p.add_argument("--optimizer", default="sgd", help="sgd (momentum 0.9) | adam | adamw")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch-per-device", type=int, default=1)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="model-state bytes only (no compiled memory or HLO)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args) -> int:
    report = inspect_strategy(
        args.strategy, args.devices, model=args.model, width=args.width, blocks=args.blocks, stem=args.stem,
        optimizer=args.optimizer, dtype=args.dtype, batch_per_device=args.batch_per_device,
        image_size=args.image_size, mesh_shape=args.mesh_shape, compile=args.compile,
    )
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
