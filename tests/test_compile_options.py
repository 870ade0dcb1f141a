"""The step's XLA compile options (jaxdp.runtime.compile_options): defaults per platform, overrides, and that they reach XLA."""

import numpy as np
import pytest

from jaxdp.analysis.measure import build_strategy
from jaxdp.runtime.compile_options import DEFAULTS, YNN_DOTS_AND_REDUCES, parse, resolve
from jaxdp.runtime.mesh import make_mesh
from jaxdp.models import create_model
from jaxdp.strategies import StrategyError, conversions


def test_the_cpu_default_leaves_convolutions_out_of_ynnpack_and_the_environment_overrides_it(monkeypatch):
    monkeypatch.delenv("JAXDP_COMPILER_OPTIONS", raising=False)  # conftest turns the default off
    assert resolve(None, "cpu") == YNN_DOTS_AND_REDUCES and resolve(None, "gpu") is None
    monkeypatch.setenv("JAXDP_COMPILER_OPTIONS", "none")
    assert resolve(None, "cpu") is None and resolve(YNN_DOTS_AND_REDUCES, "cpu") == YNN_DOTS_AND_REDUCES


def test_parse_and_resolve(monkeypatch):
    monkeypatch.delenv("JAXDP_COMPILER_OPTIONS", raising=False)  # the platforms' defaults, not conftest's
    text = "xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE"
    assert parse(text) == YNN_DOTS_AND_REDUCES and parse("a=1; b=2") == {"a": "1", "b": "2"}
    assert resolve("none", "cpu") is None and resolve({}, "cpu") is None
    assert resolve(None, "gpu") == (DEFAULTS["gpu"] or None) and resolve({"a": 1}, "gpu") == {"a": 1}
    assert not any(key.startswith("xla_cpu") for key in DEFAULTS["gpu"])  # never CPU options on a GPU


def test_a_switch_typed_as_xla_flags_spell_it_reaches_xla_as_a_bool():
    """``xla_cpu_enable_fast_math=true`` (XLA_FLAGS' spelling): XLA refused the text "true" as a bool."""
    import jax
    import jax.numpy as jnp

    options = parse("xla_cpu_enable_fast_math=true xla_cpu_fast_math_honor_nans=False n=2")
    assert options == {"xla_cpu_enable_fast_math": True, "xla_cpu_fast_math_honor_nans": False, "n": "2"}
    del options["n"]
    assert jax.jit(lambda x: x * 2, compiler_options=options).lower(jnp.ones(3)).compile() is not None


def _strategy(options):
    net = create_model("resnet18", width=4, blocks=(1, 1, 1, 1))
    return build_strategy("ddp", make_mesh(2), net, "sgd", {"compiler_options": options})


def test_a_malformed_option_is_one_line():
    with pytest.raises(StrategyError, match="key=value pairs"):
        _strategy("xla_cpu_experimental_ynn_fusion_type")


def test_the_options_reach_xla():
    """An option XLA cannot take fails the step's compile, naming it: the options are passed."""
    strategy = _strategy({"xla_cpu_experimental_ynn_fusion_type": "NOT_A_FUSION_TYPE"})
    rng = np.random.default_rng(0)
    host = {"image": rng.normal(size=(4, 8, 8, 3)).astype(np.float32), "label": np.arange(4, dtype=np.int32)}
    state = conversions.abstract_state(strategy, host)
    with pytest.raises(Exception, match="xla_cpu_experimental_ynn_fusion_type"):
        strategy.engine.lower_step(state, strategy.engine.shard_batch(host)).compile()


@pytest.mark.float64
def test_training_with_the_cpu_default_options_matches_training_without_them(monkeypatch):
    """The suite compiles with the options off (conftest); this runs the default path that
    `jaxdp train` takes on CPU. YNNPACK's fused dots may round differently (about one ulp),
    never more: three ddp steps agree with the plain compile to 1e-12 in float64 (16x16 images:
    on 8x8 the last stage's BatchNorm normalises over 2 values per device and amplifies any
    rounding to 1e-10 within three steps, with or without the options)."""
    import jax

    monkeypatch.delenv("JAXDP_COMPILER_OPTIONS", raising=False)
    net = create_model("resnet18", width=4, blocks=(1, 1, 1, 1), dtype="float64")
    rng = np.random.default_rng(0)
    host = {"image": rng.normal(size=(8, 16, 16, 3)), "label": np.arange(8, dtype=np.int32)}
    runs = {}
    for options in (None, "none"):
        strategy = build_strategy("ddp", make_mesh(2), net, "sgd", {"compiler_options": options})
        state = strategy.engine.init(jax.random.key(0), host)
        losses = []
        for _ in range(3):
            state, metrics = strategy.engine.step(state, strategy.engine.shard_batch(host))
            losses.append(float(metrics["loss"]))
        runs[options] = losses, strategy.engine.canonical(state).params
    assert resolve(None, "cpu") == YNN_DOTS_AND_REDUCES  # the first run had them
    np.testing.assert_allclose(runs[None][0], runs["none"][0], rtol=1e-12)
    for a, b in zip(jax.tree_util.tree_leaves(runs[None][1]), jax.tree_util.tree_leaves(runs["none"][1])):
        a, b = np.asarray(a), np.asarray(b)
        assert np.linalg.norm(a - b) <= 1e-12 * np.linalg.norm(b), a.shape  # measured <= 1.7e-15
