"""Tensors that do not train in torch, whatever their kind on the other side, compared as values.

A port may keep a torch *buffer* as a Flax *param* (read under ``stop_gradient``), or a torch
parameter with ``requires_grad=False`` as Flax state. Neither trains in torch, so neither may in
jaxdp: no gradient, no optimizer state, no weight decay. Such a tensor is compared as torch
compares a buffer, its value at every step, on both sides:

- jaxdp's side holds a Flax param of this kind out of its params, in the model state's
  ``HELD`` collection (replicated, never differentiated), and puts it back for each call; the
  strategy learns the model's structure from an ``init`` that holds it out too (``HeldOut``);
- torch's record lists a frozen parameter under ``buffers``, not ``params`` (it has no
  gradient there already).

A torch parameter that trains against Flax state is refused by the correspondence (``_kinds``).
Jax- and torch-free at import.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Mapping, Sequence, Tuple

HELD = "held_params"  # a model-state collection of jaxdp's side: the params that do not train


def split(variables: Mapping[str, Any], held: Iterable[Tuple[str, ...]]) -> Dict[str, Any]:
    """Flax ``variables`` with the ``held`` params (``("params", *path)``) moved to ``HELD``."""
    held = list(held)
    if not held:
        return dict(variables)
    out = {**variables, "params": _copy(variables["params"]), HELD: {}}
    for key in held:
        node, target = out["params"], out[HELD]
        for part in key[1:-1]:
            node, target = node[part], target.setdefault(part, {})
        target[key[-1]] = node.pop(key[-1])
    return out


class HeldOut:
    """The Flax model as a jaxdp strategy sees it when it learns the params' structure (their
    order, the FSDP units) from ``init``: with the ``held`` params moved out, as its state has them.
    Only ``init``: the harness applies the model itself (``jax_pair.apply_fn``)."""

    def __init__(self, model, held: Sequence[Tuple[str, ...]]):
        self.model, self.held = model, tuple(held)

    def init(self, *args, **kwargs):
        return split(self.model.init(*args, **kwargs), self.held)


def for_strategy(model, held: Sequence[Tuple[str, ...]]):
    """``model`` for ``create_strategy``: itself, or with held params, a ``HeldOut``."""
    return HeldOut(model, held) if held else model


def joined(variables: Mapping[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(the variables the model is applied with: the held params back among the params, the held
    params themselves: returned unchanged in the new model state)."""
    if HELD not in variables:
        return dict(variables), {}
    rest = {k: v for k, v in variables.items() if k != HELD}
    return {**rest, "params": _merge(variables["params"], variables[HELD])}, {HELD: variables[HELD]}


def torch_record(record: Dict[str, Any], frozen: Sequence[str]) -> Dict[str, Any]:
    """Torch's step record with each frozen parameter's value under ``buffers`` (not ``params``),
    and no gradient or optimizer state of it."""
    for name in frozen:
        record.setdefault("buffers", {})[name] = record["params"].pop(name)
        record.get("grads", {}).pop(name, None)
        record.get("optimizer_state", {}).pop(name, None)
    return record


def _copy(tree):
    return {k: _copy(v) for k, v in tree.items()} if isinstance(tree, Mapping) else tree


def _merge(a, b):
    if not isinstance(b, Mapping):
        return b
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(a.get(k, {}), v)
    return out
