"""The compiled step's schedule: its collectives and its compute in the order XLA runs them.

A compiled module is scheduled (``HloModule ..., is_scheduled=true``): its entry computation
lists the instructions in execution order. ``entry_ops`` reads that list and keeps the
collectives and every kernel, each with its phase (``forward``: under ``jvp``; ``backward``:
under ``transpose``) and the module path it belongs to. Kernels are of two kinds:

- ``matmul``: a convolution or matrix product, however the backend wrote it: HLO
  ``convolution``/``dot``, a fusion whose computation holds one (XLA:CPU's output fusions,
  Triton GEMM fusions on a GPU, the weight-gradient products JAX writes as ``transpose``),
  and the cuDNN/cuBLAS/cuBLASLt custom calls a GPU hands them to;
- ``kernel``: any other fusion or kernel (elementwise, reductions, copies); bookkeeping
  (parameters, tuples, bitcasts, ...) is not a kernel.

Overlap needs asynchronous collectives: a ``-start`` / ``-done`` pair (``all-gather-start`` ...
``all-gather-done``, or ``async-start`` wrapping one) with kernels scheduled between the two
halves. Each done names its own start as its operand, so ``async_overlap`` pairs them by
operand, never by order. XLA:GPU turns a pair with nothing between its halves into a
synchronous one (``"is_sync":true`` in its backend config): such a pair is not asynchronous.
XLA:CPU emits no pairs at all: every collective is one synchronous instruction, so on CPU the
schedule shows issue order and data dependences, never overlap.

Text in, facts out: nothing here imports jax.
"""

import re
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Tuple

from jaxdp.analysis.hlo import COLLECTIVES, collective_instructions
from jaxdp.analysis.hlo_text import Instruction, Module, callees, read_module, shape_bytes

MATMUL, KERNEL = "matmul", "kernel"
COMPUTE = (MATMUL, KERNEL)
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_FUSION_KIND = re.compile(r'"fusion_backend_config":\{"kind":"([^"]*)"')
_WRAPPER = re.compile(r"^(jit|pjit|jvp|transpose|checkpoint|remat|custom_vjp_call|custom_jvp_call|vmap)\(|"
                      r"^(shard_map|while|body|cond|[\w]*_?call)$")
# cuDNN convolutions and fused attention, cuBLAS/cuBLASLt GEMMs, cuDNN GEMM fusions, Triton GEMMs.
_MATMUL_TARGETS = re.compile(r"__cudnn\$conv|__cudnn\$fmha|__cublas|__cudnn\$fusion|__triton_(nested_)?gemm")
_MATMUL_OPS = ("convolution", "dot")
# Instructions that launch nothing: they name, reshape or pass buffers.
_NOT_KERNELS = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "partition-id", "replica-id",
                "after-all", "opt-barrier", "add-dependency", "copy-start", "copy-done", "domain"}


@dataclass(frozen=True)
class Op:
    position: int  # index in the entry computation's schedule
    name: str  # the HLO instruction's name
    kind: str  # "all-gather", "all-reduce", ..., "matmul" or "kernel"
    stage: Optional[str]  # "start" / "done": a half of an asynchronous collective; None: synchronous
    phase: str  # "forward", "backward" or "other" (the optimizer update, the metrics)
    scope: str  # module path from the metadata, e.g. "layer3/0/conv1" ("" at the top)
    bytes: float  # result bytes
    start: Optional[str] = None  # a done half: the start it completes (its operand)
    sync: bool = False  # a start that XLA runs synchronously (``is_sync``): nothing can overlap it


class Overlap(NamedTuple):
    """One asynchronous collective: what is scheduled between its start and its own done."""

    kind: str
    start: str  # the start's instruction name
    kernels: int  # any kernel, matmuls included
    matmuls: int  # convolutions and matrix products
    sync: bool  # XLA runs it synchronously (is_sync): the pair overlaps nothing


def _phase_and_scope(op_name: str) -> Tuple[str, str]:
    """(phase, module path) from an op's metadata. XLA names a combined op after its members,
    ``.../(a/op:b/op)``: it is read as its first member."""
    combined = re.match(r"^(.*?/)?\((.*)\)$", op_name)
    if combined:
        op_name = (combined.group(1) or "") + combined.group(2).split(":")[0]
    phase = "backward" if "transpose(" in op_name else "forward" if "jvp(" in op_name else "other"
    parts = [p for p in op_name.split("/")[:-1] if p and not _WRAPPER.match(p)]  # [-1]: the primitive
    return phase, "/".join(_unrepeated(parts))


def _unrepeated(parts: list) -> list:
    """The module path once where the name stack repeats it: a ``custom_vjp``'s backward traced inside
    its unit's scope (the transpose of a gather in the compute dtype) reads ``layer4/1/layer4/1``."""
    for k in range(1, len(parts) // 2 + 1):
        if parts[k:2 * k] == parts[:k]:
            return parts[:k] + parts[2 * k:]
    return parts


def _holds_matmul(module: Module, name: str, seen: Optional[set] = None) -> bool:
    """Whether computation ``name`` (or one it calls) holds a convolution, a dot or a GEMM custom call."""
    seen = set() if seen is None else seen
    if name in seen or name not in module.computations:
        return False
    seen.add(name)
    for i in module.instructions(name):
        if i.opcode in _MATMUL_OPS or _MATMUL_TARGETS.search(i.line):
            return True
        if any(_holds_matmul(module, c, seen) for _, c in callees(i.line)):
            return True
    return False


def _called(line: str) -> Optional[str]:
    """The computation a fusion or an async-start runs (its ``calls=``)."""
    return next((c for key, c in callees(line) if key == "calls"), None)


def op_kind(i: Instruction, module: Module):
    """(kind, stage) of a collective or a kernel; None for bookkeeping."""
    op, name, line = i.opcode, i.name, i.line
    for c in COLLECTIVES:
        if op == c:
            return c, None
        if op in (f"{c}-start", f"{c}-done"):
            return c, op.rsplit("-", 1)[1]
    if op in ("async-start", "async-done"):  # e.g. a reduce-scatter wrapped by XLA:GPU
        wrapped = next((c for c in COLLECTIVES if name.startswith(c)), None)
        if wrapped is None:
            called = _called(line)
            body = "\n".join(module.computations[called].lines) if called in module.computations else ""
            wrapped = next((c for c in COLLECTIVES if re.search(rf"\s{c}\(", body)), "async")
        return wrapped, op.split("-", 1)[1]
    if op in _NOT_KERNELS:
        return None
    if op in _MATMUL_OPS or (op == "custom-call" and _MATMUL_TARGETS.search(_TARGET.search(line).group(1)
                                                                              if _TARGET.search(line) else "")):
        return MATMUL, None
    if op == "fusion":
        kind = _FUSION_KIND.search(line)
        called = _called(line)
        if (kind and _MATMUL_TARGETS.search(kind.group(1))) or (called and _holds_matmul(module, called)):
            return MATMUL, None
    return KERNEL, None


def is_kernel(i: Instruction, module: Module) -> bool:
    """Whether instruction ``i`` launches a compute kernel (a matmul or any other), not a collective."""
    return op_kind(i, module) in ((MATMUL, None), (KERNEL, None))


def entry_graph(hlo: str) -> Tuple[List[Op], Dict[str, Tuple[str, ...]]]:
    """(the entry computation's collectives and kernels in schedule order, every entry
    instruction's operands by name) of a compiled module's text."""
    module = read_module(hlo)
    return computation_graph(module, module.entry)


def computation_graph(module: Module, computation: Optional[str]) -> Tuple[List[Op], Dict[str, Tuple[str, ...]]]:
    """``entry_graph`` of any computation of ``module`` (``hlo_text.read_module``), e.g. a while loop's body."""
    ops, operands = [], {}
    by_name: Dict[str, Op] = {}
    for i in module.instructions(computation):
        operands[i.name] = i.operands
        kind = op_kind(i, module)
        if not kind:
            continue
        op_name = (_OP_NAME.search(i.line) or [None, ""])[1]
        phase, scope = _phase_and_scope(op_name)
        start = operands[i.name][0] if kind[1] == "done" and operands[i.name] else None
        if start in by_name and not op_name:  # a done half without metadata: its start's
            phase, scope = by_name[start].phase, by_name[start].scope
        sync = kind[1] == "start" and '"is_sync":true' in i.line
        entry_op = Op(len(operands) - 1, i.name, kind[0], kind[1], phase, scope, shape_bytes(i.shape), start, sync)
        by_name[i.name] = entry_op
        ops.append(entry_op)
    return ops, operands


def kernel_bytes(i: Instruction, sizes: Dict[str, float]) -> float:
    """What kernel ``i`` reads and writes: its operands' and its result's sizes, as XLA's cost analysis
    counts them (``sizes``: the result bytes of the instructions before it)."""
    return shape_bytes(i.shape) + sum(sizes.get(o, 0.0) for o in i.operands)


def bytes_accessed(hlo: str) -> float:
    """Bytes every kernel of the entry computation reads and writes, once each: HBM traffic per step,
    ignoring caches."""
    module = read_module(hlo)
    sizes, total = {}, 0.0
    for i in module.instructions(module.entry):
        sizes[i.name] = shape_bytes(i.shape)
        if is_kernel(i, module):
            total += kernel_bytes(i, sizes)
    return total


def entry_ops(hlo: str) -> List[Op]:
    return entry_graph(hlo)[0]


def depends_on(operands: Dict[str, Tuple[str, ...]], a: str, b: str) -> bool:
    """Whether instruction ``a`` needs ``b``'s result (through any chain of operands)."""
    seen, todo = set(), [a]
    while todo:
        x = todo.pop()
        for y in operands.get(x, ()):
            if y == b:
                return True
            if y not in seen:
                seen.add(y)
                todo.append(y)
    return False


def async_overlap(ops: List[Op]) -> List[Overlap]:
    """Each start/done pair (paired by operand), with the kernels and matmuls scheduled between
    its halves. Empty where the backend runs collectives synchronously (XLA:CPU)."""
    done_at = {o.start: i for i, o in enumerate(ops) if o.stage == "done" and o.start}
    out = []
    for i, op in enumerate(ops):
        if op.stage != "start":
            continue
        between = ops[i + 1:done_at.get(op.name, len(ops))]
        out.append(Overlap(op.kind, op.name, sum(o.kind in COMPUTE for o in between),
                           sum(o.kind == MATMUL for o in between), op.sync))
    return out


def collective_list(hlo: str, hosts: List[int]) -> List[dict]:
    """Every collective of a compiled module, one dict each: ``kind``; ``bytes`` (the whole buffer per
    device: an all-gather's output, a reduce-scatter's input, an all-reduce's buffer) and
    ``ring_bytes`` (what each device sends, ``hlo``'s ring terms); ``groups`` (the HLO's replica groups,
    global device ids; a collective-permute: its source/target pairs); ``across_hosts`` (a group spans
    processes: over the network, not NVLink); ``runs`` (times per step); ``async`` (a start/done pair
    XLA runs asynchronously) and, for those, ``compute_between`` (kernels scheduled between its halves)
    and ``matmul_between`` (of them, convolutions and matrix products). ``hosts``: the process of
    each global device id (the mesh's devices in row-major order)."""
    module = read_module(hlo)
    overlap: Dict[str, Overlap] = {}
    instructions = collective_instructions(hlo, len(hosts))
    for name in {i["computation"] for i in instructions}:
        overlap.update((o.start, o) for o in async_overlap(computation_graph(module, name)[0]))
    out = []
    for i in instructions:
        o = overlap.get(i["name"])
        groups = i["groups"] if i["groups"] is not None else i["pairs"]
        asynchronous = o is not None and not o.sync
        out.append({"name": i["name"], "kind": i["kind"], "bytes": max(i["input_bytes"], i["output_bytes"]),
                    "ring_bytes": i["ring_bytes"], "runs": i["runs"], "groups": groups,
                    "across_hosts": any(len({hosts[d] for d in g}) > 1 for g in groups),
                    "async": asynchronous, "compute_between": o.kernels if asynchronous else 0,
                    "matmul_between": o.matmuls if asynchronous else 0})
    return out


def overlapped(pairs: List[Overlap], matmul: bool = True) -> List[Overlap]:
    """The pairs that hide behind compute: asynchronous, with a matmul (or, ``matmul=False``, any
    kernel) between their halves."""
    return [p for p in pairs if not p.sync and (p.matmuls if matmul else p.kernels)]


def _unit(scope: str, depth: int = 2) -> str:
    return "/".join(scope.split("/")[:depth]) or "(top)"


def format_schedule(ops: List[Op], backend: str = "") -> str:
    """One line per run of alike collectives and matmuls (kind, async half, phase, first two levels
    of the module path); other kernels are counted in the overlap line, not listed."""
    lines = [f"{'#':>5}  {'op':<26} {'phase':<9} {'where':<14} {'KiB':>9}"]
    run: List[Op] = []

    def flush():
        if run:
            first, label = run[0], run[0].kind + (f"-{run[0].stage}" if run[0].stage else "")
            count = f" x{len(run)}" if len(run) > 1 else ""
            lines.append(f"{first.position:>5}  {label + count:<26} {first.phase:<9} {_unit(first.scope):<14} "
                         f"{sum(o.bytes for o in run) / 1024:>9.1f}")
            run.clear()

    for op in ops:
        if op.kind == KERNEL:
            continue
        if run and (op.kind, op.stage, op.phase, _unit(op.scope)) != (run[0].kind, run[0].stage, run[0].phase,
                                                                    _unit(run[0].scope)):
            flush()
        run.append(op)
    flush()
    pairs = async_overlap(ops)
    if pairs:
        lines.append(f"async collectives: {len(pairs)} start/done pairs, {len(pairs) - len(overlapped(pairs, False))}"
                     f" with nothing between their halves (synchronous), {len(overlapped(pairs))} with a matmul "
                     f"between them (overlap)")
    else:
        kinds = sorted({o.kind for o in ops if o.kind in COLLECTIVES})
        lines.append(f"async collectives: none; every collective is one synchronous instruction "
                     f"({', '.join(kinds) or 'no collectives'}){f' on {backend}' if backend else ''}: "
                     f"the order above is issue order, with no overlap")
    return "\n".join(lines)
