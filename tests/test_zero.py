"""ZeRO-1/2/3 and HSDP against DDP (float64), checkpoint resharding, and one real training run.

DDP itself is checked against independent single-device references in
test_ddp.py; here every sharded strategy must reproduce DDP step for step:
params, loss, BN running stats, averaged gradients and, through ``canonical``,
the optimizer state, to a relative error <= 1e-12.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import functools  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from helpers import init, max_rel_error, random_batch  # noqa: E402

from jaxdp.checkpoint import Checkpointer  # noqa: E402
from jaxdp.config import TrainConfig  # noqa: E402
from jaxdp.mesh import make_mesh  # noqa: E402
from jaxdp.models import create_model  # noqa: E402
from jaxdp.models.resnet import BasicBlock, ResNet  # noqa: E402
from jaxdp.optim import make_optimizer  # noqa: E402
from jaxdp.strategies import StrategyError, create_strategy  # noqa: E402
from jaxdp.strategies.units import apply_units, model_units  # noqa: E402

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
# 4 samples per device: BN over fewer samples of a small map is too ill-conditioned for 1e-12.
BATCHES = [random_batch(4 * N, seed=s) for s in range(STEPS)]


def small_resnet():
    """Stem, a plain block, a strided block with a downsample, head: every kind of
    ZeRO-3 unit, at half the compile time of the four-stage tiny ResNet-18."""
    return ResNet(block=BasicBlock, stage_sizes=(1, 1), width=4, dtype=jnp.float64, param_dtype=jnp.float64)


def train(name, opt, n=N, batches=BATCHES, **options):
    """Canonical state after ``batches`` and each step's metrics (with the averaged grads)."""
    model = small_resnet()
    strategy = create_strategy(name, model, OPTIMIZERS[opt](), make_mesh(n), return_grads=True,
                               **MODES[opt], **options)
    state = strategy.init_state(init(model))
    history = []
    for x, y in batches:
        state, metrics = strategy.step(state, *strategy.shard_batch(x, y))
        history.append(metrics)
    return strategy.canonical(state), history


@functools.lru_cache(maxsize=None)
def ddp(opt):
    return train("ddp", opt)


def assert_same_training(got, ref):
    (state, history), (ref_state, ref_history) = got, ref
    assert int(state.step) == int(ref_state.step) == STEPS
    assert max_rel_error(state.params, ref_state.params) <= TOL
    assert max_rel_error(state.batch_stats, ref_state.batch_stats) <= TOL
    # canonical() must give DDP's optimizer-state tree, not just close numbers.
    assert jax.tree_util.tree_structure(state.opt_state) == jax.tree_util.tree_structure(ref_state.opt_state)
    assert max_rel_error(state.opt_state, ref_state.opt_state) <= TOL
    for m, r in zip(history, ref_history):
        assert abs(float(m["loss"]) - float(r["loss"])) <= TOL * abs(float(r["loss"]))
        assert max_rel_error(m["loss_per_device"], r["loss_per_device"]) <= TOL
        assert max_rel_error(m["grads"], r["grads"]) <= TOL


CASES = [("zero1", {}), ("zero2", {}), ("zero3", {}),
         ("hsdp", {"mesh_shape": (2, 4)}), ("hsdp", {"mesh_shape": (4, 2)})]


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=["sgd-syncbn-accum2", "adam"])
@pytest.mark.parametrize("name,options", CASES, ids=["zero1", "zero2", "zero3", "hsdp2x4", "hsdp4x2"])
def test_equals_ddp(name, options, opt):
    """sgd: SyncBN and 2 micro-batches (ZeRO-3 reduce-scatters each, DDP reduces once: the
    same sum); adam: DDP's BN buffers (device 0's running stats), no accumulation."""
    assert_same_training(train(name, opt, **options), ddp(opt))


@pytest.mark.parametrize("name,options", [("zero3", {}), ("hsdp", {"mesh_shape": (2, 4)})])
def test_evaluation_gathers_one_tensor_at_a_time_and_equals_ddp(name, options):
    """ZeRO-3's evaluation runs the model unit by unit like its training step: one all-gather
    per parameter tensor, never the whole model in one, and DDP's numbers."""
    from jaxdp.inspect import parse_collectives

    model, tx = small_resnet(), OPTIMIZERS["sgd"]()
    variables = init(model)
    x, y = random_batch(4 * N, seed=99)
    mask = np.ones(4 * N, bool)
    ref = create_strategy("ddp", model, tx, make_mesh(N))
    s = create_strategy(name, model, tx, make_mesh(N), **options)
    state = s.init_state(variables)
    got = s.evaluate(state, *s.shard_batch(x, y, mask))
    want = ref.evaluate(ref.init_state(variables), *ref.shard_batch(x, y, mask))
    for key in ("loss_sum", "correct", "count"):
        assert abs(float(got[key]) - float(want[key])) <= TOL * abs(float(want[key])), key
    hlo = s._jit_eval.lower(state, *s.shard_batch(x, y, mask)).compile().as_text()
    gathers = parse_collectives(hlo, N)["ops"]["all-gather"]["count"]
    assert gathers == len(jax.tree_util.tree_leaves(variables["params"]))


def test_state_is_sharded_as_zero_says():
    model = small_resnet()
    variables = init(model)
    for name, sharded in [("zero1", ("opt",)), ("zero2", ("opt",)), ("zero3", ("params", "opt"))]:
        strategy = create_strategy(name, model, OPTIMIZERS["adam"](), make_mesh(N))
        state = strategy.init_state(variables)
        for part, tree in (("params", state.params), ("opt", state.opt_state)):
            for x in jax.tree_util.tree_leaves(tree):
                whole = x.ndim == 0 or part not in sharded
                assert x.addressable_shards[0].data.size == (x.size if whole else x.size // N), (name, part)


def test_units_compose_to_the_model():
    """ZeRO-3's unit-by-unit forward is model.apply, bit for bit. The cifar stem and basic
    blocks are covered by test_equals_ddp; this takes the imagenet stem (maxpool), bottleneck
    blocks and a stage's second (stride-1) block."""
    model = create_model("resnet50", width=4, blocks=(2, 1, 1, 1), stem="imagenet", dtype="float64")
    variables = init(model, size=32)
    x = random_batch(4, size=32)[0]
    logits, updated = jax.jit(lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"]))(variables, x)
    split = jax.jit(lambda v, x: apply_units(model_units(model), v["params"], v["batch_stats"], x, True))
    split_logits, split_stats = split(variables, x)
    np.testing.assert_array_equal(split_logits, logits)
    assert max_rel_error(split_stats, updated["batch_stats"]) == 0


def test_hsdp_mesh_options():
    model, tx = small_resnet(), OPTIMIZERS["sgd"]()
    assert create_strategy("hsdp", model, tx, make_mesh(8)).mesh.devices.shape == (2, 4)  # default R = 2
    assert create_strategy("hsdp", model, tx, make_mesh(8), mesh_shape=(8, 1)).mesh.devices.shape == (8, 1)
    with pytest.raises(StrategyError, match="R\\*S = 8"):
        create_strategy("hsdp", model, tx, make_mesh(8), mesh_shape=(3, 2))
    with pytest.raises(StrategyError, match="bucket_cap_mb"):
        create_strategy("zero3", model, tx, make_mesh(8), bucket_cap_mb=1.0)  # zero3 moves per unit


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
    links = RESHARD_CHAINS[chain]

    def strategy(name, n):
        return create_strategy(name, model, tx, make_mesh(n), sync_bn=True)

    def run(s, state, chunk):
        for x, y in chunk:
            state, _ = s.step(state, *s.shard_batch(x, y))
        return state

    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    first = strategy(*links[0])
    state = run(first, first.init_state(variables), batches[:2])
    ckpt.save(2, first.stored(state), {"step": 2})
    reference = {}
    for i, b in enumerate(batches[2:], start=3):
        state = run(first, state, [b])
        reference[i] = first.canonical(state)

    for (name, n), (start, stop) in zip(links[1:], ((2, 4), (4, 6))):
        s = strategy(name, n)
        restored, meta = ckpt.restore(s.stored_target(s.init_state(variables)))
        assert meta == {"step": start}
        state = run(s, s.from_stored(restored), batches[start:stop])
        ckpt.save(stop, s.stored(state), {"step": stop})
        got, ref = s.canonical(state), reference[stop]
        assert int(got.step) == stop
        for part in ("params", "batch_stats", "opt_state"):
            assert max_rel_error(getattr(got, part), getattr(ref, part)) <= TOL, (name, n, part)
    ckpt.close()


def test_checkpoints_are_written_sharded_and_nothing_is_gathered_to_save(tmp_path):
    """ZeRO-3's state goes to disk as it lives on the devices: every param and optimizer
    leaf a flat array in 8 chunks, and the conversion to the checkpoint layout moves no data."""
    from jaxdp.inspect import parse_collectives

    model, tx = small_resnet(), OPTIMIZERS["adam"]()
    s = create_strategy("zero3", model, tx, make_mesh(N))
    state = s.init_state(init(model))
    stored = s.stored(state)
    for leaf in jax.tree_util.tree_leaves((stored.params, stored.opt_state)):
        if leaf.ndim:  # not the step counts
            assert leaf.ndim == 1 and len(leaf.addressable_shards) == N
            assert leaf.addressable_shards[0].data.size == leaf.size // N

    def collectives(strategy, state):
        ops = parse_collectives(jax.jit(strategy.stored).lower(state).compile().as_text(), N)["ops"]
        return {kind: op["count"] for kind, op in ops.items() if op["count"]}

    assert collectives(s, state) == {}  # ZeRO-3's own layout: a copy
    ddp = create_strategy("ddp", model, tx, make_mesh(N))
    assert collectives(ddp, ddp.init_state(init(model))) == {}  # replicated: each device cuts its chunks

    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    ckpt.save(1, stored, {})
    saved = ckpt._manager.item_metadata(1)["state"].tree
    kernel = saved["params"]["conv1"]["kernel"]
    assert kernel.shape == (flat_padded(s.shapes["conv1"]["kernel"].shape, N),)
    ckpt.close()


def flat_padded(shape, n):
    size = int(np.prod(shape))
    return -(-size // n) * n


def test_train_zero3_end_to_end(tmp_path, capsys):
    from jaxdp.train import train as train_run

    cfg = TrainConfig(strategy="zero3", devices=4, width=4, blocks=(1, 1, 1, 1), synthetic_size=(256, 64),
                      global_batch_size=32, epochs=2, lr=0.05, out=str(tmp_path / "run"), progress=True)
    summary = train_run(cfg)
    err = capsys.readouterr().err
    assert "epoch 2/2: 100%" in err and "img_s=" in err  # the progress bar, with loss and images/s
    assert summary["steps"] == 16 and summary["eval"]["count"] == 64
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        losses = [r["loss"] for r in map(json.loads, f) if r["kind"] == "train"]
    assert np.mean(losses[-4:]) < np.mean(losses[:4])
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["16", "8"]
