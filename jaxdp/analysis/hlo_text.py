"""Reading HLO text: its computations, their instructions, shapes in bytes, and who calls whom.

The one reader under ``hlo.py`` (collectives and their bytes), ``schedule.py`` (the compiled
order) and ``estimate.py`` (each kernel's FLOPs). It reads both forms XLA prints: a compiled
module (``compiled.as_text()``: ``%name (params) -> shape {`` headers, ``%``-named instructions)
and the HLO before XLA's passes (``lowered.compiler_ir("hlo").as_hlo_text()``: ``name {``).

Text in, facts out: nothing here imports jax.
"""

import math
import re
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9](?:fn|fnuz)?)?)\[([0-9,]*)\]")
# "%name (params) -> shape {" (optimized HLO) or "name {" (before XLA's passes), at column 0
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*)?\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
# Every attribute that names a computation the instruction runs (a conditional's branch lists: ``branches``).
_CALLS = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def dtype_bytes(dtype: str) -> Optional[float]:
    """Bytes per element of an HLO element type (``f32``, ``bf16``, ``f8e4m3fn``); None for token/opaque."""
    return 1 if dtype.startswith("f8") else DTYPE_BYTES.get(dtype)


def shape_bytes(text: str) -> float:
    """Bytes of every array shape written in ``text`` (a shape, a tuple of shapes, a whole line)."""
    return sum(shape_bytes_by_dtype(text).values(), 0.0)


def shape_bytes_by_dtype(text: str) -> Dict[str, float]:
    """``shape_bytes`` per element type (``{"bf16": ..., "f32": ...}``)."""
    found: Dict[str, float] = {}
    for dtype, dims in _SHAPE.findall(text):
        size = dtype_bytes(dtype)
        if size is not None:
            found[dtype] = found.get(dtype, 0.0) + size * math.prod(int(d) for d in dims.split(",") if d)
    return found


def array_shapes(text: str) -> List[Tuple[str, Tuple[int, ...]]]:
    """Each array shape in ``text`` as (element type, dims), in order: ``(f32[4,8], u8[0])`` gives two."""
    return [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _SHAPE.findall(text)]


def tuple_elements(text: str) -> List[str]:
    """Elements of a tuple shape ``(a, (b, c), d)`` at depth 1; the text itself if not a tuple. Commas
    inside a shape's dimensions or layout (``f32[8,4]{1,0}``) do not split."""
    text = text.strip()
    if not text.startswith("("):
        return [text]
    parts, depth, inner, start = [], 0, 0, 1
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        inner += (ch in "[{") - (ch in "]}")
        if (ch == "," and depth == 1 and not inner) or (ch == ")" and depth == 0):
            parts.append(text[start:i])
            start = i + 1
            if depth == 0:
                break
    return parts


@dataclass(frozen=True)
class Instruction:
    """One ``%name = shape opcode(operands), attributes`` line."""

    name: str
    shape: str  # the result's shape text
    opcode: str
    rest: str  # the text after the opcode's parenthesis: operands, then attributes
    line: str

    @property
    def operands(self) -> Tuple[str, ...]:
        """The ``%names`` inside the argument list (up to its closing parenthesis)."""
        depth = 1
        for i, ch in enumerate(self.rest):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                return tuple(re.findall(r"%([\w.\-]+)", self.rest[:i]))
        return tuple(re.findall(r"%([\w.\-]+)", self.rest))


@dataclass
class Computation:
    name: str
    entry: bool
    lines: List[str] = field(default_factory=list)

    def instructions(self) -> Iterator[Instruction]:
        for line in self.lines:
            m = _INSTRUCTION.match(line)
            if m:
                yield Instruction(*m.groups(), line)


@dataclass
class Module:
    """The computations of an HLO module by name, in text order (callees before callers)."""

    computations: Dict[str, Computation]
    order: List[str]
    _shapes: Dict[str, Dict[str, str]] = field(default_factory=dict, repr=False)
    _bytes: Dict[str, Dict[str, float]] = field(default_factory=dict, repr=False)

    @property
    def entry(self) -> Optional[str]:
        return next((n for n in self.order if self.computations[n].entry), None)

    def instructions(self, computation: Optional[str]) -> Iterator[Instruction]:
        """The instructions of ``computation`` (none for None or a computation not in the text)."""
        c = self.computations.get(computation) if computation else None
        return c.instructions() if c else iter(())

    def result_shapes(self, computation: str) -> Dict[str, str]:
        """Each instruction's result shape text in ``computation``, by name (read once)."""
        if computation not in self._shapes:
            self._shapes[computation] = {i.name: i.shape for i in self.instructions(computation)}
        return self._shapes[computation]

    def result_bytes(self, computation: str) -> Dict[str, float]:
        """Each instruction's result size in bytes in ``computation``, by name (read once)."""
        if computation not in self._bytes:
            self._bytes[computation] = {n: shape_bytes(s) for n, s in self.result_shapes(computation).items()}
        return self._bytes[computation]


def read_module(hlo_text: str) -> Module:
    computations, current, order = {}, None, []
    for line in hlo_text.splitlines():
        m = None if line[:1].isspace() else _COMPUTATION.match(line.rstrip())
        if m:
            current = m.group(1)
            computations[current] = Computation(current, line.lstrip().startswith("ENTRY"))
            order.append(current)
        elif current is not None:
            computations[current].lines.append(line)
    return Module(computations, order)


def callees(line: str) -> List[Tuple[str, str]]:
    """(attribute, computation) of each computation ``line`` names: ``calls``, ``to_apply``, a while's
    ``body`` and ``condition``, a predicate conditional's branches; not ``branch_computations`` lists."""
    return _CALLS.findall(line)


def branches(line: str) -> List[str]:
    """The branch computations of a ``conditional`` line, in branch order (true, false for a predicate)."""
    names = [c.strip().lstrip("%") for group in _BRANCHES.findall(line) for c in group.split(",")]
    names += [name for key, name in callees(line) if key in ("true_computation", "false_computation")]
    return names


def trip_count(line: str) -> Optional[int]:
    """A ``while``'s known trip count (XLA writes it in the backend config), or None."""
    m = _TRIP.search(line)
    return int(m.group(1)) if m else None
