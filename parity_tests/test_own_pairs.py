"""Parity for a pair of models of the user's own (``parity_tests.own``): the example's causal LM
(examples/parity_own_model.py) and a BatchNorm MLP (``own.toy_pairs``) against their torch
originals; the weight correspondence and its refusals; the injected porting mistakes, each
caught at step 0 and named; the command from a clone's root.

The broad matrix (every strategy with a twin, N = 1..3, float64/float32/bf16) is the slow script
``python -m parity_tests.own.matrix`` (its timed numbers: docs/parity.md, "Your own models").
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from parity_tests.config import ParityError
from parity_tests.own import ModelPair, PairError, PairRun, run_pair
from parity_tests.own.pair import factory

EXAMPLE = "examples.parity_own_model:make_pair"
BATCHNORM = "parity_tests.own.toy_pairs:batchnorm_pair"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(devices=2, steps=2, batch_per_device=4)  # float64 runs of a few seconds


def example():
    from examples import parity_own_model

    return parity_own_model


def shapes_of(pair, rows=2):
    import jax

    batch = pair.sample_batch(np.random.default_rng(0), rows)
    return jax.eval_shape(lambda: pair.flax_model.init(jax.random.key(0), *pair.inputs("flax")(batch),
                                                       **dict(pair.flax_kwargs)))


# ----------------------------------------------------------------------------- the correspondence

def test_the_rules_match_every_tensor_and_the_copy_round_trips_bit_for_bit():
    from parity_tests.own.correspondence import derive

    pair = example().make_pair()
    corr = derive(pair.torch_model, shapes_of(pair))
    layouts = {link.torch: (link.flax_name, link.layout.name) for link in corr.links}
    assert layouts["blocks.0.qkv.weight"] == ("params/blocks_0/qkv/kernel", "linear")
    assert layouts["blocks.1.ln2.weight"] == ("params/blocks_1/ln2/scale", "identity")
    assert layouts["tok.weight"] == ("params/tok/embedding", "identity")
    assert layouts["pos"] == ("params/pos", "identity")  # a module's own nn.Parameter keeps its name
    assert set(layouts) == set(pair.torch_model.state_dict())
    # torch -> Flax -> torch, and Flax -> torch -> Flax: the very same bits
    torch_sd = {k: v.detach().numpy() for k, v in pair.torch_model.state_dict().items()}
    flax = corr.to_flax(torch_sd)
    assert flax["params"]["blocks_0"]["qkv"]["kernel"].shape == (16, 48)
    np.testing.assert_array_equal(flax["params"]["blocks_0"]["qkv"]["kernel"], torch_sd["blocks.0.qkv.weight"].T)
    back = corr.to_torch(flax)
    assert all(back[k].tobytes() == v.tobytes() and back[k].shape == v.shape for k, v in torch_sd.items())
    again = corr.to_flax(back)
    from flax import traverse_util

    a, b = traverse_util.flatten_dict(flax), traverse_util.flatten_dict(again)
    assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


def test_one_init_for_both_from_either_side():
    """torch's init copied to Flax (the default), or Flax's ``init`` copied to torch (``init_from="flax"``):
    both sides start from the very same bits."""
    import jax

    from parity_tests.own.setup import prepare

    for name, init_from in (("batchnorm_pair", "torch"), ("flax_init_pair", "flax")):
        run = PairRun(strategy="ddp", dtype="float32", **SMALL)
        s = prepare(factory(f"parity_tests.own.toy_pairs:{name}"), run)
        assert s.pair.init_from == init_from
        if init_from == "flax":
            example = {k: v[:4] for k, v in s.batches[0].items()}
            want = s.flax_model.init(jax.random.key(run.seed), example["x"], train=True)
            want = {"params": jax.device_get(want["params"]), "batch_stats": jax.device_get(want["batch_stats"])}
        else:
            want = s.corr.to_flax({k: v.numpy() for k, v in s.pair.torch_model.state_dict().items()})
        got = s.corr.to_flax(s.state_dict)
        from flax import traverse_util

        a, b = traverse_util.flatten_dict(got), traverse_util.flatten_dict(want)
        assert a.keys() == b.keys() and all(a[k].tobytes() == np.asarray(b[k]).tobytes() for k in a), name
        assert s.corr.to_torch(s.variables).keys() == s.state_dict.keys() - {"bn.num_batches_tracked"}


def test_conv_and_batchnorm_rules_give_the_same_forward():
    """Conv2d OIHW <-> HWIO, BatchNorm's scale/bias and running stats (batch_stats), Linear: one
    forward in float64 on each side from the copied weights agrees to rounding."""
    import flax.linen as fnn
    import jax
    import torch

    from jaxdp.models.batchnorm import BatchNorm
    from parity_tests.own.correspondence import derive

    class TorchNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
            self.bn = torch.nn.BatchNorm2d(4)
            self.fc = torch.nn.Linear(4 * 5 * 5, 2)

        def forward(self, x):  # NCHW
            h = self.bn(self.conv(x))
            return self.fc(h.permute(0, 2, 3, 1).flatten(1))  # flattened in NHWC order, as Flax's

    class FlaxNet(fnn.Module):
        @fnn.compact
        def __call__(self, x):  # NHWC
            h = BatchNorm(dtype=jax.numpy.float64, param_dtype=jax.numpy.float64, name="bn")(fnn.Conv(4, (3, 3), padding=1, name="conv")(x), True)
            return fnn.Dense(2, name="fc")(h.reshape(h.shape[0], -1))

    torch.manual_seed(0)
    tmodel = TorchNet().double()
    with torch.no_grad():
        tmodel.bn.running_mean.uniform_()  # a buffer worth copying
    x = np.random.default_rng(0).standard_normal((2, 5, 5, 3))
    with jax.enable_x64(True):
        shapes = jax.eval_shape(lambda: FlaxNet().init(jax.random.key(0), x))
        corr = derive(tmodel, shapes)
        assert {link.torch: link.flax_name for link in corr.links if link.buffer} == {
            "bn.running_mean": "batch_stats/bn/mean", "bn.running_var": "batch_stats/bn/var"}
        assert corr.ignored == [] and "bn.num_batches_tracked" not in corr.by_torch
        variables = corr.to_flax({k: v.detach().numpy() for k, v in tmodel.state_dict().items()})
        out, state = FlaxNet().apply(variables, x, mutable=["batch_stats"])
    want = tmodel.train()(torch.from_numpy(x).permute(0, 3, 1, 2))
    np.testing.assert_allclose(np.asarray(out), want.detach().numpy(), rtol=1e-12, atol=1e-12)
    new = corr.state_to_torch(state)
    np.testing.assert_allclose(new["bn.running_var"], tmodel.bn.running_var.numpy(), rtol=1e-12)


def _lm_pair(**changes):
    pair = example().make_pair()
    return pair.replace(**changes)


def _refusal(pair) -> str:
    from parity_tests.own.correspondence import CorrespondenceError, derive

    with pytest.raises(CorrespondenceError) as e:
        derive(pair.torch_model, shapes_of(pair), pair.correspondence)
    message = str(e.value)
    assert "\n" not in message  # one message
    return message


def test_a_correspondence_that_does_not_cover_both_models_is_refused_in_one_message():
    import jax

    from parity_tests.own.correspondence import CorrespondenceError, derive

    m = example()
    pair = m.make_pair()
    # A port that left out one bias (use_bias=False) and added a variable of its own.
    shapes = jax.tree_util.tree_map(lambda x: x, shapes_of(pair))
    del shapes["params"]["blocks_0"]["proj"]["bias"]
    shapes["params"]["blocks_1"]["scale"] = jax.ShapeDtypeStruct((3,), np.float32)
    with pytest.raises(CorrespondenceError) as e:
        derive(pair.torch_model, shapes)
    assert str(e.value) == (
        "the weight correspondence does not cover both models: torch only: blocks.0.proj.bias (16,); flax only: "
        "params/blocks_1/scale (3,) (map them with ModelPair(correspondence={torch name: 'collection/flax/path' | "
        "(path, layout) | None}))")
    # A vocabulary off by one: the shapes disagree, named with both layouts.
    message = _refusal(_lm_pair(flax_model=m.FlaxLM(vocab=33)))
    assert ("shapes disagree: tok.weight (32, 16) is params/tok/embedding (32, 16) in Flax's layout (identity), "
            "Flax has (33, 16)") in message
    assert "head.weight (32, 16) is params/head/kernel (16, 32) in Flax's layout (linear), Flax has (16, 33)" in message
    # A parameter mapped to nothing, and a path the Flax model lacks.
    message = _refusal(_lm_pair(correspondence={"pos": None, "head.bias": "params/head/b"}))
    assert "pos is a parameter: only a buffer may have no Flax counterpart (None)" in message
    assert "head.bias is mapped to params/head/b, which the Flax model does not have" in message
    assert "flax only: params/head/bias (32,), params/pos (8, 16)" in message


def test_overrides_map_what_the_rules_cannot():
    """A dict or a function names the Flax variable of a torch tensor the rules cannot place (a renamed
    module here); a path alone takes the layout the rules give its kind (a Linear's: transposed)."""
    from parity_tests.own.correspondence import LAYOUTS, Layout, derive

    pair = example().make_pair()
    renamed = {k.replace("head.", "unembed."): v for k, v in pair.torch_model.state_dict().items()}
    pair.torch_model.unembed = pair.torch_model.head
    del pair.torch_model.head
    assert set(pair.torch_model.state_dict()) == set(renamed)
    shapes = shapes_of(pair)
    by_dict = derive(pair.torch_model, shapes, {"unembed.weight": "params/head/kernel",
                                                "unembed.bias": ("params/head/bias", "identity")})
    by_function = derive(pair.torch_model, shapes,
                         lambda name, shape: "params/head/" + {"weight": "kernel", "bias": "bias"}[name.split(".")[1]]
                         if name.startswith("unembed.") else None)
    for corr in (by_dict, by_function):
        assert corr.by_torch["unembed.weight"].layout is LAYOUTS["linear"]
        assert corr.by_torch["unembed.bias"].flax_name == "params/head/bias"
    # a layout of the user's own must round-trip
    from jaxdp.interop import CorrespondenceError

    lossy = Layout("lossy", lambda w: np.round(w.T, 1), lambda k: k.T)
    corr = derive(pair.torch_model, shapes, {"unembed.weight": ("params/head/kernel", lossy),
                                             "unembed.bias": "params/head/bias"})
    sd = {k: v.detach().numpy() for k, v in pair.torch_model.state_dict().items()}
    with pytest.raises(CorrespondenceError, match="layout 'lossy' of unembed.weight -> params/head/kernel does not "
                                                  "round-trip"):
        corr.check_round_trip(sd)


# ----------------------------------------------------------------------------- refusals, before anything runs

@pytest.fixture
def no_ranks(monkeypatch):
    """Refusals come before any torch rank starts."""
    from torch_ref import launcher

    def refuse(*args, **kwargs):
        raise AssertionError("a torch rank was started")
    monkeypatch.setattr(launcher, "run_ranks", refuse)


def _one_line(pair, **run) -> str:
    with pytest.raises(ParityError) as e:
        run_pair(pair, PairRun(**{**SMALL, **run}))
    assert "\n" not in str(e.value)
    return str(e.value)


def units_cut_differently():
    from examples import parity_own_model as m

    return m.make_pair().replace(torch_units=("blocks.0",))


def test_dropout_units_and_factories_are_refused_in_one_line(no_ranks):
    assert _one_line("parity_tests.own.toy_pairs:dropout_pair").startswith(
        'the Flax model draws random numbers in training (Dropout_0 needs PRNG for "dropout"): dropout cannot match')
    assert _one_line("parity_tests.own.toy_pairs:torch_dropout_pair").startswith(
        "the torch model has active dropout (drop (p=0.1)): dropout cannot match across two random number generators")
    assert _one_line(units_cut_differently, strategy="zero3").startswith(
        "the FSDP units cut the two models differently: torch keeps blocks.1.ln1.weight in the root")
    assert "lambda or a local function" in _one_line(lambda: example().make_pair())
    assert "not the pair: the torch ranks are separate processes" in _one_line(example().make_pair())
    assert "cannot import 'no_such_module'" in _one_line("no_such_module:make_pair")
    assert _one_line("os:system").startswith("os:system takes arguments (command): a pair factory is called with none")
    assert "--width does not apply to --pair" in _one_line(EXAMPLE, width=8)
    with pytest.raises(ParityError, match="bug skipped_grad_sync cannot show in this run: it needs --devices >= 2"):
        run_pair(EXAMPLE, PairRun(devices=1), bug="skipped_grad_sync")
    with pytest.raises(ParityError, match="unknown bug 'nope' for a pair; choose one of layernorm_eps, missing_bias"):
        run_pair(EXAMPLE, PairRun(**SMALL), bug="nope")


def test_a_factory_reaches_the_ranks_by_name_or_by_reference():
    import functools

    from examples import parity_own_model as m
    from parity_tests.own import toy_pairs

    assert factory(EXAMPLE).label == EXAMPLE
    assert factory(m.make_pair).label == "examples.parity_own_model:make_pair"
    assert factory(functools.partial(toy_pairs.mlp_pair, init_from="flax")).label.endswith("mlp_pair(...)")
    assert isinstance(factory(EXAMPLE).build(), ModelPair)
    with pytest.raises(PairError, match="takes package.module:function"):
        factory("examples.parity_own_model")


# ----------------------------------------------------------------------------- runs

def _check(result, dtype):
    assert result.passed, result.message()
    cats = {e.category for s in result.comparison.steps for e in s.entries}
    assert {"loss", "loss_per_rank", "grads", "params", "optimizer_state"} <= cats
    if dtype == "float64":
        assert result.comparison.bounds.name == "float64"
        # measured: <= 1.4e-15, but the BN MLP's fc1.bias (rounding noise against its floor): 1.1e-12
        assert max(s.max_rel() for s in result.comparison.steps) < 1e-11
    else:  # MARGIN x both sides' errors against their own float64 runs, measured at N = 1
        bounds, budget = result.comparison.bounds, result.budget
        assert bounds.name == f"{dtype}, the pair's measured budget" and budget["devices"] == 1
        assert budget["float64_max_rel"] < 1e-11  # the budget's own float64 runs agree
        assert budget["jax"][0]["grads"] > 1e-4 and budget["torch"][0]["grads"] > 1e-4  # bf16 rounding, measured
        for s in result.comparison.steps:
            assert bounds.bound("grads", s.step) == pytest.approx(
                4 * (budget["jax"][s.step]["grads"] + budget["torch"][s.step]["grads"]))


def test_the_budget_bounds_each_step_and_the_loss_by_its_largest_step():
    from parity_tests.own.budget import bounds

    budget = {"dtype": "float32", "strategy": "ddp", "rows": 4,
              "jax": [{"loss": 1e-7, "grads": 1e-6}, {"loss": 3e-7, "grads": 2e-6}],
              "torch": [{"loss": 2e-7, "grads": 1e-6}, {"loss": 0.0, "grads": 0.0}]}
    b = bounds(budget)
    assert [b.bound("grads", s) for s in (0, 1)] == pytest.approx([8e-6, 8e-6])
    # the loss is one number per step: every step gets the largest step's (3e-7, step 0's 1e-7 + 2e-7)
    assert [b.bound("loss", s) for s in (0, 1)] == pytest.approx([1.2e-6, 1.2e-6])
    assert b.bound("loss_per_rank", 1) == b.bound("loss", 1)
    budget["jax"][1]["grads"] = 0.0
    assert bounds(budget).bound("grads", 1) == 1e-10  # never below float64's
    assert b.bound("buffers", 0) == float("inf") and b.bound("grads", 2) == float("inf")


@pytest.mark.slow
@pytest.mark.parametrize("strategy,dtype", [("ddp", "float64"), ("zero3", "float64"), ("ddp", "bfloat16"),
                                            ("zero3", "bfloat16")])
def test_the_example_passes_under_ddp_and_zero3(strategy, dtype, tmp_path):
    result = run_pair(EXAMPLE, PairRun(strategy=strategy, dtype=dtype, **SMALL), out=str(tmp_path))
    _check(result, dtype)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] and report["pair"] == EXAMPLE and len(report["comparison"]["steps"]) == 2


@pytest.mark.slow
def test_a_batchnorm_pair_compares_its_running_stats():
    result = run_pair(BATCHNORM, PairRun(strategy="zero3", accum_steps=2, **SMALL))
    _check(result, "float64")
    assert {e.key for e in result.comparison.steps[-1].entries if e.category == "buffers"} == {
        "buffers/bn.running_mean", "buffers/bn.running_var"}
    # a bias before a BatchNorm has a gradient of rounding noise (zero in exact arithmetic): held
    # to a thousandth of the largest gradient's scale, not to its own (compare.scale_floors)
    bias = [e for e in result.comparison.steps[0].entries if e.key == "grads/fc1.bias"][0]
    assert bias.abs_err < 1e-14 and bias.rel_err < 1e-10  # measured 3.3e-16 and 1.0e-12


# (bug, the category named first, the module whose output differs first). Measured.
BUGS = [
    ("layernorm_eps", "loss", "blocks.0.ln1"),
    ("missing_bias", "loss", "blocks.0.qkv"),
    ("loss_wrong_axis", "loss", None),
    ("skipped_grad_sync", "grads", None),
]


@pytest.mark.slow
@pytest.mark.parametrize("bug,category,module", BUGS)
def test_a_bug_in_the_pair_is_caught_at_step_0_and_named(bug, category, module):
    result = run_pair(EXAMPLE, PairRun(strategy="ddp", **{**SMALL, "steps": 1}), bug=bug)
    assert_caught_at_step_0_and_named(result, category, module)


def assert_caught_at_step_0_and_named(result, category, module):
    """The run failed at step 0 in ``category``, with the bug seen (not missed), and names where: the
    module whose output differs first (``None``: every module agrees, so the loss itself differs), or
    for gradients the first differing one, with no module finding."""
    d = result.divergence
    assert not result.passed and not result.missed_bug and (d.step, d.category) == (0, category), result.message()
    assert d.rel_err > 1e-7, result.message()  # float64 noise is ~1e-15
    if category == "loss":
        assert result.finding.module == module, result.finding.message()
        if module is None:
            assert result.finding.compared >= 10  # every module compared, all agree: the losses differ
    else:  # rank 0's own gradient, not the average: the first parameter in torch's order with the largest error
        assert d.key.startswith("grads/") and result.finding is None


def test_the_command_from_a_clones_root(tmp_path):
    """``jaxdp parity --pair examples.parity_own_model:make_pair`` where only the installed packages are
    importable (a fresh clone after ``make install``: ``examples`` is found from the current directory),
    and an injected bug that the comparison names: exit 0, then exit 1."""
    site = tmp_path / "site"
    site.mkdir()
    for package in ("jaxdp", "torch_ref", "parity_tests", "torch_commands"):
        os.symlink(os.path.join(ROOT, package), site / package)
    env = dict(os.environ, PYTHONPATH=str(site))
    base = [sys.executable, "-P", "-m", "jaxdp.cli", "parity", "--pair", EXAMPLE, "--devices", "2",
            "--dtype", "float64", "--steps", "2", "--batch-per-device", "4"]
    ok = subprocess.run(base + ["--strategy", "zero3", "--out", str(tmp_path / "ok")], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    assert "PASS: parity OK: 2 steps" in ok.stdout
    assert json.loads((tmp_path / "ok" / "report.json").read_text())["passed"]
    bad = subprocess.run(base + ["--strategy", "ddp", "--inject-bug", "transposed_weight", "--out", str(tmp_path / "bad")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 1, bad.stdout[-3000:] + bad.stderr[-3000:]
    assert "FAIL: diverged at step 0: loss rel err" in bad.stdout
    assert "torch blocks.0.proj <-> flax blocks_0/proj" in bad.stdout  # the square Linear copied untransposed
