"""The step's XLA compile options (jaxdp.compile_options): defaults per platform, overrides, and that they reach XLA."""

import numpy as np
import pytest

from jaxdp.analysis.measure import build_strategy
from jaxdp.compile_options import DEFAULTS, YNN_DOTS_AND_REDUCES, parse, resolve
from jaxdp.mesh import make_mesh
from jaxdp.models import create_model
from jaxdp.strategies import StrategyError


def test_the_cpu_default_leaves_convolutions_out_of_ynnpack_and_the_environment_overrides_it(monkeypatch):
    monkeypatch.delenv("JAXDP_COMPILER_OPTIONS", raising=False)  # conftest turns the default off
    assert resolve(None, "cpu") == YNN_DOTS_AND_REDUCES and resolve(None, "gpu") is None
    monkeypatch.setenv("JAXDP_COMPILER_OPTIONS", "none")
    assert resolve(None, "cpu") is None and resolve(YNN_DOTS_AND_REDUCES, "cpu") == YNN_DOTS_AND_REDUCES


def test_parse_and_resolve():
    text = "xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE"
    assert parse(text) == YNN_DOTS_AND_REDUCES and parse("a=1; b=2") == {"a": "1", "b": "2"}
    assert resolve("none", "cpu") is None and resolve({}, "cpu") is None
    assert resolve(None, "gpu") == (DEFAULTS["gpu"] or None) and resolve({"a": 1}, "gpu") == {"a": 1}
    assert not any(key.startswith("xla_cpu") for key in DEFAULTS["gpu"])  # never CPU options on a GPU


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
    state = strategy.abstract_state(host)
    with pytest.raises(Exception, match="xla_cpu_experimental_ynn_fusion_type"):
        strategy.lower_step(state, strategy.shard_batch(host)).compile()
