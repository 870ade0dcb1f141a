"""The ViT's torch names: the twin's ``state_dict`` keys and their Flax paths.

The Flax tree mirrors the torch module tree (torch_ref/vit.py, timm's layout),
so a torch key is the Flax path joined with dots, with the leaf renamed:

    torch                            Flax
    cls_token, pos_embed             params/cls_token, params/pos_embed
    patch_embed.proj.weight, .bias   params/patch_embed/proj/kernel, /bias
    blocks.0.norm1.weight, .bias     params/blocks/0/norm1/scale, /bias
    blocks.0.attn.qkv.weight         params/blocks/0/attn/qkv/kernel
    head.weight, head.bias           params/head/kernel, params/head/bias

Names only: the array layouts (OIHW <-> HWIO, Linear ``.T``) are the same rules as
the ResNet's and live in ``jaxdp.interop``, which dispatches here for a ViT. A ViT
has no buffers, so there is no ``batch_stats`` side.
"""

import re
from typing import Dict, Iterable, List, Tuple

from jaxdp.models.errors import key_mismatch

Path = Tuple[str, ...]

_TOKENS = ("cls_token", "pos_embed")  # bare nn.Parameters of the root module
_BLOCK_LAYERS = ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2")
_TO_TORCH = {"kernel": "weight", "scale": "weight", "bias": "bias", **{t: t for t in _TOKENS}}


def is_vit_state_dict(names: Iterable[str]) -> bool:
    """A ViT state_dict, possibly wrapped (``module.cls_token``): it has a class token."""
    return any(n == "cls_token" or n.endswith(".cls_token") for n in names)


def is_vit_tree(tree) -> bool:
    """A ViT params-shaped tree (params, grads, Adam moments): ``cls_token`` at the top."""
    try:
        return "cls_token" in tree
    except TypeError:
        return False


def infer_depth(names: Iterable[str]) -> int:
    """Blocks from the keys themselves (at least one, so a keyless block is reported missing)."""
    idx = [int(m.group(1)) for n in names if (m := re.match(r"blocks\.(\d+)\.", n))]
    return max(idx) + 1 if idx else 1


def state_dict_keys(depth: int) -> List[str]:
    """Every key of the torch twin's state_dict, in its order (a module's own
    parameters before its children's, so the two tokens come first)."""
    keys = list(_TOKENS) + ["patch_embed.proj.weight", "patch_embed.proj.bias"]
    for b in range(depth):
        keys += [f"blocks.{b}.{layer}.{leaf}" for layer in _BLOCK_LAYERS for leaf in ("weight", "bias")]
    return keys + ["norm.weight", "norm.bias", "head.weight", "head.bias"]


def torch_name(path: Path) -> str:
    if path[-1] not in _TO_TORCH:
        raise ValueError(f"{'/'.join(path)}: leaf {path[-1]!r} is not a ViT param leaf "
                         f"({', '.join(_TO_TORCH)})")
    return ".".join(path[:-1] + (_TO_TORCH[path[-1]],))


def flax_path(name: str) -> Path:
    """The Flax path of a (known-good) torch key: a LayerNorm's weight is its scale,
    any other weight a kernel."""
    *module, leaf = name.split(".")
    if leaf == "weight":
        leaf = "scale" if module[-1].startswith("norm") else "kernel"
    return tuple(module) + (leaf,)


def ordered(names: Iterable[str]) -> List[str]:
    """Sort torch names as the twin's state_dict lists them (unknown names last)."""
    names = list(names)
    rank = {k: i for i, k in enumerate(state_dict_keys(infer_depth(names)))}
    return sorted(names, key=lambda k: (rank.get(k, len(rank)), k))


def param_name_map(paths: Iterable[Path]) -> Dict[str, Path]:
    """{torch name: Flax path} for the paths of a params-shaped tree, in torch's order."""
    names = {torch_name(p): p for p in paths}
    return {n: names[n] for n in ordered(names)}


def check_keys(names: Iterable[str], what: str) -> List[str]:
    """Raise ValueError (one line) naming the missing and unexpected keys; return
    the expected keys in the twin's order."""
    names = set(names)
    depth = infer_depth(names)
    expected = state_dict_keys(depth)
    missing = [k for k in expected if k not in names]
    unexpected = sorted(names - set(expected))
    if missing or unexpected:
        raise key_mismatch(what, f"a ViT with depth {depth}", missing, unexpected)
    return expected
