"""ZeRO-3's ``remat`` option: ``"unit"`` recomputes each FSDP unit in backward, ``"none"``
(FSDP2's default) keeps the unit's activations and only gathers its params again.

Both must train exactly as DDP does (float64); ``"none"`` must compile to what it claims:
no recomputed convolution (DDP's count) and every unit's conv kernels gathered twice (forward,
backward), read from the compiled HLO, never the jaxpr (XLA's passes can undo a remat,
DESIGN.md section 9). Its temp memory, between DDP's and ``"unit"``'s, is a property of
XLA's optimising scheduler, which the suite's ``--xla_backend_optimization_level=0`` turns
off (there ``"none"`` measured below ``"unit"``): docs/zero3_remat.md has the numbers from
``jaxdp inspect``.
"""

import functools
import re
from collections import Counter

import jax
import jax.numpy as jnp
import pytest
from helpers import as_batch, init, random_batch
from test_zero import OPTIMIZERS, UNITS, assert_same_training, ddp, make, small_resnet, train

from jaxdp.config import choices
from jaxdp.config.tree import TrainConfig
from jaxdp.strategies import StrategyError, units
from jaxdp.strategies.sync.buckets import leaf_path
from jaxdp.run.setup import strategy_options

pytestmark = pytest.mark.float64


@pytest.mark.parametrize("name,opt,options", [("zero3", "sgd", {}), ("hsdp", "adam", {"mesh_shape": (2, 4)})],
                         ids=["zero3-sgd-syncbn-accum2", "hsdp2x4-adam"])
def test_keeping_activations_trains_as_ddp(name, opt, options):
    assert_same_training(train(name, opt, units=UNITS, remat="none", **options), ddp(opt))


def compiled_step(name, model, n=2, per_device=1, **options):
    s = make(name, model, OPTIMIZERS["sgd"](), n, **options)
    state = s.engine.init_state(init(model))
    return s.engine.lower_step(state, s.engine.shard_batch(as_batch(*random_batch(per_device * n)))).compile()


def op_results(hlo: str, op: str) -> Counter:
    """Result shapes (without layout) of every ``op`` in a compiled module."""
    return Counter(re.sub(r"\{.*", "", s) for s in re.findall(rf"= (\S+) {op}\(", hlo))


def test_remat_none_regathers_params_instead_of_recomputing():
    model = small_resnet()
    hlo = {remat: compiled_step("zero3", model, units=UNITS, remat=remat).as_text() for remat in units.REMATS}
    ddp_convs = sum(op_results(compiled_step("ddp", model).as_text(), "convolution").values())
    convs = {r: sum(op_results(h, "convolution").values()) for r, h in hlo.items()}
    assert convs["none"] == ddp_convs < convs["unit"], convs  # "unit" recomputes each unit's convolutions
    # Every conv kernel inside a unit is gathered in forward and again in backward.
    model_init = functools.partial(model.init, jax.random.key(0), jnp.zeros((1, 8, 8, 3), jnp.float64))
    params = jax.eval_shape(model_init)["params"]
    paths = units.unit_paths(units.Units(UNITS), model_init)
    kernels = Counter(f"f64[{','.join(map(str, s.shape))}]" for p, s in jax.tree_util.tree_leaves_with_path(params)
                      if s.ndim == 4 and units.in_unit(leaf_path(p), paths))
    gathers = op_results(hlo["none"], "all-gather")
    assert kernels and all(gathers[shape] >= 2 * count for shape, count in kernels.items()), (kernels, gathers)


def test_remat_is_zero3s_option_only():
    model = small_resnet()
    with pytest.raises(StrategyError, match="remat must be one of unit, none"):
        make("zero3", model, OPTIMIZERS["sgd"](), 2, remat="full")
    for name in ("zero1", "zero2", "ddp"):
        with pytest.raises(StrategyError, match="takes no option remat"):
            make(name, model, OPTIMIZERS["sgd"](), 2, remat="none")
    with pytest.raises(StrategyError, match="--remat does not apply to strategy 'ddp'"):
        strategy_options(TrainConfig(strategy="ddp", remat="none"))
    assert strategy_options(TrainConfig(strategy="hsdp", remat="none"))["remat"] == "none"
    assert choices.REMATS == units.REMATS and TrainConfig().remat == units.REMATS[0]
    assert "remat" in TrainConfig.STRATEGY_OPTIONS


def test_bench_rows_per_remat_and_bucket_cap():
    """``jaxdp bench --remat unit,none --bucket-cap-mb 1,inf``: one row per value for the
    strategies that take the option, one row with defaults for the others."""
    import argparse

    from torch_commands.bench.variants import ONE_BUCKET_MB, bucket_caps, label, remats, variants

    axes = {"remat": remats("unit,none"), "bucket_cap_mb": bucket_caps("1,inf")}
    assert variants("zero3", axes) == [{"remat": "unit"}, {"remat": "none"}]
    assert variants("ddp", axes) == [{"bucket_cap_mb": 1.0}, {"bucket_cap_mb": ONE_BUCKET_MB}]
    assert variants("dp", axes) == [{}] and variants("ddp", {}) == [{}]
    assert [label(o) for o in variants("ddp", axes)] == [" bucket=1MB", " bucket=inf"]
    for parse, bad in ((remats, "unit,full"), (bucket_caps, "5,0"), (bucket_caps, "big")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)
