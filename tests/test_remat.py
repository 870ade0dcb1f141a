"""ZeRO-3's ``remat`` option: ``"unit"`` recomputes each FSDP unit in backward, ``"none"``
(FSDP2's default) keeps the unit's activations and only gathers its params again.

Both must train exactly as DDP does (float64); ``"none"`` must compile to what it claims:
no recomputed convolution (DDP's count) and every unit's conv kernels gathered twice (forward,
backward), read from the compiled HLO, never the jaxpr (XLA's passes can undo a remat,
docs/design-notes.md, "ZeRO-3: remat and the passes that undo it"). Its temp memory, between DDP's and ``"unit"``'s, is a property of
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
from jaxdp.strategies import StrategyError, facts, units
from jaxdp.strategies.options import checked
from jaxdp.strategies.sync.buckets import leaf_path

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
    # The parsed config, typed (jaxdp train's): checked by the same function the strategy's class calls.
    with pytest.raises(StrategyError, match="--remat does not apply to strategy 'ddp'"):
        checked(facts("ddp"), TrainConfig(strategy="ddp", remat="none"), {})
    assert checked(facts("hsdp"), TrainConfig(strategy="hsdp", remat="none"), {}).remat == "none"
    assert choices.REMATS == units.REMATS and TrainConfig().remat == units.REMATS[0]
    assert "remat" in TrainConfig.STRATEGY_OPTIONS


def test_typed_options_and_keywords_build_the_same_strategy():
    """The config tree's typed options (``StrategySpec(config=...)``, as ``jaxdp train`` passes its
    parsed config) and the keyword form (``jaxdp.HSDP(remat=..., mesh_shape=...)``) meet in one check."""
    import optax

    import jaxdp
    from jaxdp.config.step import StrategyOptions
    from jaxdp.loss.task import classifier
    from jaxdp.runtime.mesh import make_mesh

    model = small_resnet()
    typed = StrategyOptions(strategy="hsdp", remat="none", mesh_shape=(2, 2))
    built = [jaxdp.Trainer(model, classifier(model), optax.sgd(0.1), spec, make_mesh(4)).strategy for spec in (
        jaxdp.StrategySpec("hsdp", {"units": UNITS}, config=typed),
        jaxdp.HSDP(units=UNITS, remat="none", mesh_shape=(2, 2)))]
    assert built[0].options is typed and built[1].options == typed
    for s in built:
        assert (dict(s.mesh.shape), s.units.classes, s.run_unit.keywords) == ({"replica": 2, "data": 2}, UNITS,
                                                                             {"remat": "none"})
    with pytest.raises(StrategyError, match="--remat does not apply to strategy 'ddp'"):
        jaxdp.Trainer(model, classifier(model), optax.sgd(0.1),
                      jaxdp.StrategySpec("ddp", config=StrategyOptions(remat="none")), make_mesh(2))


class Marked(str):
    """A remat value the profile hook below can tell apart from any other "none" (by identity)."""


def test_remat_reaches_fsdp_unit_in_three_calls_from_the_parsed_config(tmp_path):
    """``--remat``, followed call by call from the parsed config (``jaxdp train``'s ``TrainConfig``,
    which ``jaxdp.run.setup.build`` holds) to the code that applies it, ``units.fsdp_unit``.

    A profile hook records every jaxdp function that is handed the config or its remat value (as an
    argument, or in a dataclass or dict argument), while ``build`` builds the run and the step is
    traced. Outside the config's own package and the run that holds it, the way is three calls:
    ``Trainer.__init__`` -> ``ZeRO.__init__`` (which binds remat to ``fsdp_unit``) -> ``fsdp_unit``;
    beside it only the one check of the options (``jaxdp.strategies.options``: once early, in
    ``build``, and once in ``Strategy.__init__``, ZeRO's constructor's own base). A filter by signature, a dict of options, a
    second validation or a helper between the Trainer and the class would each show here."""
    import sys

    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxdp.cli.command import build_parser, config_from_args
    from jaxdp.run.setup import build
    from jaxdp.strategies import conversions

    argv = ["train", "--strategy", "zero3", "--remat", "none", "--width", "4", "--blocks", "1,1,1,1", "--devices", "2",
            "--global-batch-size", "4", "--synthetic-size", "16,4", "--out", str(tmp_path)]
    cfg = config_from_args(build_parser("train").parse_args(argv))  # jaxdp train's parsed config
    cfg.remat = marker = Marked(cfg.remat)
    assert cfg.remat == "none"

    def carries(value) -> bool:
        """``value`` is the config or its remat value, or holds one (a dict's value, a dataclass's field)."""
        if isinstance(value, dict):
            inside = list(value.values())
        elif hasattr(value, "__dataclass_fields__") and not isinstance(value, type):
            inside = [getattr(value, f, None) for f in value.__dataclass_fields__]
        else:
            inside = []
        return any(v is cfg or v is marker for v in [value, *inside])

    received = []

    def hook(frame, event, arg):
        code = frame.f_code
        if event != "call" or code.co_filename == "<string>":  # a dataclass's generated __init__
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("jaxdp.") or module.startswith(("jaxdp.config", "jaxdp.run", "jaxdp.cli")):
            return
        n = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 4) + bool(code.co_flags & 8)
        args = [frame.f_locals.get(name) for name in code.co_varnames[:n]]  # with *args and **kwargs
        args = [v for a in args for v in (a if isinstance(a, tuple) else [a])]
        if any(carries(a) for a in args):  # the one check of the options counts as one place
            name = module if module == "jaxdp.strategies.options" else f"{module}.{code.co_qualname}"
            if not received or received[-1] != name:
                received.append(name)

    sys.setprofile(hook)
    try:
        setup = build(cfg)
        strategy = setup.trainer.strategy
        split = NamedSharding(strategy.mesh, P(strategy.batch_axes))
        batch = {"image": jax.ShapeDtypeStruct((4, 32, 32, 3), np.float32, sharding=split),
                 "label": jax.ShapeDtypeStruct((4,), np.int32, sharding=split)}
        strategy.engine.lower_step(conversions.abstract_state(strategy, batch), batch)  # traces every unit
    finally:
        sys.setprofile(None)
    assert strategy.options is cfg  # the strategy keeps the parsed config itself: nothing copied or renamed
    beside = {"jaxdp.strategies.options", "jaxdp.strategies.base.Strategy.__init__"}
    assert received == ["jaxdp.strategies.options", "jaxdp.api.trainer.Trainer.__init__",
                        "jaxdp.strategies.zero.ZeRO.__init__", "jaxdp.strategies.base.Strategy.__init__",
                        "jaxdp.strategies.options", "jaxdp.strategies.units.fsdp_unit"], received
    way = [name for name in received if name not in beside]
    assert way == ["jaxdp.api.trainer.Trainer.__init__", "jaxdp.strategies.zero.ZeRO.__init__",
                   "jaxdp.strategies.units.fsdp_unit"]  # three calls


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
