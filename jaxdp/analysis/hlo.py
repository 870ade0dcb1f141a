"""Collectives per step in compiled HLO text (``compiled.as_text()``), and compiled memory.

``parse_collectives`` counts all-reduce, all-gather, reduce-scatter, collective-permute and
all-to-all, including tuple (combined) ops, async ``-start`` forms and ops inside called
computations, each counted as often as its computation runs (a ``while`` body times its
known trip count). Per op and device: *input* bytes (what the device contributes:
all-gather its chunk, reduce-scatter the full buffer) and *output* bytes (what it holds
after: all-gather the full buffer, reduce-scatter its chunk), the replica groups, and the
traffic in ring terms, bytes each device sends: all-reduce of S bytes 2(G-1)/G·S;
all-gather or reduce-scatter of a full S (G-1)/G·S; collective-permute S (its buffer: for
dp's gather to device 0, what device 0 receives per op); G = group size. The two branches
of a ``conditional`` are alternatives: the total counts the larger, and each branch is
listed (PowerSGD's step holds the plain average, run before ``start_iter``, and the
compressed one). The same parser reads the HLO before XLA's passes
(``lowered.compiler_ir("hlo").as_hlo_text()``).

Text in, numbers out: nothing here imports jax.
"""

import re

import numpy as np

from jaxdp.analysis.hlo_text import (branches, callees, read_module, shape_bytes, shape_bytes_by_dtype, trip_count,
                                     tuple_elements)

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")

_OP = re.compile(r"\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")


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


_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def permute_pairs(line: str):
    """A collective-permute's ``source_target_pairs={{0,1},{1,2}}`` as [[0, 1], [1, 2]]."""
    m = _PAIRS.search(line)
    return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))] if m else []


def _result_text(line: str, op_start: int) -> str:
    return line[line.index("=") + 1:op_start]


def _async_output(kind: str, result: str) -> str:
    """The output part of an async ``-start`` result: all-gather-start and reduce-scatter-start give
    (operands, outputs), collective-permute-start (operand, output, contexts); all-reduce-start just
    the outputs."""
    parts = tuple_elements(result)
    if kind in ("all-gather", "reduce-scatter") and len(parts) == 2:
        return parts[1]
    if kind == "collective-permute" and len(parts) >= 2:
        return parts[1]
    return result


def _call_graph(module):
    """How often each computation runs per step, and which conditional branch (if any) it is in.

    Returns (runs, branch_of {computation: (conditional id, branch index)}, branch counts
    {conditional id: branches}, while loops of unknown trip count). HLO text lists callees
    before callers, so callers are walked first; a computation inside a branch inherits it.
    """
    runs = {name: (1 if c.entry else 0) for name, c in module.computations.items()}
    branch_of, branch_counts, unknown = {}, {}, 0
    for name in reversed(module.order):
        for index, line in enumerate(module.computations[name].lines):
            alternatives = branches(line)
            called = [(key, c) for key, c in callees(line) if c not in alternatives] + \
                [("branch", c) for c in alternatives]
            trip = 1
            if " while(" in line:
                known = trip_count(line)
                trip = 1 if known is None else known
                unknown += known is None
            if alternatives:
                branch_counts[(name, index)] = len(alternatives)
            for key, callee in called:
                if callee not in runs:
                    continue
                runs[callee] += runs[name] * (trip if key == "body" else 1)
                tag = branch_of.get(name)  # nested conditionals count as their outermost branch
                if tag is None and callee in alternatives:
                    tag = ((name, index), alternatives.index(callee))
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


def collective_instructions(hlo_text: str, num_devices: int) -> list:
    """Every collective instruction of the module, in text order: ``{"name", "kind", "computation",
    "runs"`` (times per step), ``"output_bytes", "input_bytes", "ring_bytes"`` (per device, per run),
    ``"output_by_dtype"`` (the output bytes per element type, ``{"bf16": ..., "f32": ...}``),
    ``"groups"`` (replica groups; a collective-permute: None, and its ``"pairs"``), ``"branch"``
    (the (conditional, branch index) it runs in, or None)``}``. A ``-start`` is the instruction; its
    ``-done`` is not listed."""
    module = read_module(hlo_text)
    runs, branch_of, _, _ = _call_graph(module)
    found = []
    for name, c in module.computations.items():
        for line in c.lines:
            m = _OP.search(line)
            if not m or "=" not in line[:m.start()]:
                continue
            kind, is_start = m.group(1), m.group(2) is not None
            result = _result_text(line, m.start())
            by_dtype = shape_bytes_by_dtype(_async_output(kind, result) if is_start else result)
            out = sum(by_dtype.values(), 0.0)
            permute = kind == "collective-permute"
            groups = None if permute else replica_groups(line, num_devices)
            inp, ring = _op_bytes(kind, out, max(len(groups[0]) if groups else num_devices, 1))
            found.append({"name": line.split("=", 1)[0].strip().lstrip("ROOT").strip().lstrip("%"), "kind": kind,
                          "computation": name, "runs": runs.get(name, 1) or 1, "output_bytes": out,
                          "input_bytes": inp, "ring_bytes": ring, "groups": groups, "output_by_dtype": by_dtype,
                          "pairs": permute_pairs(line) if permute else None, "branch": branch_of.get(name)})
    return found


def parse_collectives(hlo_text: str, num_devices: int) -> dict:
    """Count collectives in optimized HLO text; bytes per device, in ring terms (see module docstring).

    Returns ``{"ops": {kind: {"count", "input_bytes", "output_bytes", "output_by_dtype", "ring_bytes",
    "by_groups"}},
    "ring_bytes": total, "conditionals": [ring bytes per branch, ...], "unknown_trip_counts": n}``.
    ``ops`` counts every op, in every branch; ``ring_bytes`` counts the larger branch of each
    conditional. ``by_groups``: per distinct replica-group layout (collective-permute: groups None, per
    distinct ``pairs``, its source/target device pairs).
    """
    _, _, branch_counts, unknown = _call_graph(read_module(hlo_text))
    ops = {kind: {"count": 0, "input_bytes": 0.0, "output_bytes": 0.0, "ring_bytes": 0.0, "by_groups": [],
                  "output_by_dtype": {}} for kind in COLLECTIVES}
    unconditional, branch_ring = 0.0, {cid: [0.0] * n for cid, n in branch_counts.items()}
    for op in collective_instructions(hlo_text, num_devices):
        k, entry = op["runs"], ops[op["kind"]]
        entry["count"] += k
        entry["input_bytes"] += k * op["input_bytes"]
        entry["output_bytes"] += k * op["output_bytes"]
        for dtype, b in op["output_by_dtype"].items():
            entry["output_by_dtype"][dtype] = entry["output_by_dtype"].get(dtype, 0.0) + k * b
        entry["ring_bytes"] += k * op["ring_bytes"]
        _add_to_groups(entry["by_groups"], op["groups"], k, op["output_bytes"], op["ring_bytes"], op["pairs"])
        if op["branch"] is not None:
            cid, branch = op["branch"]
            branch_ring[cid][branch] += k * op["ring_bytes"]
        else:
            unconditional += k * op["ring_bytes"]
    conditionals = [b for b in branch_ring.values() if any(b)]
    return {"ops": ops, "ring_bytes": unconditional + sum(max(b) for b in conditionals),
            "conditionals": conditionals, "unknown_trip_counts": unknown}


def _add_to_groups(by_groups: list, groups, k: int, out: float, ring: float, pairs=None) -> None:
    """Per distinct replica groups (a collective-permute: per distinct ``pairs``)."""
    for entry in by_groups:
        if entry["groups"] == groups and entry.get("pairs") == pairs:
            break
    else:
        entry = {"groups": groups, "count": 0, "output_bytes": 0.0, "ring_bytes": 0.0}
        if pairs is not None:
            entry["pairs"] = pairs
        by_groups.append(entry)
    entry["count"] += k
    entry["output_bytes"] += k * out
    entry["ring_bytes"] += k * ring


def compiled_memory(compiled) -> dict:
    m = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
              "generated_code_size_in_bytes")
    return {f.replace("_size_in_bytes", "_bytes"): int(getattr(m, f, 0) or 0) for f in fields}
