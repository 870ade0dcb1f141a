"""The Flax ViT against its torch twin (torch_ref/vit.py), through jaxdp.interop.

Float64 separates a semantic bug from float noise: logits and every gradient must
agree to relative 1e-10 (measured ~1e-15). Everything runs a tiny ViT (depth 2,
dim 32); full sizes are checked by shape only (eval_shape, torch's meta device).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import torch.nn.functional as F

import jaxdp.models
from jaxdp.interop import (
    param_name_map,
    state_dict_from_variables,
    tree_from_torch_names,
    tree_to_torch_names,
    variables_from_state_dict,
)
from jaxdp.models import EncoderBlock, ModelError, create_model, family, fsdp_units
from jaxdp.models.resnet import BasicBlock, Bottleneck
from jaxdp.models.vit import torch_names
from jaxdp.optim import make_optimizer, make_schedule, torch_lr_lambda
from parity_tests.optim_state import torch_optimizer_state
from torch_ref import models as torch_models
from torch_ref import vit as torch_vit

TINY = dict(depth=2, dim=32, heads=2, mlp_dim=64, patch=4, image_size=16)  # 17 tokens
BATCH = 4


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny torch ops on this 2-core machine run ~100x slower when torch's two intra-op
    threads contend with XLA's (measured: 0.25 s vs 2 ms per backward)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rel_err(a, b) -> float:
    """Inf-norm relative error of a tensor (elementwise ratios blow up near zero)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def sd_numpy(model) -> dict:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def torch_vit_model(seed=0, double=True, **kw):
    """The torch twin with its LayerNorms and class token random too, so a swapped
    scale/bias or a dropped class token cannot hide behind the 1/0 defaults."""
    torch.manual_seed(seed)
    model = torch_models.create_model("vit-tiny", **{**TINY, **kw})
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0.0, 0.1)
        model.cls_token.normal_(0.0, 0.5)
    return model.double() if double else model


def images(batch=BATCH, size=TINY["image_size"], seed=1):
    return np.random.default_rng(seed).standard_normal((batch, 3, size, size))


def nhwc(x_nchw):
    return jnp.asarray(x_nchw.transpose(0, 2, 3, 1))


def shapes_of(fmodel, size):
    return jax.eval_shape(functools.partial(fmodel.init, train=False),
                          jax.random.key(0), jnp.zeros((1, size, size, 3), fmodel.dtype))


def count(tree) -> int:
    return sum(x.size for x in jax.tree_util.tree_leaves(tree))


def assert_trees_equal(a, b):
    fa, fb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
    assert [p for p, _ in fa] == [p for p, _ in fb]
    for (path, x), (_, y) in zip(fa, fb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and np.array_equal(x, y), jax.tree_util.keystr(path)


# --- the same function ------------------------------------------------------------


@pytest.mark.float64
def test_float64_logits_and_every_gradient_match_torch():
    tmodel = torch_vit_model()
    fmodel = create_model("vit-tiny", dtype="float64", **TINY)
    variables = variables_from_state_dict(sd_numpy(tmodel))
    x = images()
    y = np.random.default_rng(2).integers(0, 10, BATCH)

    logits = tmodel(torch.from_numpy(x))
    F.cross_entropy(logits, torch.from_numpy(y)).backward()

    def loss(params):
        out = fmodel.apply({"params": params}, nhwc(x), train=True)
        return optax.softmax_cross_entropy_with_integer_labels(out, jnp.asarray(y)).mean(), out

    (_, got), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(variables["params"])
    assert got.dtype == jnp.float64
    errs = {"logits": rel_err(got, logits.detach().numpy())}

    got_grads = tree_to_torch_names(grads)
    want_grads = {n: p.grad.numpy() for n, p in tmodel.named_parameters()}
    assert list(got_grads) == list(want_grads)  # every parameter, in torch's order
    per_tensor = {n: rel_err(got_grads[n], want_grads[n]) for n in want_grads}
    worst = max(per_tensor, key=per_tensor.get)
    errs["grads"] = per_tensor[worst]
    print(f"\nfloat64 ViT: logits {errs['logits']:.1e}, worst grad {errs['grads']:.1e} ({worst})")
    assert errs["logits"] <= 1e-10 and errs["grads"] <= 1e-10, (errs, worst)
    # torch's grads in Flax layout, and our own grads there and back, bit for bit.
    assert_trees_equal(tree_from_torch_names(got_grads, grads), jax.tree_util.tree_map(np.asarray, grads))


def test_bfloat16_runs_with_float32_params_and_logits():
    x = nhwc(images()).astype(jnp.float32)
    f32 = create_model("vit-tiny", **TINY)
    bf16 = create_model("vit-tiny", dtype="bfloat16", **TINY)
    shapes = shapes_of(bf16, TINY["image_size"])
    assert {s.dtype for s in jax.tree_util.tree_leaves(shapes)} == {jnp.dtype("float32")}
    variables = variables_from_state_dict(sd_numpy(torch_vit_model(double=False)))
    ref = jax.jit(functools.partial(f32.apply, train=False))(variables, x)  # eager: op-by-op compiles
    fwd = jax.jit(functools.partial(bf16.apply, train=False))
    out = fwd(variables, x)
    assert out.dtype == jnp.float32  # logits leave in float32 so the loss is not bf16
    assert np.all(np.isfinite(out))
    assert np.abs(out - ref).max() <= 0.05 * np.abs(ref).max()
    assert "bf16" in fwd.lower(variables, x).as_text()


def test_other_image_sizes_are_refused():
    fmodel = create_model("vit-tiny", **TINY)
    with pytest.raises(ValueError, match="built for 16x16 images, got 32x32"):
        shapes_of(fmodel, 32)


# --- round trips ------------------------------------------------------------------


def test_torch_flax_torch_round_trip_is_exact():
    sd = sd_numpy(torch_vit_model(double=False))
    back = state_dict_from_variables(variables_from_state_dict(sd))
    assert list(back) == list(sd)  # same keys, in the twin's order
    for k in sd:
        assert back[k].dtype == sd[k].dtype and np.array_equal(back[k], sd[k]), k
    torch_models.create_model("vit-tiny", **TINY).load_state_dict(
        {k: torch.from_numpy(v) for k, v in back.items()}, strict=True)


def test_flax_torch_flax_round_trip_is_exact():
    shapes = shapes_of(create_model("vit-tiny", **TINY), TINY["image_size"])
    rng = np.random.default_rng(0)
    variables = jax.tree_util.tree_map(lambda s: rng.standard_normal(s.shape).astype(s.dtype), shapes)
    assert set(variables) == {"params"}  # no buffers, so no batch_stats
    sd = state_dict_from_variables(variables)
    torch_models.create_model("vit-tiny", **TINY).load_state_dict(
        {k: torch.from_numpy(v) for k, v in sd.items()}, strict=True)
    assert_trees_equal(variables_from_state_dict(sd), variables)


def test_param_name_map_paths():
    params = shapes_of(create_model("vit-tiny", **TINY), TINY["image_size"])["params"]
    names = param_name_map(params)
    assert names["cls_token"] == ("cls_token",)
    assert names["patch_embed.proj.weight"] == ("patch_embed", "proj", "kernel")
    assert names["blocks.1.norm2.weight"] == ("blocks", "1", "norm2", "scale")
    assert names["blocks.0.attn.qkv.weight"] == ("blocks", "0", "attn", "qkv", "kernel")
    assert names["head.bias"] == ("head", "bias")
    assert list(names) == [n for n, _ in torch_vit_model().named_parameters()]
    with pytest.raises(ValueError, match="no batch_stats"):
        param_name_map(params, kind="batch_stats")


def test_bad_state_dicts_are_named():
    sd = sd_numpy(torch_vit_model(double=False))
    broken = {k: v for k, v in sd.items() if k != "blocks.1.mlp.fc2.bias"}
    with pytest.raises(ValueError, match=r"ViT with depth 2: missing keys: blocks\.1\.mlp\.fc2\.bias") as err:
        variables_from_state_dict(broken)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"model\.module\.state_dict\(\)"):
        variables_from_state_dict({"module." + k: v for k, v in sd.items()})
    bad_shape = dict(sd, **{"head.weight": np.zeros((3, 32), np.float32)})
    params = variables_from_state_dict(sd)["params"]
    with pytest.raises(ValueError, match="head.weight: shape"):
        tree_from_torch_names(bad_shape, params)


# --- sizes, options, units ----------------------------------------------------------


@pytest.mark.parametrize("name,expected", [("vit-tiny", 5_362_762), ("vit-small", 21_342_346)])
def test_full_size_parameter_counts_and_shapes_match_torch(name, expected):
    """Shapes only: eval_shape, and torch's meta device (load_state_dict(assign=True)
    still checks every key and shape)."""
    shapes = shapes_of(create_model(name), 32)
    assert count(shapes["params"]) == expected
    with torch.device("meta"):
        tmodel = torch_models.create_model(name)
    assert sum(p.numel() for p in tmodel.parameters()) == expected
    sd = state_dict_from_variables(jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), shapes))
    assert list(sd) == list(tmodel.state_dict())
    tmodel.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()}, strict=True, assign=True)


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="vit-huge"),
     "unknown model 'vit-huge'; choose one of resnet18, resnet34, resnet50, vit-tiny, vit-small"),
    (dict(name="vit-tiny", width=16), "width=16 does not apply to vit-tiny; ViT options: depth, dim"),
    (dict(name="vit-tiny", stem="imagenet"), "stem='imagenet' does not apply to vit-tiny"),
    (dict(name="vit-tiny", blocks=(1, 1, 1, 1)), "blocks=.1, 1, 1, 1. does not apply"),
    (dict(name="resnet18", depth=2),
     "depth=2 does not apply to resnet18; ResNet options: width, blocks, stem"),
    (dict(name="vit-tiny", heads=5), "dim 192 must be divisible by heads 5"),
    (dict(name="vit-small", patch=5), "image_size 32 must be divisible by patch 5"),
    (dict(name="vit-tiny", depth=0), "depth must be a positive integer, got 0"),
    (dict(name="vit-tiny", dim=32.0), "dim must be a positive integer, got 32.0"),
    (dict(name="vit-tiny", mlp_dim=True), "mlp_dim must be a positive integer, got True"),
])
def test_bad_options_are_one_line_model_errors_in_both_factories(kwargs, message):
    with pytest.raises(ModelError, match=message) as j_err:
        create_model(**kwargs)
    with pytest.raises(ValueError) as t_err:
        torch_models.create_model(**kwargs)
    assert str(t_err.value) == str(j_err.value) and "\n" not in str(j_err.value)


def test_vit_accepts_resnet_defaults_and_dtype_errors():
    # The trainer passes its whole config; ResNet options at their defaults are fine.
    assert create_model("vit-tiny", width=64, blocks=None, stem="cifar").dim == 192
    with pytest.raises(ModelError, match="unknown dtype 'float16'"):
        create_model("vit-tiny", dtype="float16")
    with pytest.raises(ModelError, match="bn_axis_name='batch' does not apply"):
        create_model("vit-tiny", bn_axis_name="batch")


def test_names_and_families_agree():
    assert torch_models.MODELS == jaxdp.models.MODELS
    assert torch_models.FAMILIES == jaxdp.models.FAMILIES
    assert torch_vit.CONFIGS == jaxdp.models.VIT_ARCHITECTURES
    assert torch_vit.LAYER_NORM_EPS == jaxdp.models.vit.LAYER_NORM_EPS
    assert family("vit-small") == "vit" and family("resnet50") == "resnet"
    with pytest.raises(ModelError, match="unknown model"):
        family("vgg")


def test_fsdp_units_are_the_encoder_blocks():
    fmodel = create_model("vit-tiny", **TINY)
    assert fsdp_units(fmodel) == (EncoderBlock,)
    assert fsdp_units(create_model("resnet18")) == (BasicBlock, Bottleneck)

    # Each EncoderBlock instance owns exactly its blocks/i subtree, as ZeRO-3 needs.
    seen = []

    def record(next_fun, args, kwargs, context):
        if isinstance(context.module, EncoderBlock) and context.method_name == "__call__":
            seen.append((context.module.path, set(context.module.variables["params"])))
        return next_fun(*args, **kwargs)

    params = shapes_of(fmodel, TINY["image_size"])["params"]
    with nn.intercept_methods(record):
        jax.eval_shape(functools.partial(fmodel.apply, train=False), {"params": params},
                       jnp.zeros((1, 16, 16, 3)))
    assert seen == [(("blocks", str(i)), {"norm1", "attn", "norm2", "mlp"}) for i in range(2)]

    # torch_ref fully_shards the same blocks, in forward order.
    from torch_ref.strategies import fsdp_blocks

    tmodel = torch_vit_model(double=False)
    assert fsdp_blocks(tmodel) == list(tmodel.blocks)
    resnet = torch_models.resnet("resnet18", width=4)
    stages = ("layer1", "layer2", "layer3", "layer4")
    assert fsdp_blocks(resnet) == [b for s in stages for b in getattr(resnet, s)]


@pytest.mark.float64
def test_init_distributions_match_torch():
    """jaxdp's own init draws from torch's distributions: Linear/Conv U(+-1/sqrt(fan_in)),
    LayerNorm 1/0, class token 0, position embeddings N(0, 0.02)."""
    kw = dict(TINY, dim=64, mlp_dim=128)
    fmodel = create_model("vit-tiny", **kw)
    fsd = state_dict_from_variables(jax.jit(functools.partial(fmodel.init, train=False))(
        jax.random.key(0, impl="rbg"), jnp.zeros((1, 16, 16, 3))))
    torch.manual_seed(0)
    tsd = sd_numpy(torch_models.create_model("vit-tiny", **kw))
    assert list(fsd) == list(tsd)
    for sd in (tsd, fsd):
        for k, w in sd.items():
            if k.endswith("cls_token") or ".norm" in k or k.startswith("norm."):
                want = 1.0 if k.endswith("weight") and "norm" in k else 0.0
                assert np.all(w == want), k
            elif k == "pos_embed":
                assert abs(w.std() / 0.02 - 1) < 0.1 and abs(w.mean()) < 0.01, k
            else:  # Linear / Conv weight or bias: fan_in is the weight's size per output
                fan_in = int(np.prod(sd[k.rsplit(".", 1)[0] + ".weight"].shape[1:]))
                bound = 1 / np.sqrt(fan_in)
                assert np.abs(w).max() <= bound and np.abs(w).max() > 0.8 * bound, k
                if w.size >= 1000:
                    assert abs(w.std() / (bound / np.sqrt(3)) - 1) < 0.1, k


# --- AdamW + warmup-cosine on ViT params ---------------------------------------------


@pytest.mark.float64
def test_adamw_warmup_cosine_matches_torch_on_vit_params():
    """torch's AdamW (decoupled weight decay) + LambdaLR(torch_lr_lambda) against
    make_optimizer("adamw") + make_schedule, float64, 20 steps, on every ViT tensor
    (3-d tokens, LayerNorm scales, fused qkv). Both take torch's gradient of a real
    batch at every step, so only the optimizers are compared."""
    steps, base_lr, wd, sched = 20, 1e-2, 0.05, dict(warmup_steps=4, min_lr=1e-4)
    tmodel = torch_vit_model(depth=1)
    params = jax.tree_util.tree_map(jnp.asarray, variables_from_state_dict(sd_numpy(tmodel))["params"])
    tparams = dict(tmodel.named_parameters())
    topt = torch.optim.AdamW(tparams.values(), lr=base_lr, weight_decay=wd)
    tsched = torch.optim.lr_scheduler.LambdaLR(
        topt, torch_lr_lambda("warmup_cosine", base_lr, steps, **sched))
    tx = make_optimizer("adamw", make_schedule("warmup_cosine", base_lr, steps, **sched), weight_decay=wd)
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    rng = np.random.default_rng(3)
    worst = 0.0
    for t in range(steps):
        x = torch.from_numpy(images(seed=10 + t))
        y = torch.from_numpy(rng.integers(0, 10, BATCH))
        topt.zero_grad()
        F.cross_entropy(tmodel(x), y).backward()
        grads = tree_from_torch_names({n: p.grad for n, p in tparams.items()}, params)
        topt.step()
        tsched.step()
        params, state = step(params, state, grads)

        got = tree_to_torch_names(params)
        errs = [rel_err(got[n], p.detach().numpy()) for n, p in tparams.items()]
        ours = torch_optimizer_state("adamw", state)
        assert ours["step"] == int(topt.state[tparams["head.bias"]]["step"]) == t + 1
        for slot in ("exp_avg", "exp_avg_sq"):
            named = tree_to_torch_names(ours[slot])
            errs += [rel_err(named[n], topt.state[p][slot].numpy()) for n, p in tparams.items()]
        worst = max(worst, *errs)
        assert max(errs) <= 1e-12, (t, max(errs))
    print(f"\nAdamW + warmup_cosine on ViT params, 20 f64 steps: worst rel err {worst:.1e}")


def test_torch_names_grammar():
    keys = torch_names.state_dict_keys(2)
    assert len(keys) == 2 + 2 + 2 * 12 + 4
    assert [torch_names.torch_name(torch_names.flax_path(k)) for k in keys] == keys
    assert torch_names.infer_depth(keys) == 2
