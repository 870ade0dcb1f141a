"""jaxdp's own models (ResNet, ViT) and their torch twins: correspondences from key grammars.

A ResNet or ViT of jaxdp's needs no rules and no torch model to match: its variable tree
mirrors the torch module tree, so each torch key names its Flax path, and the layouts are
``jaxdp.interop.layouts``'. It works on numpy arrays only and never imports torch (pass
``{k: v.numpy() for k, v in sd.items()}``, or the tensors themselves).

Names. jaxdp's variable tree mirrors the torch module tree, so a torch key is
the Flax path joined with dots, with the leaf renamed:

    torch                          Flax
    conv1.weight                   params/conv1/kernel
    fc.weight, fc.bias             params/fc/kernel, params/fc/bias
    bn1.weight, bn1.bias           params/bn1/scale, params/bn1/bias
    bn1.running_mean / _var        batch_stats/bn1/mean, batch_stats/bn1/var
    bn1.num_batches_tracked        (dropped; momentum is fixed, so it is never read)

Layouts: a convolution's kernel is permuted (OIHW <-> HWIO), a Dense kernel transposed,
everything else (BN vectors, biases) copied: ``LAYOUTS``' ``conv``, ``linear``, ``identity``.

Each model keeps its key grammar beside it: ``jaxdp.models.resnet.torch_names``
(torchvision's keys and their order) and ``jaxdp.models.vit.torch_names`` (timm's).
Every public function here takes either, a ViT told apart by its ``cls_token``;
``correspondence(state_dict)`` is the ``Correspondence`` they load a state_dict by.

Conversion only moves and permutes values, never does arithmetic, so every
round trip is bit-exact. The same rules convert any params-shaped tree (grads,
SGD momentum, Adam m/v) to torch names and layout: ``tree_to_torch_names``.
"""

from typing import Any, Dict, Mapping, Tuple

import jax
import numpy as np

from jaxdp.interop.correspondence import Correspondence, Link
from jaxdp.interop.layouts import LAYOUTS, Layout, fresh_numpy
from jaxdp.models.errors import key_listing
from jaxdp.models.resnet import torch_names as resnet_names
from jaxdp.models.vit import torch_names as vit_names

Path = Tuple[str, ...]

# Flax leaf name -> torch leaf name. The two sets of Flax names are disjoint,
# so a leaf's name alone says whether it lives in "params" or "batch_stats".
_PARAM_LEAVES = {"kernel": "weight", "scale": "weight", "bias": "bias"}
_STAT_LEAVES = {"mean": "running_mean", "var": "running_var"}
_KIND_LEAVES = {"param": _PARAM_LEAVES, "batch_stats": _STAT_LEAVES}
_NBT = resnet_names.NBT


# --- layouts -----------------------------------------------------------------

def _layout(flax_leaf: str, ndim: int) -> Layout:
    """A conv kernel (4-D) is permuted, a Dense kernel (2-D) transposed, everything else copied."""
    if flax_leaf == "kernel" and ndim == 4:
        return LAYOUTS["conv"]  # OIHW <-> HWIO
    if flax_leaf == "kernel" and ndim == 2:
        return LAYOUTS["linear"]  # Linear (out, in) <-> Dense (in, out)
    return LAYOUTS["identity"]


# --- tree <-> torch names ----------------------------------------------------

def _flatten(tree) -> Dict[Path, Any]:
    """{path of str: leaf} for nested dicts / FrozenDicts / optax containers."""
    out = {}
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = []
        for k in keypath:
            for attr in ("key", "name", "idx"):
                if hasattr(k, attr):
                    parts.append(str(getattr(k, attr)))
                    break
        out[tuple(parts)] = leaf
    return out


def _torch_name(path: Path, kind: str) -> str:
    leaves = _KIND_LEAVES[kind]
    if path[-1] not in leaves:
        raise ValueError(
            f"{'/'.join(path)}: leaf {path[-1]!r} is not a {kind} leaf ({', '.join(leaves)})"
        )
    return ".".join(path[:-1] + (leaves[path[-1]],))


def param_name_map(params, kind: str = "param") -> Dict[str, Path]:
    """{torch name: Flax path} for a params tree (``kind="param"``, e.g.
    ``"layer1.0.conv1.weight": ("layer1", "0", "conv1", "kernel")``) or a
    batch_stats tree (``kind="batch_stats"``), in torchvision's order."""
    if kind not in _KIND_LEAVES:
        raise ValueError(f"kind must be one of {', '.join(_KIND_LEAVES)}, got {kind!r}")
    if vit_names.is_vit_tree(params):
        if kind != "param":
            raise ValueError("a ViT has no batch_stats; its tree is a param tree")
        return vit_names.param_name_map(_flatten(params))
    names = {_torch_name(path, kind): path for path in _flatten(params)}
    return {n: names[n] for n in resnet_names.torchvision_order(names)}


def tree_to_torch_names(tree, kind: str = "param") -> Dict[str, np.ndarray]:
    """Any tree shaped like ``params`` (grads, SGD momentum, Adam m/v) or, with
    ``kind="batch_stats"``, like ``batch_stats`` -> {torch name: array in torch layout}.

    Compare with ``{n: p.grad for n, p in model.named_parameters()}`` or
    ``optimizer.state[p]["momentum_buffer"]``."""
    flat = _flatten(tree)
    return {
        name: _layout(path[-1], np.ndim(flat[path])).to_torch(fresh_numpy(flat[path]))
        for name, path in param_name_map(tree, kind).items()
    }


def tree_from_torch_names(named: Mapping[str, Any], like_params, kind: str = "param"):
    """Inverse of ``tree_to_torch_names``: arrays keyed by torch name (torch layout)
    -> a tree with the structure of ``like_params`` (Flax layout, numpy leaves)."""
    names = param_name_map(like_params, kind)
    missing = [n for n in names if n not in named]
    unexpected = sorted(set(named) - set(names))
    if missing or unexpected:
        raise ValueError(
            f"torch names do not match the tree: missing: {key_listing(missing) or 'none'}; "
            f"unexpected: {key_listing(unexpected) or 'none'}")
    by_path = {}
    like = _flatten(like_params)
    for name, path in names.items():
        value = fresh_numpy(named[name])
        x = _layout(path[-1], value.ndim).to_flax(value)
        if x.shape != tuple(np.shape(like[path])):
            raise ValueError(f"{name}: shape {x.shape} in Flax layout, expected {np.shape(like[path])}")
        by_path[path] = x
    treedef = jax.tree_util.tree_structure(like_params)
    return jax.tree_util.tree_unflatten(treedef, [by_path[p] for p in like])


# --- whole state_dicts -------------------------------------------------------

def correspondence(state_dict: Mapping[str, Any]) -> Correspondence:
    """The ``Correspondence`` of a torchvision-layout ResNet's or a timm-layout ViT's
    ``state_dict`` (its keys checked: ValueError naming every missing or unexpected one).
    ``num_batches_tracked`` has no Flax variable (momentum is fixed, so it is never read)."""
    if vit_names.is_vit_state_dict(state_dict):
        vit_names.check_keys(state_dict, "state_dict")
        return Correspondence([_link(name, ("params",) + vit_names.flax_path(name), value, False)
                               for name, value in state_dict.items()])
    resnet_names.check_keys(state_dict, "state_dict")
    links, ignored = [], []
    for name, value in state_dict.items():
        *module, leaf = name.split(".")
        if leaf == _NBT:
            ignored.append(name)
        elif leaf in ("running_mean", "running_var"):
            links.append(_link(name, ("batch_stats", *module, leaf[len("running_"):]), value, True))
        else:  # Conv (4-d) and Linear (2-d) weights are kernels, a 1-d weight is BN's scale; "bias" stays
            flax_leaf = "bias" if leaf == "bias" else "kernel" if np.ndim(value) in (2, 4) else "scale"
            links.append(_link(name, ("params", *module, flax_leaf), value, False))
    return Correspondence(links, ignored)


def _link(name: str, key: Path, value, buffer: bool) -> Link:
    shape = tuple(np.shape(value))
    return Link(name, key, _layout(key[-1], len(shape)), buffer, shape)


def variables_from_state_dict(state_dict: Mapping[str, Any], dtype=None) -> dict:
    """A torchvision-layout ResNet ``state_dict`` -> ``{"params", "batch_stats"}``
    for ``jaxdp.models.create_model(...)`` (nested dicts of numpy arrays; cast to
    ``dtype`` if given, e.g. ``"float64"``). ``num_batches_tracked`` is dropped.

    Raises ValueError naming every missing or unexpected key.

    A ViT's state_dict gives ``{"params"}`` alone (it has no buffers), as its ``init`` does."""
    variables = correspondence(state_dict).to_flax(state_dict, None if dtype is None else np.dtype(dtype))
    if vit_names.is_vit_state_dict(state_dict):
        return {"params": variables.get("params", {})}
    return {"params": variables.get("params", {}), "batch_stats": variables.get("batch_stats", {})}


def state_dict_from_variables(variables: Mapping[str, Any], num_batches_tracked: int = 0) -> Dict[str, np.ndarray]:
    """``{"params", "batch_stats"}`` of a jaxdp ResNet -> a torchvision-layout
    ``state_dict`` of numpy arrays in torchvision's key order, ready for
    ``model.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()})``.

    Every BN gets ``num_batches_tracked`` (an int64 scalar): torch counts
    training forwards there, jaxdp does not track it. A ViT has no BN, hence no such key."""
    named = tree_to_torch_names(variables["params"], "param")
    if vit_names.is_vit_tree(variables["params"]):
        if variables.get("batch_stats"):
            raise ValueError("a ViT has no batch_stats, but variables carry some")
        order = vit_names.check_keys(named, "variables")
        return {k: named[k] for k in order}
    stats = tree_to_torch_names(variables.get("batch_stats", {}), "batch_stats")
    named.update(stats)
    for name in stats:
        if name.endswith(".running_mean"):
            named[name[: -len("running_mean")] + _NBT] = np.asarray(num_batches_tracked, dtype=np.int64)
    order = resnet_names.check_keys(named, "variables")
    return {k: named[k] for k in order if k in named}


resnet_state_dict_keys = resnet_names.state_dict_keys

__all__ = [
    "correspondence",
    "param_name_map",
    "resnet_state_dict_keys",
    "state_dict_from_variables",
    "tree_from_torch_names",
    "tree_to_torch_names",
    "variables_from_state_dict",
]
