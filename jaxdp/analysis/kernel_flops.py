"""FLOPs of one compiled kernel, read from its HLO: 2 x the multiply-accumulates of the convolutions
and matrix products it runs, from their shapes.

A GPU program runs them as cuDNN convolutions and cuBLAS(Lt) GEMMs (custom calls), Triton GEMM
fusions and fusions that hold a ``dot`` or a ``convolution``; XLA's own cost analysis counts the
custom calls as 0 FLOPs, and a compile-only GPU has no cost analysis at all. The count follows
``jaxdp.analysis.flops`` (the jaxpr's), so the two add up to the same step: each output element
of a convolution costs (kernel elements / output features) MACs; a dot's, the product of its
contracted dimensions. cuDNN's three calls (forward, input gradient, weight gradient) keep the
forward convolution's window and ``dim_labels``, so each is counted as the forward's MACs, read
from whichever of its operands and result are the forward's output and kernel. (The jaxpr writes
a strided convolution's input gradient as a dilated convolution and counts its zeros: there the
two counts differ.) Attention (``__cudnn$fmha``)
counts 0: the models here have none.

Text in, numbers out: nothing here imports jax.
"""

import math
import re
from typing import Dict, Optional, Tuple

from jaxdp.analysis.hlo_text import Instruction, Module, array_shapes, callees

_DIM_LABELS = re.compile(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)")
_LHS_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_GEMM_CONFIG = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
_CUDNN_CONV = re.compile(r'custom_call_target="__cudnn\$conv')
_CUDNN_CONV_KIND = re.compile(r'custom_call_target="__cudnn\$conv(BackwardInput|BackwardFilter)')
_CUBLAS = re.compile(r'custom_call_target="__cublas')
# The compute dtype a matmul's peak is read for (jaxdp.analysis.estimate.peak_flops).
DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64"}


def instruction_flops(module: Module, computation: str, i: Instruction) -> Tuple[float, Optional[str]]:
    """(FLOPs, compute dtype) of instruction ``i`` of ``computation``, the computations it calls
    included (a fusion's, a Triton GEMM's); (0, None) for one that multiplies nothing."""
    shapes = module.result_shapes(computation)
    own = _own_flops(i, shapes)
    if own:
        return own
    total, dtype = 0.0, None
    for key, called in callees(i.line):
        if key == "calls" and called in module.computations:
            for inner in module.instructions(called):
                flops, inner_dtype = instruction_flops(module, called, inner)
                total += flops
                dtype = dtype or inner_dtype
    return total, dtype


def _own_flops(i: Instruction, shapes: Dict[str, str]) -> Optional[Tuple[float, Optional[str]]]:
    operands = [array_shapes(shapes.get(o, "")) for o in i.operands[:2]]
    out = array_shapes(i.shape)
    if len(operands) < 2 or not out or not all(operands):
        return None
    (lhs_dtype, lhs), (_, rhs), (_, result) = operands[0][0], operands[1][0], out[0]
    if i.opcode == "convolution" or (i.opcode == "custom-call" and _CUDNN_CONV.search(i.line)):
        labels = _DIM_LABELS.search(i.line)
        if not labels:
            return None
        target = _CUDNN_CONV_KIND.search(i.line)
        # (the forward convolution's output, its kernel): each cuDNN call keeps the forward's labels
        y, w = {"BackwardInput": (lhs, rhs), "BackwardFilter": (rhs, result)}.get(
            target.group(1) if target else "", (result, rhs))
        return 2.0 * math.prod(y) * math.prod(w) / w[labels.group(2).index("o")], DTYPES.get(lhs_dtype)
    contracting = None
    if i.opcode == "dot":
        contracting = _LHS_CONTRACTING.search(i.line)
    elif i.opcode == "custom-call" and _CUBLAS.search(i.line):
        contracting = _GEMM_CONFIG.search(i.line)
    if contracting is None:
        return None
    dims = [int(d.strip().strip('"')) for d in contracting.group(1).split(",") if d.strip()]
    return 2.0 * math.prod(result) * math.prod(lhs[d] for d in dims), DTYPES.get(lhs_dtype)
