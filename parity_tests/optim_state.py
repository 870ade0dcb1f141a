"""jaxdp's optimizer state in ``torch.optim``'s vocabulary, and back.

``make_optimizer``'s optax states (``jaxdp.optim``) hold what torch's optimizers keep per
parameter, under other names: the SGD momentum trace is torch's ``momentum_buffer``,
``ScaleByAdamState``'s ``mu``/``nu``/``count`` are ``exp_avg``/``exp_avg_sq``/``step``. The
parity harness compares them step by step (``torch_optimizer_state``); a torch run's state
loads into jaxdp with ``optimizer_state_from_torch``. Torch-free (numpy trees), but torch's
vocabulary: it lives beside the harness, behind the [torch] extra.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import optax

from jaxdp.optim import OPTIMIZERS, _choice


_STATE_TYPES = (optax.TraceState, optax.ScaleByAdamState, optax.ScaleByScheduleState)


def _find(opt_state, cls) -> list:
    return [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, cls))
            if isinstance(s, cls)]


def torch_optimizer_state(name: str, opt_state) -> dict[str, Any]:
    """The optax state of ``make_optimizer(name, ...)`` in ``torch.optim``'s vocabulary.

    Returns dicts of trees shaped like params, so ``result[key]`` at a param's path
    corresponds to ``torch_opt.state[p][key]``:

    - sgd: ``{"momentum_buffer": tree}``; ``{}`` when momentum == 0 (torch keeps no state).
    - adam/adamw: ``{"exp_avg": tree, "exp_avg_sq": tree, "step": int}``.

    Arrays are returned as they are stored (jax arrays, not copied). Before the first step
    torch has no state yet; here the buffers are zeros and step is 0, which steps exactly
    like torch's lazily created buffers. Call outside jit (``step`` is a python int).
    """
    _choice("optimizer", name, OPTIMIZERS)
    if name == "sgd":
        traces = _find(opt_state, optax.TraceState)
        if len(traces) > 1:
            raise ValueError(f"expected one momentum trace in the sgd state, found {len(traces)}")
        return {"momentum_buffer": traces[0].trace} if traces else {}
    adam = _find(opt_state, optax.ScaleByAdamState)
    if len(adam) != 1:
        raise ValueError(f"expected one ScaleByAdamState in the {name} state, found {len(adam)}")
    s = adam[0]
    return {"exp_avg": s.mu, "exp_avg_sq": s.nu, "step": int(s.count)}


def optimizer_state_from_torch(name: str, tx: optax.GradientTransformation, params,
                               torch_like_state: Mapping[str, Any]):
    """Inverse of ``torch_optimizer_state``: an optax state for ``tx`` holding torch's state.

    ``torch_like_state`` has the keys ``torch_optimizer_state`` returns, with trees
    (numpy arrays or anything ``np.asarray`` takes) shaped like ``params``. Values are cast
    to the dtype and placed with the sharding of ``tx.init(params)``.

    The schedule's step count (optax keeps one in ``ScaleByScheduleState``) is set to
    ``step`` as well: torch's scheduler has stepped once per optimizer step. torch's SGD
    state has no step, so for sgd with a schedule pass ``"step"`` (the scheduler's
    ``last_epoch``) in ``torch_like_state``. A missing or None ``momentum_buffer`` means torch
    has not stepped yet and loads as zeros (see ``torch_optimizer_state``).
    """
    _choice("optimizer", name, OPTIMIZERS)
    state = tx.init(params)

    def load(tree, like_tree, key):
        def one(like, x):
            x = np.asarray(x)
            if x.shape != like.shape:
                raise ValueError(f"{key}: shape {x.shape} does not match the param's {like.shape}")
            return jax.device_put(x.astype(like.dtype), like.sharding)
        got, want = jax.tree.structure(tree), jax.tree.structure(like_tree)
        if got != want:
            raise ValueError(f"{key} tree {got} does not match the params tree {want}")
        return jax.tree.map(one, like_tree, tree)

    step = torch_like_state.get("step")
    if name == "sgd":
        buf = torch_like_state.get("momentum_buffer")
        if buf is not None and not _find(state, optax.TraceState):
            raise ValueError("torch state has a momentum_buffer but tx has no momentum")
        if step is None and _find(state, optax.ScaleByScheduleState):
            raise ValueError("sgd with a schedule needs torch_like_state['step'] (the torch "
                             "scheduler's last_epoch): torch's SGD state holds no step count")
    else:
        buf = None
        for key in ("exp_avg", "exp_avg_sq", "step"):
            if torch_like_state.get(key) is None:
                raise ValueError(f"{name} state needs {key!r}")
    if step is not None:
        step = int(step)

    def count(like):
        return jax.device_put(np.asarray(step, like.dtype), like.sharding)

    def replace(node):
        if isinstance(node, optax.TraceState) and buf is not None:
            return node._replace(trace=load(buf, node.trace, "momentum_buffer"))
        if isinstance(node, optax.ScaleByAdamState):
            return node._replace(count=count(node.count),
                                 mu=load(torch_like_state["exp_avg"], node.mu, "exp_avg"),
                                 nu=load(torch_like_state["exp_avg_sq"], node.nu, "exp_avg_sq"))
        if isinstance(node, optax.ScaleByScheduleState) and step is not None:
            return node._replace(count=count(node.count))
        return node

    return jax.tree.map(replace, state, is_leaf=lambda x: isinstance(x, _STATE_TYPES))
