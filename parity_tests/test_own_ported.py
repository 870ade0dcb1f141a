"""A pair written the way real ports are (``parity_tests.own.ported_pairs``), taken as it comes:
tied weights, HF's ``Conv1D`` and square weights, outputs of every container type, keyword
inputs, a tensor that is a buffer on one side and a param on the other, a checkpoint's weights.
Each form's own test, then the pair run end to end (ddp with AdamW, zero3 from a checkpoint).
"""

import collections
import dataclasses
import functools

import numpy as np
import pytest

from parity_tests.own import ModelPair, PairError, PairRun, run_pair
from parity_tests.own.pair import factory

PORTED = "parity_tests.own.ported_pairs:ported_pair"
F64 = dict(strategy="ddp", devices=2, dtype="float64", steps=2, batch_per_device=4)


def ported():
    from parity_tests.own import ported_pairs

    return ported_pairs


def shapes_of(pair, rows=2):
    """The ported Flax model's variables, called by position (this module's tests of the rules
    depend on nothing else)."""
    import jax

    batch = pair.sample_batch(np.random.default_rng(0), rows)
    return jax.eval_shape(lambda: pair.flax_model.init(jax.random.key(0), batch["tokens"][:, :-1], batch["mask"]))


def refusal(pair) -> str:
    from parity_tests.own.correspondence import CorrespondenceError, derive

    with pytest.raises(CorrespondenceError) as e:
        derive(pair.torch_model, shapes_of(pair), pair.correspondence)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.fixture(scope="module")
def setup():
    """The ported pair set up as a run does (its Flax classes traced), in float64."""
    import jax

    from parity_tests.own.setup import prepare

    with jax.enable_x64(True):
        return prepare(factory(PORTED), PairRun(**F64))


def flax_forward(s, batch):
    import jax

    with jax.enable_x64(True):
        args, kwargs = s.pair.arguments("flax", batch)
        return np.asarray(s.flax_model.apply(s.corr.to_flax(s.state_dict), *args, **kwargs).logits)


def torch_forward(s, batch):
    import copy

    import torch

    model = copy.deepcopy(s.pair.torch_model).double()
    model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in s.state_dict.items()})
    tb = {k: torch.from_numpy(np.asarray(v)).long() if k == "tokens" else torch.from_numpy(np.asarray(v)).double()
          for k, v in batch.items()}
    args, kwargs = s.pair.arguments("torch", tb)
    return model(*args, **kwargs)[0].detach().numpy()


# ----------------------------------------------------------------------------- tied weights

def derived():
    from parity_tests.own.correspondence import derive

    pair = ported().ported_pair()
    return derive(pair.torch_model, shapes_of(pair))


def test_tied_weights_are_one_parameter_under_their_first_name():
    """torch's head *is* the embedding's tensor, Flax reads its embedding twice (``attend``): one
    parameter, ``tok.weight`` (as ``named_parameters()`` names it), compared once."""
    corr = derived()
    assert corr.tied == {"head.weight": "tok.weight"}
    assert "head.weight" not in corr.by_torch and corr.by_torch["tok.weight"].flax_name == "params/tok/embedding"


def test_the_ported_weights_give_the_same_forward(setup):
    """Set up as a run is (the Flax classes traced), the copied weights give torch's forward in
    float64: the tied head, the Conv1D layouts, the values that do not train. The tied tensor's
    second name holds its values in the state_dict the ranks load."""
    corr, sd = setup.corr, setup.state_dict
    assert corr.tied == {"head.weight": "tok.weight"} and sd["head.weight"].tobytes() == sd["tok.weight"].tobytes()
    assert [corr.by_torch[f"blocks.1.{n}.weight"].layout.name for n in ("up", "down", "mix")] == ["identity"] * 3
    batch = {k: v[:2] for k, v in setup.batches[0].items()}
    np.testing.assert_allclose(flax_forward(setup, batch), torch_forward(setup, batch), rtol=1e-12, atol=1e-12)


def test_a_tie_on_one_side_only_is_refused_saying_so():
    m = ported()
    pair = m.ported_pair()
    flax_untied = pair.replace(flax_model=pair.flax_model.clone(tie=False))
    assert ("head.weight is tied to tok.weight in torch (one tensor), but Flax has its own params/head/kernel "
            "(8, 24): tie them in Flax too, or untie torch's") in refusal(flax_untied)
    import torch

    pair.torch_model.head.weight = torch.nn.Parameter(pair.torch_model.tok.weight.detach().clone())
    assert ("torch head.weight (24, 8) has no Flax variable and is not tied in torch: if Flax ties it to "
            "params/tok/embedding (torch tok.weight, the same shape), tie them in torch too (head.weight = tok.weight); "
            "else give Flax its own") in refusal(pair)


# ----------------------------------------------------------------------------- 2-D weights

def test_conv1d_weights_map_to_dense_kernels_as_stored_the_square_one_too():
    """HF's Conv1D stores (in, out), as Flax's Dense: no transpose, for ``up`` (8, 16) by its shape and
    for the square ``mix`` (8, 8) as ``up`` and ``down`` say (here untraced; traced: as the classes say)."""
    corr = derived()
    assert [corr.by_torch[f"blocks.0.{n}.weight"].layout.name for n in ("up", "down", "mix")] == ["identity"] * 3
    assert corr.by_torch["blocks.1.mix.weight"].flax_name == "params/blocks_1/mix/kernel"


def _out_in_pair(square_only: bool):
    """torch Linear-like modules against a Flax module that stores its kernel (out, in), as HF's
    FlaxConv1D does; a custom RMSNorm's ``weight`` against Flax's ``scale``."""
    import flax.linen as fnn
    import jax.numpy as jnp
    import torch

    class Proj(torch.nn.Module):  # a class the rules do not know
        def __init__(self, n_in, n_out):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(n_out, n_in) / n_in ** 0.5)

        def forward(self, x):
            return x @ self.weight.T

    class Norm(torch.nn.Module):
        def __init__(self, n):
            super().__init__()
            self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(n))

        def forward(self, x):
            return self.weight * x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6)

    class TorchNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = Norm(4)
            self.sq = Proj(4, 4)
            self.wide = Proj(4, 4 if square_only else 6)

        def forward(self, x):
            return self.wide(self.sq(self.norm(x)))

    class OutIn(fnn.Module):  # HF's FlaxConv1D's layout
        features: int

        @fnn.compact
        def __call__(self, x):
            return x @ self.param("kernel", fnn.initializers.normal(), (self.features, x.shape[-1])).T

    class FlaxNet(fnn.Module):
        @fnn.compact
        def __call__(self, x):
            h = fnn.RMSNorm(epsilon=1e-6, dtype=jnp.float64, name="norm")(x)
            return OutIn(4 if square_only else 6, name="wide")(OutIn(4, name="sq")(h))

    return TorchNet(), FlaxNet()


def test_a_square_weight_follows_its_classes_and_unknown_classes_are_refused():
    """Classes the rules do not know, on both sides: the non-square weight's shapes say "as stored",
    the square one follows it, and the forward agrees with torch's; with no such weight, the square
    ones are refused with both candidates named (traced or not)."""
    import jax
    import torch

    from parity_tests.own.correspondence import CorrespondenceError, derive
    from parity_tests.own.setup import _flax_shapes

    torch.manual_seed(0)
    tmodel, fmodel = _out_in_pair(square_only=False)
    x = np.random.default_rng(0).standard_normal((3, 4))
    with jax.enable_x64(True):
        corr = derive(tmodel.double(), jax.eval_shape(lambda: fmodel.init(jax.random.key(0), x)))
        assert {link.torch: (link.flax_name, link.layout.name) for link in corr.links} == {
            "norm.weight": ("params/norm/scale", "identity"),  # a custom norm's weight: Flax's scale, by name
            "sq.weight": ("params/sq/kernel", "identity"),  # square: as wide, its classes' other weight
            "wide.weight": ("params/wide/kernel", "identity")}  # (6, 4) against (6, 4): as stored
        got = fmodel.apply(corr.to_flax({k: v.detach().numpy() for k, v in tmodel.state_dict().items()}), x)
    np.testing.assert_allclose(np.asarray(got), tmodel(torch.from_numpy(x)).detach().numpy(), rtol=1e-12)
    tmodel, fmodel = _out_in_pair(square_only=True)
    pair = ModelPair(flax_model=fmodel, torch_model=tmodel, sample_batch=None, flax_loss=None, torch_loss=None)
    with jax.enable_x64(True):
        shapes, classes = _flax_shapes(pair, fmodel, x)
    for traced, flax_class in ((None, "an unknown Flax module"), (classes, "OutIn")):
        with pytest.raises(CorrespondenceError) as e:
            derive(tmodel, shapes, None, traced)
        assert (f"sq.weight (4, 4) is square, so its shape cannot tell its layout, and neither can its classes (Proj -> "
                f"{flax_class}: no known layout, no other weight of theirs in this model): map it as "
                "('params/sq/kernel', 'linear') (transposed) or ('params/sq/kernel', 'identity')") in str(e.value)
        assert "wide.weight (4, 4) is square" in str(e.value)


# ----------------------------------------------------------------------------- outputs

TupleOut = collections.namedtuple("TupleOut", ["logits", "extra"])


@dataclasses.dataclass
class DataOut:
    logits: object
    extra: object


class DictOut(collections.OrderedDict):  # as HF's ModelOutput: items, and attributes
    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _wrap(kind, logits, extra):
    if kind == "namedtuple":
        return TupleOut(logits, extra)
    if kind == "dataclass":
        return DataOut(logits, extra)
    return DictOut(logits=logits, extra=[extra, (extra,)])


READ = {"namedtuple": lambda o: o[0], "dataclass": lambda o: o.logits, "dict": lambda o: o["logits"] + 0 * o.logits}


@pytest.mark.parametrize("kind", ["namedtuple", "dataclass", "dict"])
def test_outputs_keep_their_type_on_both_sides_under_bfloat16(kind):
    """The model's bf16 outputs reach the loss in float32, in the very container the model returned."""
    import flax.linen as fnn
    import jax
    import jax.numpy as jnp
    import torch

    from parity_tests.own.jax_pair import apply_fn
    from parity_tests.own.torch_rank import PairTask

    seen = []

    def loss(outputs, batch):
        seen.append((type(outputs), READ[kind](outputs).dtype))
        return READ[kind](outputs).sum()

    class TorchNet(torch.nn.Module):
        def forward(self, x):
            return _wrap(kind, x.to(torch.bfloat16) * 2, x.to(torch.bfloat16))

    class FlaxNet(fnn.Module):
        dtype: object = jnp.float32

        @fnn.compact
        def __call__(self, x):
            return _wrap(kind, x.astype(self.dtype) * 2, x.astype(self.dtype))

    pair = ModelPair(flax_model=FlaxNet(), torch_model=TorchNet(), sample_batch=None, flax_loss=loss, torch_loss=loss,
                     flax_inputs=lambda b: (b["x"],))
    PairTask(pair, [], "bfloat16").loss(pair.torch_model, {"x": torch.ones(2, 3)})
    jax.eval_shape(apply_fn(pair, FlaxNet(jnp.bfloat16), "bfloat16"), {"params": {}}, {"x": jnp.ones((2, 3))})
    want = {"namedtuple": TupleOut, "dataclass": DataOut, "dict": DictOut}[kind]
    assert [(t, str(d)) for t, d in seen] == [(want, "torch.float32"), (want, "float32")]


# ----------------------------------------------------------------------------- keyword inputs

def test_inputs_may_be_positional_keyword_or_both():
    pair = ported().ported_pair()
    batch = pair.sample_batch(np.random.default_rng(0), 2)
    args, kwargs = pair.arguments("flax", batch)
    assert len(args) == 1 and args[0].shape == (2, 6) and list(kwargs) == ["mask"]
    as_dict = pair.replace(flax_inputs=lambda b: {"tokens": b["tokens"][:, :-1], "mask": b["mask"]},
                           flax_kwargs={"deterministic": True})
    assert as_dict.arguments("flax", batch)[0] == () and list(as_dict.arguments("flax", batch)[1]) == [
        "deterministic", "tokens", "mask"]
    assert list(as_dict.arguments("torch", batch)[1]) == ["tokens", "mask"]  # flax_kwargs are Flax's alone
    with pytest.raises(PairError, match="^torch_inputs returned ndarray: it returns the model's arguments as a tuple, "
                                        "a dict of keyword arguments, or \\(args tuple, kwargs dict\\)$"):
        pair.replace(torch_inputs=lambda b: b["tokens"]).arguments("torch", batch)


def test_a_model_that_does_not_take_its_inputs_is_refused_in_one_line():
    from parity_tests.own.setup import prepare

    with pytest.raises(PairError) as e:
        prepare(factory(functools.partial(_without_mask, ported().ported_pair)), PairRun(**F64))
    assert str(e.value).startswith("the Flax model's init on flax_inputs(batch) failed: TypeError: ")
    assert "mask" in str(e.value) and "\n" not in str(e.value)


def _without_mask(make):
    return make().replace(flax_inputs=lambda b: (b["tokens"][:, :-1],))


# ----------------------------------------------------------------------------- kinds that differ

def test_a_buffer_that_is_a_flax_param_and_a_frozen_parameter_are_values():
    """torch's ``temperature`` buffer is a Flax param (under stop_gradient), its ``pos`` parameter with
    requires_grad=False is Flax ``constants`` state: neither trains, both are compared as values."""
    corr = derived()
    t, pos = corr.by_torch["temperature"], corr.by_torch["pos"]
    assert (t.flax_name, t.buffer, t.trains, t.non_trainable_param) == ("params/temperature", True, False, True)
    assert (pos.flax_name, pos.frozen, pos.trains, pos.non_trainable_param) == ("constants/pos", True, False, False)
    assert corr.non_trainable_params == [("params", "temperature")] and corr.torch_frozen == ["pos"]


def test_a_parameter_that_trains_against_flax_state_is_refused_naming_both_kinds():
    pair = ported().ported_pair()
    pair.torch_model.pos.requires_grad_(True)
    assert ("pos is a torch parameter that trains, and constants/pos is Flax 'constants' state, which does not: make "
            "it a buffer or requires_grad=False in torch, or a param in Flax") in refusal(pair)


# ----------------------------------------------------------------------------- a checkpoint's weights

def test_a_checkpoints_weights_are_kept_exactly_whatever_the_seed():
    import jax
    import torch

    from parity_tests.own.setup import prepare

    m = ported()
    for name, dtype in (("loaded_pair", "float32"), ("bf16_checkpoint_pair", "bfloat16")):
        want = m.checkpoint(m.ported_pair().torch_model, dtype=dtype)
        for seed in (0, 1):
            with jax.enable_x64(True):
                s = prepare(factory(f"parity_tests.own.ported_pairs:{name}"), PairRun(**{**F64, "seed": seed}))
            for key, stored in (("tok.weight", "tok.weight"), ("head.weight", "tok.weight"),  # tied: stored once
                                ("blocks.1.mix.bias", "blocks.1.mix.bias"), ("pos", "pos")):
                np.testing.assert_array_equal(s.state_dict[key], want[stored].to(torch.float64).numpy(), err_msg=name)
    with pytest.raises(PairError) as e:
        prepare(factory("parity_tests.own.ported_pairs:partly_loaded_pair"), PairRun(**F64))
    assert str(e.value) == ("init_from='loaded', but blocks.1.mix.bias differs between two builds of the pair under "
                            "two seeds: drawn by the model's init, not loaded (a tensor the checkpoint lacks?)")


def test_two_partials_of_one_factory_have_budgets_of_their_own():
    """Their label is one ("module:function(...)"); their float32/bf16 budgets must not be."""
    from parity_tests.own.budget import budget_key

    m, run = ported(), PairRun(**F64)
    assert factory(m.loaded_pair).label == factory(m.partly_loaded_pair).label
    assert budget_key(factory(m.loaded_pair), run) != budget_key(factory(m.partly_loaded_pair), run)
    assert budget_key(factory(m.loaded_pair), run) == budget_key(factory(m.loaded_pair), run)


def test_a_channels_last_output_of_a_cube_shape_is_compared_as_channels_first():
    """NHWC against NCHW where C = H = W: the shape cannot tell, so both layouts are tried (localize)."""
    from parity_tests.compare import errors
    from parity_tests.own.localize import _comparable

    nchw = np.random.default_rng(0).standard_normal((2, 4, 4, 4))
    layouts = _comparable(np.moveaxis(nchw, 1, -1), nchw)
    assert len(layouts) == 2 and errors(layouts[0], nchw)[1] > 0.1 and errors(layouts[1], nchw)[1] == 0


# ----------------------------------------------------------------------------- end to end

@pytest.mark.slow
@pytest.mark.parametrize("pair,options", [
    ("ported_pair", dict(strategy="ddp", optimizer="adamw", lr=0.01, weight_decay=0.1)),
    ("loaded_pair", dict(strategy="zero3")),
])
def test_the_ported_pair_passes_as_it_comes(pair, options):
    """Every rank takes the keyword inputs; the tied tensor is compared once; the values that do
    not train are compared at every step as buffers, with no gradient or optimizer state (AdamW's
    weight decay would move them if either side trained them)."""
    result = run_pair(f"parity_tests.own.ported_pairs:{pair}", PairRun(**{**F64, **options}))
    assert result.passed, result.message()
    assert max(s.max_rel() for s in result.comparison.steps) < 1e-13  # measured: 2.4e-15
    for step in result.comparison.steps:
        keys = {e.key for e in step.entries}
        assert {"buffers/temperature", "buffers/pos", "grads/tok.weight", "params/tok.weight"} <= keys
        assert not [k for k in keys if k.split("/")[-2 if "optimizer_state" in k else -1].split(".")[0] in (
            "head", "temperature", "pos") and not k.startswith("buffers/")], keys
