"""torch <-> Flax weight conversion, and the two ResNets computing the same function.

The reference is torch_ref (torchvision layout). Float64 separates a semantic
bug from float noise, so the tight bounds are f64 (rel err <= 1e-12 on logits
and BN running stats, <= 1e-10 on gradients); float32 gets 1e-5 on logits.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import torch.nn.functional as F

import jaxdp.models
import torchvision_reference
from jaxdp.interop import (
    param_name_map,
    state_dict_from_variables,
    tree_from_torch_names,
    tree_to_torch_names,
    variables_from_state_dict,
)
from jaxdp.models import create_model
from torch_ref import models as torch_models
from torch_ref.models import resnet

TINY = dict(width=8, blocks=(1, 1, 1, 1))
# Each stem and each block type once (the stem and the blocks are independent code,
# and every config costs XLA compiles on a 2-core machine). At 32x32 the imagenet
# stem leaves 1x1 at layer4, so BN there normalises over the batch alone.
CONFIGS = [
    ("resnet18", "cifar", 16),
    ("resnet50", "imagenet", 32),
]


@pytest.fixture
def x64():
    # A context manager rather than jax.config.update, so float64 does not leak
    # into other test modules that run in the same process.
    with jax.enable_x64(True):
        yield


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def sd_numpy(model: torch.nn.Module) -> dict:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def torch_model(name, stem, *, seed=0, double=True, num_classes=10, **kw):
    """A torch_ref ResNet whose BN weights and running stats are random too, so a
    swapped scale/bias or mean/var cannot hide behind the 1/0 defaults."""
    torch.manual_seed(seed)
    model = resnet(name, num_classes=num_classes, stem=stem, **{**TINY, **kw})
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0.0, 0.1)
                m.running_mean.normal_(0.0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    return model.double() if double else model


def flax_twin(tmodel, name, stem, dtype, num_classes=10, **kw):
    """The jaxdp model and the torch model's weights converted to it."""
    fmodel = create_model(name, num_classes=num_classes, stem=stem, dtype=dtype, **{**TINY, **kw})
    return fmodel, variables_from_state_dict(sd_numpy(tmodel))


def images(batch, size, seed=1):
    return np.random.default_rng(seed).standard_normal((batch, 3, size, size))


def nhwc(x_nchw):
    return jnp.asarray(x_nchw.transpose(0, 2, 3, 1))


def assert_trees_equal(a, b):
    fa, fb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
    assert [p for p, _ in fa] == [p for p, _ in fb]
    for (path, x), (_, y) in zip(fa, fb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and np.array_equal(x, y), jax.tree_util.keystr(path)


# --- round trips ---------------------------------------------------------------


@pytest.mark.parametrize("name,stem,kw", [
    ("resnet18", "cifar", dict(width=64, blocks=(2, 2, 2, 2))),
    ("resnet50", "imagenet", TINY),
])
def test_torch_flax_torch_round_trip_is_exact(name, stem, kw):
    model = torch_model(name, stem, double=False, **kw)
    model.train()
    with torch.no_grad():
        model(torch.randn(2, 3, 16, 16))  # non-trivial running stats, num_batches_tracked = 1
    sd = sd_numpy(model)

    back = state_dict_from_variables(variables_from_state_dict(sd), num_batches_tracked=1)

    assert list(back) == list(sd)  # same keys, in torchvision's order
    for k in sd:
        assert back[k].dtype == sd[k].dtype and back[k].shape == sd[k].shape, k
        assert np.array_equal(back[k], sd[k]), k
    fresh = resnet(name, stem=stem, **kw)
    fresh.load_state_dict({k: torch.from_numpy(v) for k, v in back.items()}, strict=True)


def random_variables(fmodel, size=32, seed=0):
    """A variables tree with fmodel's exact structure, shapes and dtypes, filled with
    random numbers. eval_shape costs nothing, while a real init compiles dozens of
    threefry draws (10-30 s on this 2-core machine); real init values are checked in
    test_init_statistics_match_torchvision."""
    shapes = jax.eval_shape(functools.partial(fmodel.init, train=False),
                            jax.random.key(0), jnp.zeros((1, size, size, 3)))
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda s: rng.standard_normal(s.shape).astype(s.dtype), shapes)


@pytest.mark.parametrize("name,stem,kw", [
    ("resnet18", "cifar", dict(width=8, blocks=(2, 2, 2, 2))),
    ("resnet50", "imagenet", TINY),
])
def test_flax_torch_flax_round_trip_is_exact(name, stem, kw):
    variables = random_variables(create_model(name, stem=stem, **kw))

    sd = state_dict_from_variables(variables)
    # torch accepts every key and shape...
    resnet(name, stem=stem, **kw).load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()}, strict=True)
    # ...and the way back reproduces every bit.
    assert_trees_equal(variables_from_state_dict(sd), variables)


@pytest.mark.parametrize("name", tuple(torch_models.ARCHITECTURES))  # ViTs: tests/test_vit.py
def test_full_size_shapes_agree(name):
    """torchvision-size models (width 64, default depth, imagenet stem, 1000 classes):
    jaxdp's variables convert to exactly the keys, order and shapes torch expects.
    Shapes only, so no real init on either side: eval_shape, and torch's meta device
    (load_state_dict(assign=True) still checks every key and shape)."""
    fmodel = create_model(name, num_classes=1000, stem="imagenet")
    shapes = jax.eval_shape(functools.partial(fmodel.init, train=False),
                            jax.random.key(0), jnp.zeros((1, 64, 64, 3)))
    sd = state_dict_from_variables(jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), shapes))
    with torch.device("meta"):
        tmodel = resnet(name, num_classes=1000, stem="imagenet")
    assert list(sd) == list(tmodel.state_dict())
    tmodel.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()}, strict=True, assign=True)


def test_dtype_argument_casts():
    sd = sd_numpy(torch_model("resnet18", "cifar", double=False))
    variables = variables_from_state_dict(sd, dtype="float64")
    leaves = jax.tree_util.tree_leaves(variables)
    assert all(x.dtype == np.float64 for x in leaves)
    assert np.array_equal(variables["params"]["conv1"]["kernel"], sd["conv1.weight"].transpose(2, 3, 1, 0))


def test_accepts_tensors_and_never_aliases_them():
    model = torch_model("resnet18", "cifar")
    variables = variables_from_state_dict(model.state_dict())  # tensors, not numpy
    before = variables["params"]["bn1"]["scale"].copy()
    with torch.no_grad():
        model.bn1.weight.add_(1.0)  # what optimizer.step() does to the live storage
    assert np.array_equal(variables["params"]["bn1"]["scale"], before)


# --- same function ---------------------------------------------------------------


def running_stats_err(batch_stats, tmodel) -> float:
    """Largest error of Flax's running stats after one training forward against
    torch's (momentum 0.1, unbiased running var)."""
    want = variables_from_state_dict(sd_numpy(tmodel))["batch_stats"]
    return max(jax.tree_util.tree_leaves(jax.tree_util.tree_map(rel_err, batch_stats, want)))


def compare_with_torch(name, stem, size, dtype, batch=8, grads=True, **kw):
    """Eval forward, then one train-mode forward (and, with ``grads``, backward of
    cross-entropy) in torch and in Flax from the same weights. Returns the relative
    errors measured: logits (eval, train), BN running stats after the train
    forward, and the largest per-tensor gradient error."""
    double = dtype == "float64"
    tmodel = torch_model(name, stem, double=double, **kw)
    fmodel, variables = flax_twin(tmodel, name, stem, dtype, **kw)
    x = images(batch, size).astype(np.float64 if double else np.float32)
    y = np.random.default_rng(2).integers(0, 10, batch)
    errs = {}

    tmodel.eval()
    with torch.no_grad():
        want = tmodel(torch.from_numpy(x)).numpy()
    got = jax.jit(functools.partial(fmodel.apply, train=False))(variables, nhwc(x))
    assert got.dtype == want.dtype
    errs["eval"] = rel_err(got, want)

    tmodel.train()
    logits = tmodel(torch.from_numpy(x))
    if not grads:
        got, updates = jax.jit(functools.partial(fmodel.apply, train=True, mutable=["batch_stats"]))(
            variables, nhwc(x))
        errs["train"] = rel_err(got, logits.detach().numpy())
        errs["running_stats"] = running_stats_err(updates["batch_stats"], tmodel)
        return errs
    F.cross_entropy(logits, torch.from_numpy(y)).backward()

    def loss(params):
        out, updates = fmodel.apply({"params": params, "batch_stats": variables["batch_stats"]},
                                    nhwc(x), train=True, mutable=["batch_stats"])
        ce = optax.softmax_cross_entropy_with_integer_labels(out, jnp.asarray(y)).mean()
        return ce, (out, updates["batch_stats"])

    (_, (got, stats)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(variables["params"])
    errs["train"] = rel_err(got, logits.detach().numpy())
    errs["running_stats"] = running_stats_err(stats, tmodel)

    # Gradients by torch name, in torch layout; torch's .grad is the reference.
    got_grads = tree_to_torch_names(grads)
    want_grads = {n: p.grad.numpy() for n, p in tmodel.named_parameters()}
    assert list(got_grads) == list(want_grads)  # every parameter, in torch's order
    errs["grads"] = max(rel_err(got_grads[n], want_grads[n]) for n in want_grads)
    # And back: torch's grads in Flax layout match; our own round trip is exact.
    back = tree_from_torch_names(want_grads, grads)
    assert max(jax.tree_util.tree_leaves(jax.tree_util.tree_map(rel_err, grads, back))) == errs["grads"]
    assert_trees_equal(tree_from_torch_names(got_grads, grads), jax.tree_util.tree_map(np.asarray, grads))
    return errs


@pytest.mark.parametrize("name,stem,size", CONFIGS)
def test_float64_matches_torch(x64, name, stem, size):
    errs = compare_with_torch(name, stem, size, "float64")
    print(f"\nfloat64 {name} {stem}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    assert errs["grads"] <= 1e-10, errs
    assert max(errs["eval"], errs["train"], errs["running_stats"]) <= 1e-12, errs


# Float32, forward only: float32 gradients carry noise that BN amplifies into the
# first convolutions (up to 5e-4: docs/design-notes.md); float64 is the semantic check.
# Full ResNet-18 (CIFAR stem, BasicBlock) is also the one full-size check; the tiny
# ResNet-50 covers the imagenet stem and Bottleneck.
@pytest.mark.parametrize("name,stem,size,kw", [
    ("resnet18", "cifar", 32, dict(width=64, blocks=(2, 2, 2, 2), batch=2)),
    ("resnet50", "imagenet", 32, {}),
])
def test_float32_matches_torch(name, stem, size, kw):
    errs = compare_with_torch(name, stem, size, "float32", grads=False, **kw)
    print(f"\nfloat32 {name} {stem} {kw}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    assert max(errs.values()) <= 1e-5, errs


def test_param_name_map_paths():
    fmodel = create_model("resnet50", stem="imagenet", **TINY)
    shapes = jax.eval_shape(functools.partial(fmodel.init, train=False), jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
    names = param_name_map(shapes["params"])
    assert names["conv1.weight"] == ("conv1", "kernel")
    assert names["bn1.weight"] == ("bn1", "scale")
    assert names["layer2.0.downsample.0.weight"] == ("layer2", "0", "downsample", "0", "kernel")
    assert names["layer2.0.downsample.1.weight"] == ("layer2", "0", "downsample", "1", "scale")
    assert names["fc.weight"] == ("fc", "kernel")
    assert list(names) == [n for n, _ in resnet("resnet50", stem="imagenet", **TINY).named_parameters()]
    stats = param_name_map(shapes["batch_stats"], kind="batch_stats")
    assert stats["layer1.0.bn3.running_var"] == ("layer1", "0", "bn3", "var")
    with pytest.raises(ValueError, match="not a param leaf"):
        param_name_map(shapes["batch_stats"])  # the wrong kind is refused, not renamed


# --- optimizer state through tree_to_torch_names (jaxdp.optim) ------------------


OPTIMIZERS = {
    "sgd": (dict(momentum=0.9, weight_decay=5e-4),
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=5e-4)),
    "adam": (dict(), lambda ps: torch.optim.Adam(ps, lr=0.1)),
}


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_optimizer_state_converts_to_torch_layout(x64, opt):
    """torch.optim and jaxdp.optim take the same gradients (random, torch layout) for
    a few steps; jaxdp's state, via torch_optimizer_state and tree_to_torch_names,
    is torch's per-parameter state. Then torch's state goes the other way
    (tree_from_torch_names -> optimizer_state_from_torch) and both step once more."""
    from jaxdp.optim import make_optimizer
    from parity_tests.optim_state import optimizer_state_from_torch, torch_optimizer_state

    tmodel = torch_model("resnet18", "imagenet")
    params = variables_from_state_dict(sd_numpy(tmodel))["params"]
    tparams = dict(tmodel.named_parameters())
    options, make_torch = OPTIMIZERS[opt]
    topt = make_torch(tparams.values())
    tx = make_optimizer(opt, 0.1, **options)
    state = tx.init(params)

    @jax.jit
    def step(grads, state, params):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    rng = np.random.default_rng(3)

    def step_both(params, state):
        g = {n: rng.standard_normal(p.shape) for n, p in tparams.items()}
        for n, p in tparams.items():
            p.grad = torch.from_numpy(g[n])
        topt.step()
        return step(tree_from_torch_names(g, params), state, params)

    def assert_same(params, state):
        ours = torch_optimizer_state(opt, state)
        assert set(ours) == set(topt.state[tparams["fc.bias"]])  # same slots as torch keeps
        for slot, tree in ours.items():
            if slot == "step":
                assert all(int(s["step"]) == tree for s in topt.state.values())
                continue
            got = tree_to_torch_names(tree)
            assert max(rel_err(got[n], topt.state[p][slot].numpy()) for n, p in tparams.items()) <= 1e-12, slot
        new = tree_to_torch_names(params)
        assert max(rel_err(new[n], p.detach().numpy()) for n, p in tparams.items()) <= 1e-12

    for _ in range(3):
        params, state = step_both(params, state)
    assert_same(params, state)

    # torch -> jaxdp: torch's per-parameter state by name becomes params-shaped trees.
    slots = topt.state[tparams["fc.bias"]]
    torch_state = {
        slot: tree_from_torch_names({n: topt.state[p][slot] for n, p in tparams.items()}, params)
        for slot in slots if slot != "step"
    }
    if "step" in slots:
        torch_state["step"] = int(slots["step"])
    state = optimizer_state_from_torch(opt, tx, params, torch_state)
    params = tree_from_torch_names({n: p.detach().numpy() for n, p in tparams.items()}, params)
    params, state = step_both(params, state)
    assert_same(params, state)


# --- init statistics ---------------------------------------------------------------


def test_init_statistics_match_torchvision():
    kw = dict(width=32, blocks=(1, 1, 1, 1))
    torch.manual_seed(0)
    tsd = sd_numpy(resnet("resnet18", **kw))
    # The "rbg" key only changes where the random bits come from (the initializers
    # are jaxdp's own); it compiles in ~2 s where threefry takes 5-15 s here.
    fvars = jax.jit(functools.partial(create_model("resnet18", **kw).init, train=False))(
        jax.random.key(0, impl="rbg"), jnp.zeros((1, 32, 32, 3)))
    fsd = state_dict_from_variables(fvars)
    assert list(fsd) == list(tsd)

    checked = 0
    for k, w in tsd.items():
        if w.ndim != 4:
            continue
        # kaiming_normal_(mode="fan_out", nonlinearity="relu"): std = sqrt(2 / (out * kh * kw)).
        out_ch, _, kh, kw_ = w.shape
        std = np.sqrt(2.0 / (out_ch * kh * kw_))
        assert fsd[k].shape == w.shape
        if w.size < 20_000:  # the sample std of n normals is within ~1/sqrt(2n)
            continue
        checked += 1
        for sd in (tsd, fsd):
            x = sd[k]
            assert abs(x.std() / std - 1) < 0.03, (k, x.std(), std)
            assert abs(x.mean()) < 5 * std / np.sqrt(x.size), k
            # An untruncated normal has 4.55% beyond 2 sigma; jax's he_normal
            # (truncated at 2 sigma) would have none.
            assert 0.035 < np.mean(np.abs(x) > 2 * std) < 0.056, k
    assert checked >= 4

    # nn.Linear default: weight and bias U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    bound = 1 / np.sqrt(tsd["fc.weight"].shape[1])
    for sd in (tsd, fsd):
        w, b = sd["fc.weight"], sd["fc.bias"]
        assert np.abs(w).max() <= bound and np.abs(w).max() > 0.9 * bound
        assert abs(w.std() / (bound / np.sqrt(3)) - 1) < 0.1
        assert np.abs(b).max() <= bound
    # BatchNorm: weight 1, bias 0, running mean 0, running var 1.
    for sd in (tsd, fsd):
        for bn in [k[: -len("running_mean")] for k in sd if k.endswith("running_mean")]:
            for leaf, value in (("weight", 1), ("bias", 0), ("running_mean", 0), ("running_var", 1)):
                assert np.all(sd[bn + leaf] == value), bn + leaf


# --- torchvision, validation -------------------------------------------------------


@pytest.mark.parametrize("name", torchvision_reference.MODELS)
def test_resnets_match_torchvision_recorded(name):
    """torch_ref's ResNets against torchvision's, as recorded by tests/torchvision_reference.py
    (torchvision does not import beside this project's CPU torch): the same state_dict names,
    order and shapes, and, with the same float64 weights, the same logits to rounding."""
    recorded = torchvision_reference.load()["models"][name]
    tv_shapes = {k: tuple(s) for k, s in recorded["state_dict"]}
    ours = resnet(name, num_classes=torchvision_reference.NUM_CLASSES, stem="imagenet")
    assert list(torchvision_reference.shapes_of(ours).items()) == list(tv_shapes.items())
    out, want = torchvision_reference.logits(ours, tv_shapes), np.asarray(recorded["logits"])
    assert np.abs(want).max() > 0.1  # the fixed weights give logits worth comparing
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-12 * np.abs(want).max())


@pytest.mark.parametrize("name", torchvision_reference.MODELS)
def test_resnets_match_torchvision_live(name):
    """The same against a live torchvision, where one imports (and the record is current)."""
    torchvision = pytest.importorskip("torchvision", reason="torchvision does not import beside "
                                      "this torch build; test_resnets_match_torchvision_recorded checks the record")
    tv = getattr(torchvision.models, name)(num_classes=torchvision_reference.NUM_CLASSES)
    ours = resnet(name, num_classes=torchvision_reference.NUM_CLASSES, stem="imagenet")
    ours.load_state_dict(tv.state_dict(), strict=True)
    assert list(ours.state_dict()) == list(tv.state_dict())
    shapes = torchvision_reference.shapes_of(tv)
    np.testing.assert_array_equal(torchvision_reference.logits(ours, shapes),
                                  torchvision_reference.logits(tv, shapes))
    recorded = torchvision_reference.load()["models"][name]
    assert [[k, list(s)] for k, s in shapes.items()] == recorded["state_dict"]


def test_choices_match_jaxdp_models():
    assert torch_models.MODELS == jaxdp.models.MODELS
    assert torch_models.STEMS == jaxdp.models.STEMS
    for kw in (dict(name="resnet99"), dict(stem="tiny"), dict(width=0), dict(blocks=(1, 1, 1))):
        with pytest.raises(ValueError) as t_err:
            torch_models.create_model(**kw)
        with pytest.raises(jaxdp.models.ModelError) as j_err:
            create_model(**kw)
        assert str(t_err.value) == str(j_err.value)


@pytest.fixture(scope="module")
def tiny_sd():
    return sd_numpy(torch_model("resnet50", "imagenet", double=False))


def test_missing_key_is_named(tiny_sd):
    sd = dict(tiny_sd)
    del sd["layer1.0.bn1.running_var"]
    with pytest.raises(ValueError, match=r"missing keys: layer1\.0\.bn1\.running_var") as err:
        variables_from_state_dict(sd)
    assert "\n" not in str(err.value)


def test_unexpected_key_is_named(tiny_sd):
    sd = dict(tiny_sd, **{"layer1.0.conv9.weight": np.zeros((8, 8, 1, 1), np.float32)})
    with pytest.raises(ValueError, match=r"unexpected keys: layer1\.0\.conv9\.weight"):
        variables_from_state_dict(sd)
    # A DDP-wrapped model's keys all carry "module."; the message says so.
    with pytest.raises(ValueError, match=r"model\.module\.state_dict\(\)"):
        variables_from_state_dict({"module." + k: v for k, v in tiny_sd.items()})


def test_incomplete_variables_are_named(tiny_sd):
    variables = variables_from_state_dict(tiny_sd)
    del variables["batch_stats"]["layer3"]["0"]["downsample"]["1"]["mean"]
    with pytest.raises(ValueError, match=r"layer3\.0\.downsample\.1\.running_mean"):
        state_dict_from_variables(variables)
    params = variables["params"]
    named = tree_to_torch_names(params)
    del named["fc.bias"]
    with pytest.raises(ValueError, match="fc.bias"):
        tree_from_torch_names(named, params)


def test_interop_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, jaxdp.interop; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
