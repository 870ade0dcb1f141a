"""FLOPs counted in a jaxpr: 2 x the multiply-accumulates of every convolution and matrix product.

From shapes alone (no compile, no device), so it counts what XLA's cost analysis cannot: on a GPU,
XLA hands convolutions and matmuls to cuDNN/cuBLAS custom calls, which its cost analysis counts as
0 FLOPs (``HloCostAnalysis::HandleCustomCall``), and a program compiled for a compile-only GPU has
no cost analysis at all. ``jaxdp.run.flops`` counts a model's forward with it (the MFU convention);
``jaxdp.analysis.estimate`` counts a whole training step (backward and recomputation included).
"""

import math

import jax


def jaxpr_flops(jaxpr) -> float:
    """The FLOPs of a jaxpr (a ``ClosedJaxpr`` or ``Jaxpr``), its sub-jaxprs included: a scan's body
    ``length`` times, a cond's dearest branch once."""
    return _jaxpr_flops(getattr(jaxpr, "jaxpr", jaxpr))


def forward_flops(fn, *args) -> float:
    """2 x the multiply-accumulates of the convolutions and matrix products ``fn(*args)``
    runs (``args``: arrays or ``jax.ShapeDtypeStruct``s); nothing is computed."""
    return _jaxpr_flops(jax.make_jaxpr(fn)(*args).jaxpr)


def _jaxpr_flops(jaxpr) -> float:
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "conv_general_dilated":
            total += _conv_flops(eqn)
        elif name == "dot_general":
            total += _dot_flops(eqn)
        inner = [_jaxpr_flops(j) for j in _sub_jaxprs(eqn.params)]
        if inner:
            # a scan runs its body ``length`` times; a cond runs one branch (the dearest counts)
            total += max(inner) if name == "cond" else sum(inner) * eqn.params.get("length", 1)
    return total


def _sub_jaxprs(params: dict):
    for value in params.values():
        for v in value if isinstance(value, (list, tuple)) else (value,):
            if hasattr(v, "eqns"):  # a Jaxpr
                yield v
            elif hasattr(getattr(v, "jaxpr", None), "eqns"):  # a ClosedJaxpr
                yield v.jaxpr


def _conv_flops(eqn) -> float:
    """Each output element costs (input features per group x kernel window) MACs."""
    out = eqn.outvars[0].aval.shape
    kernel = eqn.invars[1].aval.shape
    out_features = kernel[eqn.params["dimension_numbers"].rhs_spec[0]]
    return 2.0 * math.prod(out) * math.prod(kernel) / out_features


def _dot_flops(eqn) -> float:
    """Each output element costs the product of the contracted dimensions in MACs."""
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    return 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in lhs_contract)
