"""Tensors that do not train in torch, whatever their kind on the other side, compared as values.

A port may keep a torch *buffer* as a Flax *param* (read under ``stop_gradient``), or a torch
parameter with ``requires_grad=False`` as Flax state. Neither trains in torch, so neither may in
jaxdp: no gradient, no optimizer state, no weight decay. Such a tensor is compared as torch
compares a buffer, its value at every step, on both sides:

- jaxdp's side keeps a Flax param of this kind out of its params, in the model state's
  ``NON_TRAINABLE`` collection (replicated, never differentiated), and puts it back for each
  call; the strategy learns the model's structure from an ``init`` that leaves it out too
  (``TrainableOnly``);
- torch's record lists a frozen parameter under ``buffers``, not ``params`` (it has no
  gradient there already).

A torch parameter that trains against Flax state is refused by the correspondence.
Jax- and torch-free at import.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Mapping, Sequence, Tuple

NON_TRAINABLE = "non_trainable_params"  # a model-state collection of jaxdp's side: the params that do not train


def jax_key(link) -> Tuple[str, ...]:
    """Where jaxdp's state keeps ``link``'s variable (a ``jaxdp.interop.Link``): its Flax key, or
    under ``NON_TRAINABLE`` for a Flax param that does not train."""
    return (NON_TRAINABLE,) + link.flax[1:] if link.non_trainable_param else link.flax


def split(variables: Mapping[str, Any], keys: Iterable[Tuple[str, ...]]) -> Dict[str, Any]:
    """Flax ``variables`` with the params at ``keys`` (``("params", *path)``) moved to ``NON_TRAINABLE``."""
    keys = list(keys)
    if not keys:
        return dict(variables)
    out = {**variables, "params": _copy(variables["params"]), NON_TRAINABLE: {}}
    for key in keys:
        node, target = out["params"], out[NON_TRAINABLE]
        for part in key[1:-1]:
            node, target = node[part], target.setdefault(part, {})
        target[key[-1]] = node.pop(key[-1])
    return out


class TrainableOnly:
    """The Flax model as a jaxdp strategy sees it when it learns the params' structure (their
    order, the FSDP units) from ``init``: with the params that do not train moved out, as its
    state has them. Only ``init``: the harness applies the model itself (``jax_pair.apply_fn``)."""

    def __init__(self, model, keys: Sequence[Tuple[str, ...]]):
        self.model, self.keys = model, tuple(keys)

    def init(self, *args, **kwargs):
        return split(self.model.init(*args, **kwargs), self.keys)


def for_strategy(model, keys: Sequence[Tuple[str, ...]]):
    """``model`` for ``create_strategy``: itself, or with params that do not train, a ``TrainableOnly``."""
    return TrainableOnly(model, keys) if keys else model


def joined(variables: Mapping[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(the variables the model is applied with: the params that do not train back among the
    params, those params themselves: returned unchanged in the new model state)."""
    if NON_TRAINABLE not in variables:
        return dict(variables), {}
    rest = {k: v for k, v in variables.items() if k != NON_TRAINABLE}
    return {**rest, "params": _merge(variables["params"], variables[NON_TRAINABLE])}, \
        {NON_TRAINABLE: variables[NON_TRAINABLE]}


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
