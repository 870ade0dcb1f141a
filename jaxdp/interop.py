"""Weight conversion between torch ``state_dict``s and jaxdp's Flax models.

The one place where torch and Flax names and layouts meet. It works on numpy
arrays only and never imports torch, so jaxdp stays importable without it
(pass ``{k: v.numpy() for k, v in sd.items()}``, or the tensors themselves:
anything with ``.detach().cpu().numpy()`` or ``__array__`` is accepted).

Names. jaxdp's variable tree mirrors the torch module tree, so a torch key is
the Flax path joined with dots, with the leaf renamed:

    torch                          Flax
    conv1.weight                   params/conv1/kernel
    fc.weight, fc.bias             params/fc/kernel, params/fc/bias
    bn1.weight, bn1.bias           params/bn1/scale, params/bn1/bias
    bn1.running_mean / _var        batch_stats/bn1/mean, batch_stats/bn1/var
    bn1.num_batches_tracked        (dropped; momentum is fixed, so it is never read)

Layouts. Both frameworks compute cross-correlation (neither flips the kernel),
so converting a convolution is a pure axis permutation: torch keeps
(out, in, kh, kw) for NCHW inputs, Flax ``nn.Conv`` keeps (kh, kw, in, out) for
NHWC, hence OIHW -> HWIO is ``transpose(2, 3, 1, 0)`` and HWIO -> OIHW is
``transpose(3, 2, 0, 1)``. ``nn.Linear`` computes ``x @ W.T + b`` with W (out, in)
while ``nn.Dense`` computes ``x @ K + b`` with K (in, out), so K = W.T.
Everything else (BN vectors, biases) is stored identically.

Each model keeps its key grammar beside it: ``jaxdp.models.resnet.torch_names``
(torchvision's keys and their order) and ``jaxdp.models.vit.torch_names`` (timm's).
Every public function here takes either, a ViT told apart by its ``cls_token``; the
layouts are the rules above, here.

Conversion only moves and permutes values, never does arithmetic, so every
round trip is bit-exact. The same rules convert any params-shaped tree (grads,
SGD momentum, Adam m/v) to torch names and layout: ``tree_to_torch_names``.
"""

from typing import Any, Dict, Mapping, Tuple

import jax
import numpy as np

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

# Both return C-contiguous arrays, which torch.from_numpy and jax take without
# surprises (a transposed view would carry its strides along).

def _to_torch_layout(flax_leaf: str, x: np.ndarray) -> np.ndarray:
    if flax_leaf == "kernel" and x.ndim == 4:
        return np.ascontiguousarray(x.transpose(3, 2, 0, 1))  # HWIO -> OIHW
    if flax_leaf == "kernel" and x.ndim == 2:
        return np.ascontiguousarray(x.T)  # Dense (in, out) -> Linear (out, in)
    return x


def _to_flax_layout(flax_leaf: str, x: np.ndarray) -> np.ndarray:
    if flax_leaf == "kernel" and x.ndim == 4:
        return np.ascontiguousarray(x.transpose(2, 3, 1, 0))  # OIHW -> HWIO
    if flax_leaf == "kernel" and x.ndim == 2:
        return np.ascontiguousarray(x.T)  # Linear (out, in) -> Dense (in, out)
    return x


def _numpy(x: Any) -> np.ndarray:
    """A fresh, writable numpy copy of a torch tensor (any device), jax array or numpy
    array, without importing torch. Always a copy: ``state_dict()`` tensors share
    storage with the live parameters, so a view would change under the caller's
    feet at the next ``optimizer.step()`` (and jax hands out read-only views)."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        x = x.detach().cpu().numpy()
    return np.array(x, copy=True)


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
        name: _to_torch_layout(path[-1], _numpy(flat[path]))
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
        x = _to_flax_layout(path[-1], _numpy(named[name]))
        if x.shape != tuple(np.shape(like[path])):
            raise ValueError(f"{name}: shape {x.shape} in Flax layout, expected {np.shape(like[path])}")
        by_path[path] = x
    treedef = jax.tree_util.tree_structure(like_params)
    return jax.tree_util.tree_unflatten(treedef, [by_path[p] for p in like])


# --- whole state_dicts -------------------------------------------------------

def _nest(flat: Mapping[Path, Any]) -> dict:
    out: dict = {}
    for path, x in flat.items():
        d = out
        for p in path[:-1]:
            d = d.setdefault(p, {})
        d[path[-1]] = x
    return out


def variables_from_state_dict(state_dict: Mapping[str, Any], dtype=None) -> dict:
    """A torchvision-layout ResNet ``state_dict`` -> ``{"params", "batch_stats"}``
    for ``jaxdp.models.create_model(...)`` (nested dicts of numpy arrays; cast to
    ``dtype`` if given, e.g. ``"float64"``). ``num_batches_tracked`` is dropped.

    Raises ValueError naming every missing or unexpected key.

    A ViT's state_dict gives ``{"params"}`` alone (it has no buffers), as its ``init`` does."""
    cast = (lambda x: x) if dtype is None else (lambda x: x.astype(np.dtype(dtype)))
    if vit_names.is_vit_state_dict(state_dict):
        vit_names.check_keys(state_dict, "state_dict")
        flat = {}
        for name, value in state_dict.items():
            path = vit_names.flax_path(name)
            flat[path] = cast(_to_flax_layout(path[-1], _numpy(value)))
        return {"params": _nest(flat)}
    resnet_names.check_keys(state_dict, "state_dict")
    params, stats = {}, {}
    for name, value in state_dict.items():
        *module, leaf = name.split(".")
        module = tuple(module)
        x = _numpy(value)
        if leaf == _NBT:
            continue
        if leaf == "running_mean":
            stats[module + ("mean",)] = cast(x)
        elif leaf == "running_var":
            stats[module + ("var",)] = cast(x)
        elif leaf == "weight":
            # Conv (4-d) and Linear (2-d) weights are kernels; a 1-d weight is BN's scale.
            flax_leaf = "kernel" if x.ndim in (2, 4) else "scale"
            params[module + (flax_leaf,)] = cast(_to_flax_layout(flax_leaf, x))
        else:  # "bias": the key check admits no other leaf
            params[module + ("bias",)] = cast(x)
    return {"params": _nest(params), "batch_stats": _nest(stats)}


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
    "param_name_map",
    "resnet_state_dict_keys",
    "state_dict_from_variables",
    "tree_from_torch_names",
    "tree_to_torch_names",
    "variables_from_state_dict",
]
