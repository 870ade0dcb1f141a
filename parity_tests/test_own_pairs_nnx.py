"""Parity for a pair whose Flax side is a Flax NNX model (``parity_tests.own.nnx_pair``): the
correspondence's rules read NNX's names (``nnx.Linear``, ``nnx.Conv``, ``nnx.LayerNorm``,
``nnx.RMSNorm``, ``nnx.BatchNorm``'s statistics, ``nnx.Embed``); the NNX form of the example's
causal LM (examples/parity_own_model_nnx.py) passes zero3 on 2 devices in float64 with its
``Block`` units; each of the pair API's injected porting mistakes is caught at step 0 and named;
and a model whose NNX dropout draws is refused in one line."""

import numpy as np
import pytest

from parity_tests.config import ParityError
from parity_tests.own import PairRun, run_pair
from parity_tests.own.pair import factory
from parity_tests.test_own_pairs import assert_caught_at_step_0_and_named

EXAMPLE = "examples.parity_own_model_nnx:make_pair"
SMALL = dict(devices=2, steps=2, batch_per_device=4)


def example():
    from examples import parity_own_model_nnx

    return parity_own_model_nnx


def test_the_rules_read_nnx_names_and_the_copy_round_trips_bit_for_bit():
    import jax
    import torch
    from flax import nnx

    from parity_tests.own import nnx_pair
    from parity_tests.own.correspondence import derive

    class TorchNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(5, 3)
            self.conv = torch.nn.Conv2d(3, 4, 3)
            self.bn = torch.nn.BatchNorm2d(4)
            self.rms = torch.nn.RMSNorm(4)
            self.layers = torch.nn.ModuleList([torch.nn.LayerNorm(4), torch.nn.Linear(4, 2)])

    class FlaxNet(nnx.Module):
        def __init__(self, rngs=nnx.Rngs(0)):
            self.embed = nnx.Embed(5, 3, rngs=rngs)
            self.conv = nnx.Conv(3, 4, (3, 3), rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)
            self.rms = nnx.RMSNorm(4, rngs=rngs)
            self.layers = nnx.List([nnx.LayerNorm(4, rngs=rngs), nnx.Linear(4, 2, rngs=rngs)])
            self.drop = nnx.Dropout(0.0, rngs=rngs)  # rng state: no weight, neither matched nor compared

    torch_net, flax_net = TorchNet(), FlaxNet()
    corr = derive(torch_net, jax.eval_shape(lambda: nnx_pair.variables(flax_net)))
    assert {link.torch: (link.flax_name, link.layout.name) for link in corr.links} == {
        "embed.weight": ("params/embed/embedding", "identity"),
        "conv.weight": ("params/conv/kernel", "conv"), "conv.bias": ("params/conv/bias", "identity"),
        "bn.weight": ("params/bn/scale", "identity"), "bn.bias": ("params/bn/bias", "identity"),
        "bn.running_mean": ("batch_stats/bn/mean", "identity"), "bn.running_var": ("batch_stats/bn/var", "identity"),
        "rms.weight": ("params/rms/scale", "identity"),
        "layers.0.weight": ("params/layers/0/scale", "identity"), "layers.0.bias": ("params/layers/0/bias", "identity"),
        "layers.1.weight": ("params/layers/1/kernel", "linear"), "layers.1.bias": ("params/layers/1/bias", "identity")}
    torch_sd = {k: v.detach().numpy() for k, v in torch_net.state_dict().items()}
    back = corr.to_torch(corr.to_flax(torch_sd))
    assert all(back[k].tobytes() == torch_sd[k].tobytes() for k in back)
    # the NNX module holds what the correspondence copies, and gives it back
    module = nnx_pair.with_weights(flax_net, corr.to_flax(torch_sd))
    np.testing.assert_array_equal(module.layers[1].kernel[...], torch_sd["layers.1.weight"].T)
    np.testing.assert_array_equal(module.conv.kernel[...], np.transpose(torch_sd["conv.weight"], (2, 3, 1, 0)))
    assert set(corr.to_torch(nnx_pair.variables(module))) == set(torch_sd) - {"bn.num_batches_tracked"}


def test_an_nnx_model_whose_dropout_draws_is_refused_in_one_line(monkeypatch):
    from torch_ref import launcher

    monkeypatch.setattr(launcher, "run_ranks", lambda *a, **k: pytest.fail("a torch rank was started"))
    with pytest.raises(ParityError) as e:
        run_pair("parity_tests.own.toy_pairs:nnx_dropout_pair", PairRun(**SMALL))
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("the Flax model draws random numbers in training (the nnx.Rngs streams at "
                                   "drop/rngs/count advance): dropout cannot match across two random number generators")


@pytest.mark.slow
def test_the_nnx_example_passes_zero3_in_float64_with_its_units():
    result = run_pair(EXAMPLE, PairRun(strategy="zero3", dtype="float64", **SMALL))
    assert result.passed, result.message()
    assert result.comparison.bounds.name == "float64"
    assert max(s.max_rel() for s in result.comparison.steps) < 1e-11  # measured 9.5e-16
    assert factory(EXAMPLE).build().flax_units == (example().Block,)


# (bug, the category named first, the module whose output differs first): as for the Linen example.
BUGS = [
    ("layernorm_eps", "loss", "blocks.0.ln1"),
    ("missing_bias", "loss", "blocks.0.qkv"),
    ("transposed_weight", "loss", "blocks.0.proj"),
    ("loss_wrong_axis", "loss", None),
    ("skipped_grad_sync", "grads", None),
]


@pytest.mark.slow
@pytest.mark.parametrize("bug,category,module", BUGS)
def test_a_bug_in_the_nnx_pair_is_caught_at_step_0_and_named(bug, category, module):
    result = run_pair(EXAMPLE, PairRun(strategy="ddp", **{**SMALL, "steps": 1}), bug=bug)
    assert_caught_at_step_0_and_named(result, category, module)
    if module is not None:  # and on the NNX side by its attribute path, '/'-joined
        assert result.finding.flax == module.replace(".", "/"), result.finding.message()
