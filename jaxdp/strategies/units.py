"""A ResNet as a sequence of FSDP units: stem, each residual block, head.

ZeRO-3 gathers one unit's parameters just before that unit runs, so it has to
run the model one unit at a time. ``ResNet`` is a single Flax module, so each
unit here is a small module applied to its own slice of the variable tree:

=========  ==========================  ======================================
unit       variables                   module
=========  ==========================  ======================================
stem       ``conv1``, ``bn1``           ``Stem``: cast, conv, BN, relu (+ maxpool)
layerK/i   ``layerK/i``                the model's own ``BasicBlock``/``Bottleneck``
head       ``fc``                      ``Head``: global average pool, Dense, cast
=========  ==========================  ======================================

The blocks are the model's classes with the attributes ``Stage`` gives them;
``Stem`` and ``Head`` restate the few lines of ``ResNet.__call__`` around the
stages, using the model's own conv/BN factories. Composing the units equals
``model.apply`` bit for bit (tests/test_zero.py checks both stems and both
block types), so the model itself stays untouched.
"""

from typing import Any, NamedTuple, Optional, Tuple

import flax.linen as nn
import jax.numpy as jnp

from jaxdp.models.resnet import ResNet, _Layers


class Stem(_Layers):
    width: int = 64
    stem: str = "cifar"

    @nn.compact
    def __call__(self, x, train):
        x = x.astype(self.dtype)
        if self.stem == "imagenet":
            x = self.conv(self.width, 7, 2, name="conv1")(x)
        else:
            x = self.conv(self.width, 3, 1, name="conv1")(x)
        x = nn.relu(self.bn(name="bn1")(x, train))
        if self.stem == "imagenet":
            x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        return x


class Head(nn.Module):
    num_classes: int = 10
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train):
        x = x.mean(axis=(1, 2))
        x = nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype, name="fc")(x)
        return x.astype(jnp.promote_types(self.dtype, jnp.float32))


class Unit(NamedTuple):
    name: str
    module: nn.Module
    path: Tuple[str, ...]  # where the unit's variables sit in the model's tree
    keys: Optional[Tuple[str, ...]] = None  # only these keys at ``path`` (stem, head); None: the whole subtree

    def take(self, tree):
        """This unit's slice of a params or batch_stats tree."""
        for k in self.path:
            tree = tree[k]
        return {k: tree[k] for k in self.keys if k in tree} if self.keys else tree

    def put(self, tree, sub):
        """``tree`` with this unit's slice replaced by ``sub`` (a new dict; ``tree`` is not changed)."""
        def go(t, path):
            if not path:
                return {**t, **sub} if self.keys else sub
            return {**t, path[0]: go(t[path[0]], path[1:])}
        return go(tree, self.path)


def model_units(model) -> Tuple[Unit, ...]:
    if not isinstance(model, ResNet):
        raise TypeError(f"ZeRO-3 knows how to split ResNet into units, not {type(model).__name__}")
    common = dict(dtype=model.dtype, param_dtype=model.param_dtype)
    units = [Unit("stem", Stem(width=model.width, stem=model.stem, bn_axis_name=model.bn_axis_name, **common),
                  (), ("conv1", "bn1"))]
    for s, num_blocks in enumerate(model.stage_sizes):
        for i in range(num_blocks):
            # As Stage builds them: the stage's stride on its first block only.
            block = model.block(planes=model.width * 2**s, stride=(1 if s == 0 else 2) if i == 0 else 1,
                                bn_axis_name=model.bn_axis_name, **common)
            units.append(Unit(f"layer{s + 1}/{i}", block, (f"layer{s + 1}", str(i))))
    units.append(Unit("head", Head(num_classes=model.num_classes, **common), (), ("fc",)))
    return tuple(units)


def apply_units(units, params, batch_stats, x, train: bool, run_unit=None):
    """``model.apply`` one unit at a time. ``run_unit(unit, params, batch_stats, x) -> (y, new_bs)``
    lets ZeRO-3 wrap each call (gather its params, remat); by default it is a plain apply."""
    run_unit = run_unit or (lambda u, p, bs, h: apply_unit(u, p, bs, h, train))
    for unit in units:
        x, new = run_unit(unit, unit.take(params), unit.take(batch_stats), x)
        if train:
            batch_stats = unit.put(batch_stats, new)
    return x, batch_stats


def apply_unit(unit, params, batch_stats, x, train: bool):
    variables = {"params": params, "batch_stats": batch_stats}
    if not train:
        return unit.module.apply(variables, x, train=False), batch_stats
    y, updated = unit.module.apply(variables, x, train=True, mutable=["batch_stats"])
    return y, updated.get("batch_stats", {})
