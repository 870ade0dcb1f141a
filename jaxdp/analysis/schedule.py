"""The compiled step's schedule: its collectives and its compute in the order XLA runs them.

A compiled module is scheduled (``HloModule ..., is_scheduled=true``): its entry computation
lists the instructions in execution order. ``entry_ops`` reads that list and keeps the
collectives and the convolutions and matmuls (HLO ``convolution``/``dot``, and by the JAX
primitive in an instruction's metadata, so a GPU's cuDNN/cuBLAS custom-calls and fusions
count too), each with its phase
(``forward``: under ``jvp``; ``backward``: under ``transpose``) and the module path it
belongs to. ``format_schedule`` prints it, runs of alike ops folded into one line;
``jaxdp inspect --schedule`` shows it for a strategy.

Overlap needs asynchronous collectives: a ``-start`` / ``-done`` pair (``all-reduce-start``
... ``all-reduce-done``, or ``async-start`` wrapping one) with compute scheduled between the
two halves. XLA:CPU emits none: every collective is one synchronous instruction, so on CPU
the schedule shows issue order and data dependences, never overlap (``async_overlap``).

Text in, facts out: nothing here imports jax.
"""

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from jaxdp.analysis.hlo import COLLECTIVES, _shapes_bytes

COMPUTE = {"conv_general_dilated": "conv", "dot_general": "dot"}
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_WRAPPER = re.compile(r"^(jit|pjit|jvp|transpose|checkpoint|remat|custom_vjp_call|custom_jvp_call|vmap)\(|"
                      r"^(shard_map|while|body|cond|[\w]*_?call)$")


@dataclass(frozen=True)
class Op:
    position: int  # index in the entry computation's schedule
    name: str  # the HLO instruction's name
    kind: str  # "all-gather", "all-reduce", ..., "conv" or "dot"
    stage: Optional[str]  # "start" / "done": a half of an asynchronous collective; None: synchronous
    phase: str  # "forward", "backward" or "other" (the optimizer update, the metrics)
    scope: str  # module path from the metadata, e.g. "layer3/0/conv1" ("" at the top)
    bytes: float  # result bytes


def _operands(rest: str) -> Tuple[str, ...]:
    """The ``%names`` inside the instruction's argument list (up to its closing parenthesis)."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            return tuple(re.findall(r"%([\w.\-]+)", rest[:i]))
    return tuple(re.findall(r"%([\w.\-]+)", rest))


def _phase_and_scope(op_name: str) -> Tuple[str, str]:
    phase = "backward" if "transpose(" in op_name else "forward" if "jvp(" in op_name else "other"
    parts = [p for p in op_name.split("/")[:-1] if p and not _WRAPPER.match(p)]  # [-1]: the primitive
    return phase, "/".join(parts)


def _kind(op: str, name: str, op_name: str):
    """(kind, stage) of a collective or a compute op; None for anything else."""
    for c in COLLECTIVES:
        if op == c:
            return c, None
        if op in (f"{c}-start", f"{c}-done"):
            return c, op.rsplit("-", 1)[1]
    if op in ("async-start", "async-done"):  # e.g. a reduce-scatter wrapped by XLA:GPU
        wrapped = next((c for c in COLLECTIVES if name.startswith(c)), "async")
        return wrapped, op.split("-", 1)[1]
    if op in ("convolution", "dot"):  # XLA's own rewrites may carry no metadata
        return ("conv" if op == "convolution" else "dot"), None
    primitive = op_name.rsplit("/", 1)[-1]
    return (COMPUTE[primitive], None) if primitive in COMPUTE and op != "parameter" else None


def entry_graph(hlo: str) -> Tuple[List[Op], Dict[str, Tuple[str, ...]]]:
    """(the entry computation's collectives and compute ops in schedule order, every entry
    instruction's operands by name) of a compiled module's text."""
    ops, operands, inside = [], {}, False
    for line in hlo.splitlines():
        if line.startswith("ENTRY"):
            inside = True
            continue
        if inside and line.startswith("}"):
            break
        m = _INSTRUCTION.match(line) if inside else None
        if not m:
            continue
        name, shape, op, rest = m.groups()
        operands[name] = _operands(rest)
        op_name = (_OP_NAME.search(line) or [None, ""])[1]
        kind = _kind(op, name, op_name)
        if kind:
            phase, scope = _phase_and_scope(op_name)
            start = next((o for o in ops if o.name in operands[name]), None) if kind[1] == "done" else None
            if start is not None and not op_name:  # a done half without metadata: its start's
                phase, scope = start.phase, start.scope
            ops.append(Op(len(operands) - 1, name, kind[0], kind[1], phase, scope, _shapes_bytes(shape)))
    return ops, operands


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


def async_overlap(ops: List[Op]) -> List[Tuple[str, str, int]]:
    """Each asynchronous collective as (kind, start's name, compute ops scheduled between its
    start and the next done of that kind). Empty where the backend runs collectives synchronously."""
    out = []
    for i, op in enumerate(ops):
        if op.stage != "start":
            continue
        done = next((j for j in range(i + 1, len(ops)) if ops[j].kind == op.kind and ops[j].stage == "done"), len(ops))
        out.append((op.kind, op.name, sum(o.kind in COMPUTE.values() for o in ops[i + 1:done])))
    return out


def _unit(scope: str, depth: int = 2) -> str:
    return "/".join(scope.split("/")[:depth]) or "(top)"


def format_schedule(ops: List[Op], backend: str = "") -> str:
    """One line per run of alike ops (kind, async half, phase, first two levels of the module path)."""
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
        if run and (op.kind, op.stage, op.phase, _unit(op.scope)) != (run[0].kind, run[0].stage, run[0].phase,
                                                                    _unit(run[0].scope)):
            flush()
        run.append(op)
    flush()
    pairs = async_overlap(ops)
    if pairs:
        hidden = sum(1 for *_, between in pairs if between)
        lines.append(f"async collectives: {len(pairs)} start/done pairs, {hidden} with compute scheduled between "
                     f"their halves (overlap)")
    else:
        kinds = sorted({o.kind for o in ops if o.kind in COLLECTIVES})
        lines.append(f"async collectives: none; every collective is one synchronous instruction "
                     f"({', '.join(kinds) or 'no collectives'}){f' on {backend}' if backend else ''}: "
                     f"the order above is issue order, with no overlap")
    return "\n".join(lines)
