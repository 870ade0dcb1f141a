"""ZeRO-1/2/3 and HSDP against DDP (float64), the sharded layout, FSDP units, checkpoint resharding,
and one real training run.

DDP itself is checked against independent single-device references in
test_ddp.py; here every sharded strategy must reproduce DDP step for step:
params, loss, BN running stats, averaged gradients and, through ``canonical``,
the optimizer state, to a relative error <= 1e-12. The FSDP units are checked
bit for bit against ``model.apply`` itself, and the layout against its formula.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import ast  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from helpers import TinyConvNet, as_batch, collectives_in_loops, init, max_rel_error, numpy_init, random_batch, run_steps  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxdp.strategies  # noqa: E402
from jaxdp.checkpoint import Checkpointer  # noqa: E402
from jaxdp.config.tree import TrainConfig  # noqa: E402
from jaxdp.runtime.mesh import make_mesh  # noqa: E402
from jaxdp.models import create_model, fsdp_units  # noqa: E402
from jaxdp.models.resnet import BasicBlock, Bottleneck, ResNet, Stage  # noqa: E402
from jaxdp.models.vit import EncoderBlock  # noqa: E402
from jaxdp.optim import make_optimizer  # noqa: E402
from jaxdp.strategies import StrategyError, create_strategy, layout  # noqa: E402
from jaxdp.strategies.sync.buckets import leaf_path  # noqa: E402
from jaxdp.strategies.units import UnitError, Units, fsdp_unit, gather_on_use, in_unit, unit_paths  # noqa: E402
from jaxdp.strategies.zero import ZeRO  # noqa: E402
from jaxdp.loss.task import classifier  # noqa: E402

TOL = 1e-12
STEPS = 5
N = 8
OPTIMIZERS = {
    "sgd": lambda: make_optimizer("sgd", 0.1, momentum=0.9, weight_decay=5e-4),
    "adam": lambda: make_optimizer("adam", 1e-3, weight_decay=1e-4),
}
# Each optimizer also runs one BN/accumulation mode, so every strategy sees both
# BN modes and accumulation without compiling more programs (a compile is ~5 s of CPU).
MODES = {"sgd": dict(accum_steps=2, sync_bn=True), "adam": dict(accum_steps=1, sync_bn=False)}

pytestmark = pytest.mark.float64  # exact comparisons in float64 (conftest turns x64 on)


def batches_for(n):
    # 4 samples per device: BN over fewer samples of a small map is too ill-conditioned for 1e-12.
    return [random_batch(4 * n, seed=s) for s in range(STEPS)]


def small_resnet(width=4, num_classes=10):
    """Stem, a plain block, a strided block with a downsample, head: every kind of
    ZeRO-3 unit, at half the compile time of the four-stage tiny ResNet-18."""
    return ResNet(block=BasicBlock, stage_sizes=(1, 1), width=width, num_classes=num_classes, dtype=jnp.float64,
                  param_dtype=jnp.float64)


UNITS = fsdp_units(small_resnet())  # the model family's FSDP units (jaxdp.models), as the trainer passes them


def make(name, model, tx, n, **options):
    return create_strategy(name, model, classifier(model), tx, make_mesh(n), **options)


def train(name, opt, n=N, **options):
    """Canonical state after ``batches_for(n)`` and each step's metrics (with the averaged grads)."""
    model = small_resnet()
    strategy = make(name, model, OPTIMIZERS[opt](), n, return_grads=True, **MODES[opt], **options)
    state, history = run_steps(strategy, strategy.engine.init_state(init(model)), batches_for(n))
    return strategy.engine.canonical(state), history


@functools.lru_cache(maxsize=None)
def ddp(opt, n=N):
    return train("ddp", opt, n)


def assert_same_training(got, ref):
    (state, history), (ref_state, ref_history) = got, ref
    assert int(state.step) == int(ref_state.step) == STEPS
    assert max_rel_error(state.params, ref_state.params) <= TOL
    assert max_rel_error(state.model_state["batch_stats"], ref_state.model_state["batch_stats"]) <= TOL
    # canonical() must give DDP's optimizer-state tree, not just close numbers.
    assert jax.tree_util.tree_structure(state.opt_state) == jax.tree_util.tree_structure(ref_state.opt_state)
    assert max_rel_error(state.opt_state, ref_state.opt_state) <= TOL
    for m, r in zip(history, ref_history, strict=True):
        assert abs(float(m["loss"]) - float(r["loss"])) <= TOL * abs(float(r["loss"]))
        assert max_rel_error(m["loss_per_device"], r["loss_per_device"]) <= TOL
        assert max_rel_error(m["grads"], r["grads"]) <= TOL


CASES = [("zero1", {}), ("zero2", {}), ("zero3", {"units": UNITS}),
         ("hsdp", {"mesh_shape": (2, 4), "units": UNITS}), ("hsdp", {"mesh_shape": (4, 2), "units": UNITS})]


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=["sgd-syncbn-accum2", "adam"])
@pytest.mark.parametrize("name,options", CASES, ids=["zero1", "zero2", "zero3", "hsdp2x4", "hsdp4x2"])
def test_equals_ddp(name, options, opt):
    """sgd: SyncBN and 2 micro-batches (ZeRO-3 reduce-scatters each, DDP reduces once: the
    same sum); adam: DDP's BN buffers (device 0's running stats), no accumulation."""
    assert_same_training(train(name, opt, **options), ddp(opt))


def test_zero3_without_units_equals_ddp():
    """No units: the whole model is one root unit, gathered once per step (and micro-batch)."""
    assert_same_training(train("zero3", "sgd"), ddp("sgd"))


@pytest.mark.parametrize("name,n,options", [("zero1", 3, {}), ("zero2", 3, {}), ("zero3", 3, {"units": UNITS}),
                                            ("hsdp", 6, {"mesh_shape": (2, 3), "units": UNITS})],
                         ids=["zero1", "zero2", "zero3", "hsdp2x3"])
def test_equals_ddp_with_padding(name, n, options):
    """3 shards: most tensors have no dimension 3 divides (BN vectors, the head), so they are
    zero-padded at rest; with SyncBN and 2 micro-batches the result is still DDP's."""
    params = jax.eval_shape(lambda: init(small_resnet()))["params"]
    padded = [s.shape for s in jax.tree_util.tree_leaves(params) if layout.padded_shape(s.shape, 3) != s.shape]
    assert len(padded) >= 5, "the case must exercise padding"
    assert_same_training(train(name, "sgd", n, **options), ddp("sgd", n))


@pytest.mark.parametrize("name,options", [("zero3", {"units": UNITS}),
                                          ("hsdp", {"mesh_shape": (2, 4), "units": UNITS})])
def test_evaluation_gathers_one_tensor_at_a_time_and_equals_ddp(name, options):
    """ZeRO-3's evaluation runs the model unit by unit like its training step: one all-gather
    per parameter tensor, never the whole model in one, and DDP's numbers."""
    from jaxdp.analysis import parse_collectives

    model, tx = small_resnet(), OPTIMIZERS["sgd"]()
    variables = init(model)
    x, y = random_batch(4 * N, seed=99)
    batch = as_batch(x, y, np.ones(4 * N, bool))
    ref = make("ddp", model, tx, N)
    s = make(name, model, tx, N, **options)
    state = s.engine.init_state(variables)
    got = s.engine.evaluate(state, s.engine.shard_batch(batch))
    want = ref.engine.evaluate(ref.engine.init_state(variables), ref.engine.shard_batch(batch))
    for key in ("loss_sum", "correct", "count"):
        assert abs(float(got[key]) - float(want[key])) <= TOL * abs(float(want[key])), key
    hlo = s.engine.jit_eval.lower(state, s.engine.shard_batch(batch)).compile().as_text()
    gathers = parse_collectives(hlo, N)["ops"]["all-gather"]["count"]
    assert gathers == len(jax.tree_util.tree_leaves(variables["params"]))


# ----------------------------------------------------------------------------- the sharded layout

def test_layout_cuts_one_dimension_padding_only_when_none_divides():
    assert layout.shard_dim((), 8) is None and layout.padded_shape((), 8) == ()
    assert layout.shard_dim((3, 3, 16, 32), 8) == 3  # HWIO: the largest divisible dim, never the kernel height
    assert layout.shard_dim((3, 3, 16, 12), 8) == 2
    assert layout.padded_shape((3, 3, 16, 12), 8) == (3, 3, 16, 12)
    assert layout.shard_dim((3, 3, 3, 4), 8) == 3 and layout.padded_shape((3, 3, 3, 4), 8) == (3, 3, 3, 8)
    assert layout.padded_shape((10,), 8) == (16,) and layout.padded_shape((16, 10), 8) == (16, 10)
    assert layout.padded_shape((7, 10), 3) == (7, 12)
    assert layout.spec((16, 10), 8, "data") == P("data") and layout.spec((7, 12), 3, "data") == P(None, "data")
    assert layout.spec((), 8, "data") == P()
    x = np.arange(70.0).reshape(7, 10)
    padded = layout.pad(x, 3)
    assert padded.shape == (7, 12) and not np.asarray(padded)[:, 10:].any()
    np.testing.assert_array_equal(layout.unpad(padded, x.shape), x)

    # ResNet-18 at N = 8: the only tensor no dimension of which 8 divides is the head's bias (10 -> 16).
    model = create_model("resnet18")
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)), train=False))["params"]
    padded = {leaf_path(p): (s.shape, layout.padded_shape(s.shape, 8))
              for p, s in jax.tree_util.tree_leaves_with_path(shapes) if layout.padded_shape(s.shape, 8) != s.shape}
    assert padded == {("fc", "bias"): ((10,), (16,))}


@pytest.mark.parametrize("n", [3, 1])
def test_layout_collectives_round_trip_with_padding(n):
    """my_chunk / gather / gather_group / scatter_group on 3 devices, padded tensors and a scalar
    among them, against numpy; and on one device, where a group moves tensor by tensor: nothing is
    concatenated (XLA:GPU fused a one-device bucket's concatenate into every slice of it)."""
    mesh = make_mesh(n)
    shapes = [(5,), (3, 3, 4, 7), (4, 10), (), (6, 2)]
    rng = np.random.default_rng(0)
    fulls = [rng.normal(size=s) for s in shapes]
    padded = [np.asarray(layout.pad(x, n)) for x in fulls]
    specs = [layout.spec(s, n, "data") for s in shapes]
    chunks = [jax.device_put(x, jax.sharding.NamedSharding(mesh, spec)) for x, spec in zip(padded, specs)]

    def gathered(*cs):
        one = [layout.gather(c, s, "data", n, to="invarying") for c, s in zip(cs, shapes)]
        return one, layout.gather_group(list(cs), shapes, "data", n)

    gather_program = jax.jit(jax.shard_map(gathered, mesh=mesh, in_specs=tuple(specs),
                                           out_specs=([P()] * len(shapes), [P()] * len(shapes))))
    one, group = gather_program(*chunks)
    for a, b, x in zip(one, group, fulls):
        np.testing.assert_array_equal(a, x)
        np.testing.assert_array_equal(b, x)

    mine = jax.jit(jax.shard_map(lambda *xs: [layout.my_chunk(x, "data", n) for x in xs], mesh=mesh,
                                 in_specs=tuple(P() for _ in shapes), out_specs=specs))(*fulls)
    for a, x in zip(mine, padded):
        np.testing.assert_array_equal(a, x)

    # Each device holds its own full tensors: the scatter is the padded SUM, cut into chunks.
    per_device = [rng.normal(size=(n,) + s) for s in shapes]
    scatter_program = jax.jit(jax.shard_map(lambda *xs: layout.scatter_group([x[0] for x in xs], "data", n),
                                            mesh=mesh, in_specs=tuple(P("data") for _ in shapes), out_specs=specs))
    scattered = scatter_program(*per_device)
    for a, x in zip(scattered, per_device):
        want = np.asarray(layout.pad(x.sum(axis=0), n))
        np.testing.assert_allclose(a, want, rtol=1e-15, atol=1e-15)
    if n == 1:
        for program, args in ((gather_program, chunks), (scatter_program, per_device)):
            assert "concatenate" not in program.lower(*args).as_text()


@pytest.mark.parametrize("name,options", [("zero1", {}), ("zero2", {}), ("zero3", {"units": UNITS}),
                                          ("hsdp", {"mesh_shape": (2, 4), "units": UNITS})])
def test_state_is_sharded_as_zero_says(name, options):
    """Per device, every sharded tensor is 1/S of its padded shape, cut along ``shard_dim``
    (S = 8, HSDP's shard group 4); the rest is whole. The bytes a device holds are
    sum(padded size / S) over the sharded tensors plus the whole ones."""
    model, tx = small_resnet(), OPTIMIZERS["adam"]()
    variables = init(model)
    sharded = ("params", "opt") if name in ("zero3", "hsdp") else ("opt",)
    s = make(name, model, tx, N, **options)
    state = s.engine.init_state(variables)
    shards = 4 if name == "hsdp" else N
    assert s.shards == shards
    full = {"params": jax.tree_util.tree_leaves(layout.shapes_of(variables["params"])),
            "opt": jax.tree_util.tree_leaves(jax.eval_shape(tx.init, layout.shapes_of(variables["params"])))}
    for part, tree in (("params", state.params), ("opt", state.opt_state)):
        leaves = jax.tree_util.tree_leaves(tree)
        assert len(leaves) == len(full[part])
        held = expected = 0
        for x, f in zip(leaves, full[part]):
            shard = x.addressable_shards[0].data
            held += shard.nbytes
            if part in sharded and f.shape:  # scalars (Adam's count) stay whole
                padded = layout.padded_shape(f.shape, shards)
                d = layout.shard_dim(f.shape, shards)
                assert x.shape == padded, (name, part)
                assert shard.shape == tuple(p // shards if i == d else p for i, p in enumerate(padded)), (name, part)
                expected += int(np.prod(padded)) // shards * x.dtype.itemsize
                padding = np.ones(padded, bool)
                padding[tuple(slice(0, k) for k in f.shape)] = False
                assert not np.asarray(x)[padding].any(), (name, part)  # the padding holds zeros
            else:
                assert x.shape == f.shape and shard.shape == f.shape, (name, part)
                expected += x.nbytes
        assert held == expected, (name, part)
    if "params" in sharded:  # the chunks are the params
        got = jax.tree_util.tree_map(lambda x, f: np.asarray(layout.unpad(np.asarray(x), f.shape)), state.params,
                                     variables["params"])
        assert max_rel_error(got, variables["params"]) == 0


@pytest.mark.production_compiler
@pytest.mark.parametrize("name,options", [("zero3", {"units": UNITS}), ("zero1", {})])
def test_sharded_init_is_the_unsharded_init(name, options):
    """``init`` builds each device's shards on the device; the state is the unsharded (compiled)
    ``model.init`` and ``tx.init`` bit for bit. (Eager ``model.init`` rounds the kaiming normal
    draws differently from any compiled one, by an ulp.)"""
    model, tx = small_resnet(), OPTIMIZERS["adam"]()
    s = make(name, model, tx, N, **options)
    example = as_batch(*random_batch(2))
    rng = jax.random.key(7)
    state = s.engine.init(rng, example)
    want = jax.jit(lambda r: model.init(r, jnp.zeros_like(example["image"]), train=False))(rng)
    got = s.engine.canonical(state)
    assert max_rel_error(got.params, want["params"]) == 0
    assert max_rel_error(got.model_state["batch_stats"], want["batch_stats"]) == 0
    assert max_rel_error(got.opt_state, tx.init(want["params"])) == 0
    if name == "zero3":  # built as chunks, padding zero
        for x, f in zip(jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(want["params"])):
            assert len(x.sharding.device_set) == N and x.addressable_shards[0].data.size * N == x.size
            assert x.shape == layout.padded_shape(f.shape, N)
            np.testing.assert_array_equal(np.asarray(x), np.asarray(layout.pad(f, N)))


# ----------------------------------------------------------------------------- FSDP units

def compose_units(model, units, train, size=8):
    """``model.apply`` with every outermost unit run by ``fsdp_unit`` on use, its params held
    "sharded" in a form the model cannot read (an extra leading axis) until the unit's gather."""
    x0 = jax.ShapeDtypeStruct((1, size, size, 3), jnp.float64)
    paths = unit_paths(Units(units), lambda x: model.init(jax.random.key(0), x, train=False), x0)
    ran = []

    def gather_unit(module, call, variables, mutable, args, kwargs):
        ran.append(tuple(module.path))
        state = {c: v for c, v in variables.items() if c != "params"}
        gather = functools.partial(jax.tree_util.tree_map, lambda c: c[0])
        return fsdp_unit(call, gather, variables["params"], state, args, kwargs, mutable)[:2]

    def apply(variables, x):
        chunks = jax.tree_util.tree_map_with_path(
            lambda p, v: v[None] if in_unit(leaf_path(p), paths) else v, variables["params"])
        with gather_on_use(Units(units), gather_unit):
            return model.apply({**variables, "params": chunks}, x, train=train,
                               mutable=["batch_stats"] if train else False)
    return apply, paths, ran


UNIT_MODELS = {
    # cifar stem, basic blocks (one with a downsample per later stage)
    "basic": lambda: create_model("resnet18", width=4, blocks=(1, 1, 1, 1), dtype="float64"),
    # imagenet stem (maxpool), bottlenecks, and a stage's second (stride-1) block
    "bottleneck": lambda: create_model("resnet50", width=4, blocks=(2, 1, 1, 1), stem="imagenet", dtype="float64"),
}


@pytest.mark.production_compiler
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("arch", UNIT_MODELS)
def test_units_compose_to_the_model(arch, train):
    """ZeRO-3's unit-by-unit forward (gather on use, then the unit applied unbound, its BN stats
    written back) is model.apply bit for bit: logits, BN running stats and (training) the gradient."""
    model = UNIT_MODELS[arch]()
    size = 32 if arch == "bottleneck" else 8
    variables = numpy_init(model, size=size)  # any values do: both sides read the same (and it compiles nothing)
    x, y = random_batch(4, size=size)
    composed, paths, ran = compose_units(model, fsdp_units(model), train, size)
    blocks = [p for p in paths if p[0].startswith("layer")]
    assert paths == blocks and len(blocks) == (5 if arch == "bottleneck" else 4)
    plain = functools.partial(model.apply, train=train, mutable=["batch_stats"] if train else False)
    if not train:  # evaluation has no backward
        got, want = jax.jit(composed)(variables, x), jax.jit(plain)(variables, x)
        assert ran == paths  # each unit ran through the gather, once, in order (traced once)
        np.testing.assert_array_equal(got, want)
        return

    def loss(apply, v):
        logits, updated = apply(v, x)
        return (logits * jax.nn.one_hot(y, 10)).sum(), (logits, updated)

    (_, want), want_grads = jax.jit(jax.value_and_grad(lambda v: loss(plain, v), has_aux=True))(variables)
    (_, got), got_grads = jax.jit(jax.value_and_grad(lambda v: loss(composed, v), has_aux=True))(variables)
    assert ran == paths
    np.testing.assert_array_equal(got[0], want[0])
    assert jax.tree_util.tree_structure(got[1]) == jax.tree_util.tree_structure(want[1])
    assert max_rel_error(got[1]["batch_stats"], want[1]["batch_stats"]) == 0
    assert max_rel_error(got[1]["batch_stats"], variables["batch_stats"]) > 0  # the stats did move
    assert max_rel_error(got_grads["params"], want_grads["params"]) == 0


@pytest.mark.production_compiler
def test_units_by_path_pattern_compose_to_the_model():
    """Units named by path (here the stages, ``layer*``) work the same as by class."""
    model = UNIT_MODELS["basic"]()
    variables = numpy_init(model)
    x = random_batch(4)[0]
    composed, paths, ran = compose_units(model, ("layer*",), True)
    assert paths == [("layer1",), ("layer2",), ("layer3",), ("layer4",)]
    got = jax.jit(composed)(variables, x)
    want = jax.jit(lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"]))(variables, x)
    assert ran == paths
    np.testing.assert_array_equal(got[0], want[0])
    assert max_rel_error(got[1]["batch_stats"], want[1]["batch_stats"]) == 0


def test_unit_paths_finds_the_outermost_units():
    model = UNIT_MODELS["bottleneck"]()
    x = jax.ShapeDtypeStruct((1, 32, 32, 3), jnp.float64)

    def find(*spec):
        return unit_paths(Units(spec), lambda x: model.init(jax.random.key(0), x, train=False), x)

    blocks = [("layer1", "0"), ("layer1", "1"), ("layer2", "0"), ("layer3", "0"), ("layer4", "0")]
    stages = [("layer1",), ("layer2",), ("layer3",), ("layer4",)]
    assert fsdp_units(model) == (BasicBlock, Bottleneck)
    assert find(*fsdp_units(model)) == blocks
    assert find(Bottleneck) == blocks  # a subclass of BasicBlock: either names it
    assert find("layer*/*") == blocks  # a block's own modules are inside it: the outermost match wins
    assert find("layer*") == stages
    assert find(Stage, Bottleneck) == stages  # units never nest
    assert find("layer1/*") == [("layer1", "0"), ("layer1", "1")]
    assert find("*/downsample") == [("layer1", "0", "downsample"), ("layer2", "0", "downsample"),
                                    ("layer3", "0", "downsample"), ("layer4", "0", "downsample")]
    assert find("fc", "conv1") == [("conv1",), ("fc",)]  # patterns match whole paths: not layer1/0/conv1
    assert find("fc", Stage) == stages + [("fc",)]  # call order


def test_unit_specs_matching_nothing_are_refused():
    model = small_resnet()
    x = jax.ShapeDtypeStruct((1, 8, 8, 3), jnp.float64)
    init_fn = lambda x: model.init(jax.random.key(0), x, train=False)  # noqa: E731
    with pytest.raises(UnitError, match="no module matches"):
        unit_paths(Units(("nothing*",)), init_fn, x)
    with pytest.raises(UnitError, match="no module matches"):
        unit_paths(Units((EncoderBlock,)), init_fn, x)  # a ViT's unit in a ResNet
    with pytest.raises(UnitError, match="module classes or path patterns"):
        Units((42,))
    # Through the strategy: refused when it first reads the model, before anything runs.
    s = make("zero3", model, OPTIMIZERS["sgd"](), 2, units=("nothing*",))
    with pytest.raises(UnitError, match="no module matches"):
        s.engine.init(jax.random.key(0), as_batch(*random_batch(2)))
    with pytest.raises(StrategyError, match="units"):
        make("zero2", model, OPTIMIZERS["sgd"](), 2, units=UNITS)
    with pytest.raises(StrategyError, match="units"):
        ZeRO(model, classifier(model), OPTIMIZERS["sgd"](), make_mesh(2), stage=1, units=UNITS)


MODEL_WORDS = ("ResNet", "resnet", "BasicBlock", "Bottleneck", "ViT", "vit", "EncoderBlock")


def model_names_in(source: str, filename: str = "<probe>"):
    """Every identifier, attribute, argument, import and non-docstring string in ``source``
    that contains one of MODEL_WORDS (comments and docstrings are prose, not code)."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant) and isinstance(node.body[0].value.value, str)}
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        elif isinstance(node, ast.keyword):
            names = [node.arg or ""]
        elif isinstance(node, ast.alias):
            names = [node.name, node.asname or ""]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            names = [node.value]
        else:
            continue
        hits += [f"{filename}:{node.lineno}: {name!r}" for name in names if any(w in name for w in MODEL_WORDS)]
    return hits


def test_strategies_name_no_model():
    """No strategy names a model: models bring their FSDP units (``jaxdp.models.fsdp_units``).
    Checked on the code of every module in jaxdp/strategies; measurement notes in comments and
    docstrings may say which model a number was taken on."""
    probe = ('"""Measured on ResNet-18."""\n# a ViT comment\nfrom jaxdp.models.resnet import Block\n'
             'units = (Bottleneck,)\nif name == "vit-tiny": pass\nmodel.EncoderBlock\n')
    assert len(model_names_in(probe)) == 4  # the import, the class, the string, the attribute; not the prose
    files = sorted(pathlib.Path(jaxdp.strategies.__file__).parent.glob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "base.py", "zero.py", "ddp.py", "units.py", "layout.py"}
    hits = [hit for path in files for hit in model_names_in(path.read_text(), path.name)]
    assert hits == []
    # And the plain grep: not even a comment names one.
    pattern = re.compile(r"resnet|\bvit\b|vit-|basicblock|bottleneck|encoderblock", re.IGNORECASE)
    assert [f"{path.name}: {m.group(0)}" for path in files for m in pattern.finditer(path.read_text())] == []


# ----------------------------------------------------------------------------- options

COMPRESS = {"bf16": {}, "powersgd": {"powersgd_options": {"start_iter": 2}}}


@pytest.mark.parametrize("compress", COMPRESS)
def test_zero1_compresses_as_ddp(compress):
    """ZeRO-1 composes DDP's AllReduce: with the same compression hook its averaged gradient is
    DDP's bit for bit (PowerSGD's error feedback and Qs too), and it trains."""
    model, n = TinyConvNet(), 4
    variables = init(model)
    tx = make_optimizer("sgd", 0.05, momentum=0.9)
    x, y = random_batch(16, seed=3)
    batches = [(x, y)] * 5  # one batch, repeated: the loss must fall

    def run(name):
        # Both steps at XLA's level 0 (the suite's flags): compiled by its optimising backend,
        # the two programs' PowerSGD averages differed by an ulp (measured).
        s = make(name, model, tx, n, compress=compress, return_grads=True, compiler_options="none",
                 **COMPRESS[compress])
        state, history = run_steps(s, s.engine.init_state(variables), batches)
        return s, s.engine.canonical(state), history

    zs, zero1, zero_history = run("zero1")
    _, ref, ref_history = run("ddp")
    assert zs.sync.compress == compress
    for m, r in zip(zero_history, ref_history):
        assert max_rel_error(m["grads"], r["grads"]) == 0
        assert float(m["loss"]) == float(r["loss"])
    assert max_rel_error(zero1.params, ref.params) <= TOL
    assert max_rel_error(zero1.opt_state, ref.opt_state) <= TOL
    losses = [float(m["loss"]) for m in zero_history]
    assert losses[-1] < losses[0] and np.isfinite(losses).all()
    if compress == "bf16":  # the averages came through bf16
        for g in jax.tree_util.tree_leaves(zero_history[-1]["grads"]):
            g = np.asarray(g)
            np.testing.assert_array_equal(np.asarray(jnp.asarray(g).astype(jnp.bfloat16).astype(g.dtype)), g)
    else:  # PowerSGD ran (steps >= start_iter) and its state is DDP's
        assert zero1.extra is not None and max_rel_error(zero1.extra, ref.extra) == 0
        assert any(np.abs(np.asarray(e)).max() > 0 for e in jax.tree_util.tree_leaves(zero1.extra["error"]))


def test_zero2_and_zero3_refuse_all_reduce_hooks():
    """Stages 2 and 3 reduce-scatter: there is no all-reduce for a hook to compress."""
    model, tx = TinyConvNet(), OPTIMIZERS["sgd"]()
    for name in ("zero2", "zero3", "hsdp"):
        for option in ({"compress": "bf16"}, {"compress": "powersgd"}, {"allreduce": "ring"}):
            with pytest.raises(StrategyError, match=list(option)[0]):
                make(name, model, tx, N, **option)
    for stage in (2, 3):  # the class itself, not only the registry
        with pytest.raises(StrategyError, match="all-reduce hooks"):
            ZeRO(model, classifier(model), tx, make_mesh(N), stage=stage, compress="bf16")
    with pytest.raises(StrategyError, match="bucket_cap_mb"):
        make("zero3", model, tx, N, bucket_cap_mb=1.0)  # zero3 moves per unit
    with pytest.raises(StrategyError, match="bucket_cap_mb"):
        ZeRO(model, classifier(model), tx, make_mesh(N), stage=3, bucket_cap_mb=1.0)


# How often each stage reduces gradients with K = 4 micro-batches, from the compiled HLO.
# Stages 1 and 2 accumulate the local gradient and reduce once per update (DDP's no_sync).
# Stage 3 and HSDP reduce-scatter every micro-batch (inside the loop): one reduction per
# update would need a full local gradient to accumulate into, the 4Ψ ZeRO-3 removes.
# HSDP's all-reduce across replicas still runs once per update, on the summed chunks.
ONCE_PER_UPDATE = {"zero1": (), "zero2": (), "zero3": ("reduce-scatter",), "hsdp": ("reduce-scatter",)}


@pytest.mark.parametrize("name", list(ONCE_PER_UPDATE))
def test_accumulation_reduces_as_documented(name):
    model = TinyConvNet()
    variables = {"batch_stats": {}, **init(model)}
    x, y = random_batch(32)

    def collectives(k):
        strategy = make(name, model, optax.sgd(0.1), 4, accum_steps=k)
        state = strategy.engine.init_state(variables)
        return collectives_in_loops(strategy.engine.lower_step(state, strategy.engine.shard_batch(as_batch(x, y))).compile().as_text())

    (inside_1, outside_1), (inside_4, outside_4) = collectives(1), collectives(4)
    per_micro_batch = ONCE_PER_UPDATE[name]
    assert inside_1 == {}
    assert set(inside_4) == set(per_micro_batch)  # nothing else runs per micro-batch
    for op in per_micro_batch:  # each unit's reduce-scatter, for every micro-batch
        assert inside_4[op] == outside_1[op] > 0
    once = {op: c for op, c in outside_1.items() if op not in per_micro_batch}
    assert {op: c for op, c in outside_4.items() if op not in per_micro_batch} == once
    assert once.get("all-reduce", 0) >= (2 if name == "hsdp" else 1)  # the metrics; hsdp: + the replicas'


def test_accumulating_unsharded_and_reducing_once_equals_ddp():
    """``accum_reduce="once"`` (FSDP2's set_requires_gradient_sync(False)): the unsharded gradients summed
    over the 2 micro-batches, reduce-scattered once: DDP's training, as the default's is (hsdp's: the
    parity pairs, against FSDP2)."""
    assert_same_training(train("zero3", "sgd", accum_reduce="once", units=UNITS), ddp("sgd"))


def test_reduce_scatters_per_update_do_not_grow_with_micro_batches():
    """Read off the compiled step (counted as often as they run): ``each`` reduce-scatters every tensor per
    micro-batch, ``once`` one group per FSDP unit and the root's, whatever K. The unsharded gradients
    cost their bytes in temp memory; the reduce-scatters move K times fewer bytes."""
    from jaxdp.analysis.hlo import parse_collectives

    model = small_resnet()
    x, y = random_batch(16)

    def compiled(k, mode):
        strategy = make("zero3", model, optax.sgd(0.1), 4, units=UNITS, accum_steps=k, accum_reduce=mode)
        state = strategy.engine.init_state(init(model))
        program = strategy.engine.lower_step(state, strategy.engine.shard_batch(as_batch(x, y))).compile()
        return parse_collectives(program.as_text(), 4)["ops"]["reduce-scatter"]

    once = {k: compiled(k, "once") for k in (1, 4)}
    assert {c["count"] for c in once.values()} == {len(UNITS_OF_SMALL_RESNET) + 1}  # each unit's and the root's
    assert once[1]["output_bytes"] == once[4]["output_bytes"]
    each = compiled(4, "each")  # tensor by tensor, every micro-batch
    assert each["count"] % 4 == 0 and each["count"] >= 4 * once[4]["count"]
    assert each["output_bytes"] == pytest.approx(4 * once[4]["output_bytes"], rel=0.01)  # less each tensor's padding


UNITS_OF_SMALL_RESNET = ("layer1/0", "layer2/0")


def test_accum_reduce_once_is_refused_where_the_formula_says_it_does_not_fit(monkeypatch):
    """On a device that reports its memory: params, optimizer state, the gradient chunk and pΨ of
    unsharded gradients must fit, else one line before anything is compiled."""
    from jaxdp.strategies import accum_once

    model = small_resnet()
    strategy = make("zero3", model, optax.sgd(0.1), 4, units=UNITS, accum_steps=2, accum_reduce="once")
    state = strategy.engine.init_state(init(model))
    batch = strategy.engine.shard_batch(as_batch(*random_batch(16)))
    psi_bytes = accum_once.unsharded_grad_bytes(strategy.local_shapes)
    monkeypatch.setattr(accum_once, "memory_limit", lambda device: psi_bytes)  # room for the unsharded grads alone
    with pytest.raises(StrategyError, match="accum_reduce once needs .* GiB per device.*accum_reduce each"):
        strategy.engine.lower_step(state, batch)
    with pytest.raises(StrategyError, match="zero2' takes no option accum_reduce"):
        make("zero2", model, optax.sgd(0.1), 4, accum_reduce="once")


def test_bf16_compute_gathers_bf16_with_results_bit_identical(monkeypatch):
    """Under bfloat16 compute the chunks are cast before the all-gather (the norm layers' params, used
    in float32, are not), and nothing changes by a bit against gathering float32 and casting after
    (``casts.single_casts`` answering None everywhere: the program before). ``reduce_dtype``: the
    reduce-scatters move bfloat16. Read from the program as written: XLA:CPU widens bf16 collectives."""
    from jaxdp.analysis.hlo import parse_collectives
    from jaxdp.strategies import casts

    model = ResNet(block=BasicBlock, stage_sizes=(1, 1), width=4, num_classes=10, dtype=jnp.bfloat16,
                   param_dtype=jnp.float32)
    units = fsdp_units(model)
    batches = [random_batch(16, seed=s) for s in range(2)]

    def run(steps=batches, **options):
        strategy = make("zero3", model, OPTIMIZERS["adam"](), 4, units=units, **options)
        state, history = run_steps(strategy, strategy.engine.init_state(init(model)), steps)
        written = strategy.engine.lower_step(state, strategy.engine.shard_batch(as_batch(*batches[0])))
        text = written.compiler_ir("hlo").as_hlo_text()
        gathers = re.findall(r"= (\w+)\[([\d,]*)\]\S* all-gather\(", text)  # (dtype, dims) of each all-gather
        return (strategy.engine.canonical(state).params, [float(m["loss"]) for m in history],
                parse_collectives(text, 4)["ops"], gathers)

    params, losses, ops, gathers = run()
    gathered = ops["all-gather"]["output_by_dtype"]
    assert set(gathered) == {"bf16", "f32"} and gathered["bf16"] > 2 * gathered["f32"]
    # Every kernel moves bfloat16; float32 only the norm layers' scales and shifts (vectors).
    assert {dtype for dtype, dims in gathers if dims.count(",") >= 1} == {"bf16"}
    assert {dtype for dtype, dims in gathers if dims.count(",") == 0} == {"bf16", "f32"}  # fc's bias is cast
    assert set(ops["reduce-scatter"]["output_by_dtype"]) == {"f32"}

    monkeypatch.setattr(casts, "single_casts", lambda loss_fn, shapes, *args: jax.tree_util.tree_map(
        lambda s: None, shapes))
    before_params, before_losses, before_ops, _ = run()
    assert set(before_ops["all-gather"]["output_by_dtype"]) == {"f32"}
    assert losses == before_losses and len(losses) == 2
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, params, before_params))

    monkeypatch.undo()
    _, _, bf16_ops, _ = run(steps=[], reduce_dtype="bfloat16")
    assert set(bf16_ops["reduce-scatter"]["output_by_dtype"]) == {"bf16"}
    assert bf16_ops["reduce-scatter"]["output_bytes"] == ops["reduce-scatter"]["output_bytes"] / 2


def test_hsdp_mesh_options():
    model, tx = small_resnet(), OPTIMIZERS["sgd"]()
    assert make("hsdp", model, tx, 8).mesh.devices.shape == (2, 4)  # default R = 2
    assert make("hsdp", model, tx, 8, mesh_shape=(8, 1)).mesh.devices.shape == (8, 1)
    mesh = make_mesh(replica=4, data=2)
    s = create_strategy("hsdp", model, classifier(model), tx, mesh)
    assert s.mesh is mesh and s.shards == 2 and s.num_devices == 8  # a (replica, data) mesh is taken as is
    with pytest.raises(StrategyError, match="R\\*S = 8"):
        make("hsdp", model, tx, 8, mesh_shape=(3, 2))
    with pytest.raises(StrategyError, match="mesh_shape"):
        make("zero3", model, tx, 8, mesh_shape=(2, 4))


def test_replicate_x_shard_is_a_degree_of_the_mesh():
    """zero3 on a mesh with replica > 1 is HSDP, the same strategy as hsdp on it; a strategy without
    a replica degree refuses one in one line instead of splitting the batch over data alone."""
    model, tx = small_resnet(), OPTIMIZERS["sgd"]()
    mesh = make_mesh(replica=2, data=4)
    kept = [create_strategy(name, model, classifier(model), tx, mesh) for name in ("zero3", "hsdp")]
    for s in kept:
        assert (s.facts.name, s.batch_axes, s.num_devices, s.shards, s.mesh) == ("hsdp", ("replica", "data"), 8, 4, mesh)
    for name in ("ddp", "zero1", "zero2", "async", "dp"):
        with pytest.raises(StrategyError, match=f"^{name} has no replica degree, but the mesh has replica=2"):
            create_strategy(name, model, classifier(model), tx, mesh)


def test_mesh_shape_is_the_mesh_written_short():
    """``jaxdp train --mesh-shape R,S`` splits the data axis into the mesh's replica x data
    degrees: the same mesh as ``--mesh replica=R,data=S`` (axes beside data kept)."""
    from jaxdp.run.setup import _make_mesh
    from jaxdp.runtime.mesh import MeshError

    def layout_of(mesh):
        return dict(mesh.shape), [d.id for d in mesh.devices.flat]

    assert layout_of(_make_mesh(8, None, (2, 4))) == layout_of(_make_mesh(None, "replica=2,data=4")) == \
        ({"replica": 2, "data": 4}, list(range(8)))
    assert layout_of(_make_mesh(None, "data=4,model=2", (2, 2))) == layout_of(_make_mesh(None, "replica=2,data=2,model=2"))
    with pytest.raises(MeshError, match="R\\*S = 4"):
        _make_mesh(None, "data=4,model=2", (3, 2))


def test_hsdp_default_mesh_is_hosts_by_devices_per_host(monkeypatch):
    """Multi-host: one replica per host, shards within it (a row of the mesh is a host), in
    jaxdp and in torch_ref alike; one host: (2, N/2), odd N (1, N)."""
    from types import SimpleNamespace

    from jaxdp.strategies.zero import default_hsdp_shape
    from torch_ref.strategies import hsdp_mesh_shape

    def host_devices(hosts, per_host):
        return [SimpleNamespace(process_index=h, id=h * per_host + i) for h in range(hosts) for i in range(per_host)]

    assert default_hsdp_shape(host_devices(2, 4)) == (2, 4)
    assert default_hsdp_shape(host_devices(4, 2)) == (4, 2)
    assert default_hsdp_shape(host_devices(3, 8)) == (3, 8)
    assert default_hsdp_shape(host_devices(1, 8)) == (2, 4)
    assert default_hsdp_shape(host_devices(1, 3)) == (1, 3)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # torchrun: 3 nodes of 8 ranks
    assert hsdp_mesh_shape(None, 24) == (3, 8)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert hsdp_mesh_shape(None, 8) == (2, 4) and hsdp_mesh_shape(None, 3) == (1, 3)


# ----------------------------------------------------------------------------- checkpoints

# Each chain: 2 steps per (strategy, N), checkpoint, go on under the next. zero3 8 -> 4 -> 1 is
# the issue's case; the second moves between layouts (replicated, 2-D mesh, ZeRO-1's).
RESHARD_CHAINS = {
    "zero3-8-4-1": (("zero3", 8), ("zero3", 4), ("zero3", 1)),
    "ddp8-hsdp4-zero1x2": (("ddp", 8), ("hsdp", 4), ("zero1", 2)),
}


@pytest.mark.parametrize("chain", list(RESHARD_CHAINS))
def test_checkpoint_reshards_and_training_continues_identically(tmp_path, chain):
    """2 steps -> checkpoint -> 2 steps on the next (strategy, N) -> ... == 6 steps on the first.

    SyncBN makes the math independent of N (with per-device BN it is not, under
    any strategy: each device normalises its own slice), and each step's global
    batch is the same whatever N is.
    """
    model, tx = small_resnet(), OPTIMIZERS["adam"]()
    variables = init(model)
    batches = [random_batch(32, seed=10 + s) for s in range(6)]
    example = as_batch(*random_batch(2))
    links = RESHARD_CHAINS[chain]

    def strategy(name, n):
        units = {"units": UNITS} if name in ("zero3", "hsdp") else {}
        return make(name, model, tx, n, sync_bn=True, **units)

    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    first = strategy(*links[0])
    state, _ = run_steps(first, first.engine.init_state(variables), batches[:2])
    ckpt.save(2, first.engine.stored(state), {"step": 2})
    reference = {}
    for i, b in enumerate(batches[2:], start=3):
        state, _ = run_steps(first, state, [b])
        reference[i] = first.engine.canonical(state)

    for (name, n), (start, stop) in zip(links[1:], ((2, 4), (4, 6))):
        s = strategy(name, n)
        restored, meta = ckpt.restore(s.engine.restore_target(example))  # a target that builds nothing
        assert meta == {"step": start}
        state, _ = run_steps(s, s.engine.from_stored(restored), batches[start:stop])
        ckpt.save(stop, s.engine.stored(state), {"step": stop})
        got, ref = s.engine.canonical(state), reference[stop]
        assert int(got.step) == stop
        for part in ("params", "model_state", "opt_state"):
            assert max_rel_error(getattr(got, part), getattr(ref, part)) <= TOL, (name, n, part)
    ckpt.close()


def test_checkpoints_are_written_sharded_and_nothing_is_gathered_to_save(tmp_path):
    """The checkpoint layout is canonical shapes, each tensor cut along a dimension N divides.
    ZeRO-3 keeps every such tensor that way already, so saving moves nothing; only a tensor
    padded at rest (no dimension N divides) is stored whole, and only it is gathered."""
    from jaxdp.analysis import parse_collectives

    def collectives(strategy, state):
        ops = parse_collectives(jax.jit(strategy.engine.stored).lower(state).compile().as_text(), N)["ops"]
        return {kind: (op["count"], op["output_bytes"]) for kind, op in ops.items() if op["count"]}

    tx = OPTIMIZERS["adam"]()
    model = small_resnet(width=8, num_classes=16)  # every tensor has a dimension 8 divides
    variables = init(model)
    s = make("zero3", model, tx, N, units=UNITS)
    state = s.engine.init_state(variables)
    stored = s.engine.stored(state)
    full = layout.shapes_of((variables["params"], tx.init(variables["params"])))
    for leaf, f in zip(jax.tree_util.tree_leaves((stored.params, stored.opt_state)), jax.tree_util.tree_leaves(full),
                       strict=True):
        assert leaf.shape == f.shape
        if leaf.ndim:  # not the step counts
            assert len(leaf.addressable_shards) == N and leaf.sharding.spec == layout.spec(f.shape, N, "data")
            assert leaf.addressable_shards[0].data.size == leaf.size // N
    assert max_rel_error(s.engine.canonical(s.engine.from_stored(stored)).params, variables["params"]) == 0

    assert collectives(s, state) == {}  # ZeRO-3's own layout: a copy
    ddp = make("ddp", model, tx, N)
    assert collectives(ddp, ddp.engine.init_state(variables)) == {}  # replicated: each device cuts its chunks

    # 10 classes: the head's bias (and its two Adam moments) is padded 10 -> 16 at rest and whole on disk.
    model10 = small_resnet(width=8)
    s10 = make("zero3", model10, tx, N, units=UNITS)
    state10 = s10.engine.init_state(init(model10))
    ops = collectives(s10, state10)
    assert set(ops) == {"all-gather"} and ops["all-gather"][1] == 3 * 16 * 8, ops  # 3 f64 (16,) tensors, no more

    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    ckpt.save(1, stored, {})
    saved = ckpt._manager.item_metadata(1)["state"].tree
    assert saved["params"]["conv1"]["kernel"].shape == s.shapes["conv1"]["kernel"].shape == (3, 3, 3, 8)
    ckpt.close()


def test_train_zero3_end_to_end(tmp_path, capsys):
    from jaxdp.run.train import train as train_run

    cfg = TrainConfig(strategy="zero3", devices=4, width=4, blocks=(1, 1, 1, 1), synthetic_size=(256, 64),
                      global_batch_size=32, epochs=2, lr=0.05, out=str(tmp_path / "run"), progress=True)
    summary = train_run(cfg)
    err = capsys.readouterr().err
    # Progress (stderr is no terminal here: plain lines), with loss and images/s.
    assert "epoch 2/2: step 8/8 (loss " in err and "img_s " in err and "\r" not in err
    assert summary["steps"] == 16 and summary["eval"]["count"] == 64
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        losses = [r["loss"] for r in map(json.loads, f) if r["kind"] == "train"]
    assert np.mean(losses[-4:]) < np.mean(losses[:4])
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["16", "8"]
