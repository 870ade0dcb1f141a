"""Gradient compression: torch's bf16/fp16 hooks against numpy, PowerSGD against torch's own hook and numpy."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pickle  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from helpers import TinyConvNet, max_rel_error, numpy_init as init, random_batch  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxdp.strategies.sync.ring import ring_all_reduce  # noqa: E402
from jaxdp.strategies.sync.low_precision import low_precision_reduce  # noqa: E402
from jaxdp.strategies.sync.powersgd import PowerSGD  # noqa: E402
from jaxdp.runtime.mesh import make_mesh  # noqa: E402
from jaxdp.strategies import create_strategy  # noqa: E402
from jaxdp.loss.task import classifier, cross_entropy  # noqa: E402

pytestmark = pytest.mark.float64  # exact comparisons in float64 (conftest turns x64 on)

BF16, F16 = ml_dtypes.bfloat16, np.float16


def shard_grads(model, params, x, y, n):
    grad = jax.jit(jax.grad(lambda p, xs, ys: cross_entropy(model.apply({"params": p}, xs), ys)))
    return [grad(params, xs, ys) for xs, ys in zip(np.split(x, n), np.split(y, n))]


def hook_parts(grads, low):
    """What each rank puts on the wire: ``buffer.to(low).div_(N)``.

    The cast goes through float32, as torch converts float64 (c10's Half/BFloat16 take a
    float; jaxdp's hook does the same explicitly); ATen
    divides reduced floats in float32 and rounds once, which is the exactly rounded
    quotient (it is never a tie). With N = 2 or 4 the division is exact, wherever it
    happens: only N = 3, 6, ... can tell the orders of cast and division apart."""
    n = len(grads)
    return [(np.asarray(g).astype(np.float32).astype(low).astype(np.float32) / np.float32(n)).astype(low)
            for g in grads]


def hook_math(grads, low, hop_rounding: bool):
    """torch's compress hook on numpy: buffer.to(low).div_(N), SUM, .to(orig).

    hop_rounding: round to ``low`` after every addition, in device order (gloo, NCCL,
    and XLA:CPU's fp16 all-reduce); else add exactly and round once (XLA:CPU promotes
    a bf16 all-reduce to f32).
    """
    parts = hook_parts(grads, low)
    if hop_rounding:
        total = parts[0]
        for p in parts[1:]:
            total = (total + p).astype(low)
    else:
        total = np.sum([p.astype(np.float64) for p in parts], axis=0).astype(low)
    return total.astype(np.asarray(grads[0]).dtype)


def batch(x, y):
    return {"image": x, "label": y}


def ddp_reduced_grads(model, variables, x, y, n, **options):
    strategy = create_strategy("ddp", model, classifier(model), optax.sgd(0.0), make_mesh(n), return_grads=True,
                               **options)
    state = strategy.engine.init_state(variables)
    return strategy.engine.step(state, strategy.engine.shard_batch(batch(x, y)))[1]["grads"]


@pytest.mark.parametrize("compress,low", [("bf16", BF16), ("fp16", F16)])
def test_low_precision_hook_equals_numpy_hook_math(compress, low):
    """DDP's hook, bit for bit, with XLA:CPU's all-reduce rounding (see sync/low_precision.py):
    bf16 rounds once, fp16 at every hop in device order. N = 3 pins the division by N
    in low precision (a division before the cast, or after the cast back, differs)."""
    model = TinyConvNet()
    variables = init(model)
    x, y = random_batch(24)
    for n in (2, 3, 4):
        got = ddp_reduced_grads(model, variables, x, y, n, compress=compress)
        per_shard = shard_grads(model, variables["params"], x, y, n)
        for path, g in jax.tree_util.tree_leaves_with_path(got):
            shards = [np.asarray(_at(s, path)) for s in per_shard]
            want = hook_math(shards, low, hop_rounding=low is F16)
            np.testing.assert_array_equal(np.asarray(g), want, err_msg=f"N={n} {path}")


def exact_sum(x, axis):
    """A SUM that does not round (float64 holds any sum of a few bf16/fp16 values exactly)."""
    return jax.lax.psum(x.astype(jnp.float64), axis)


@pytest.mark.parametrize("low", [BF16, F16])
@pytest.mark.parametrize("n", [3, 6])
def test_low_precision_reduce_divides_by_n_after_the_cast(n, low):
    """The hook's own arithmetic, whatever the all-reduce's rounding: with a SUM that does
    not round, the result is exactly the sum of the wire values ``fl(fl(g) / N)``."""
    x = np.random.default_rng(n).normal(size=(n, 512))
    f = jax.jit(jax.shard_map(
        lambda v: low_precision_reduce(v[0], jnp.dtype(low), n, "data", exact_sum)[None],
        mesh=make_mesh(n), in_specs=P("data"), out_specs=P("data")))
    got = np.asarray(f(x))[0]
    want = np.sum([p.astype(np.float64) for p in hook_parts(list(x), low)], axis=0)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n", [3, 6])
def test_bf16_ring_rounds_at_every_hop_in_ring_order(n):
    length = 13
    x = np.random.default_rng(1).normal(size=(n, length))
    f = jax.jit(jax.shard_map(
        lambda v: low_precision_reduce(v[0], jnp.bfloat16, n, "data", ring_all_reduce)[None],
        mesh=make_mesh(n), in_specs=P("data"), out_specs=P("data"), check_vma=False))
    got = np.asarray(f(x))[0]
    # Chunk c (of ceil(13 / n) elements, zero-padded) is summed from device c+1 round to c.
    parts = np.stack(hook_parts(list(x), BF16))
    size = -(-length // n)
    want = np.zeros(length)
    for c in range(n):
        sl = slice(size * c, min(size * c + size, length))
        acc = parts[(c + 1) % n, sl]
        for d in range(2, n + 1):
            acc = (acc + parts[(c + d) % n, sl]).astype(BF16)
        want[sl] = acc.astype(np.float64)
    np.testing.assert_array_equal(got, want)


# ----------------------------------------------------------------------------- PowerSGD

def _at(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


def to_torch(x):
    x = np.asarray(x)
    return x.transpose(3, 2, 0, 1) if x.ndim == 4 else (x.T if x.ndim == 2 else x)


def from_torch(x, ndim):
    return x.transpose(2, 3, 1, 0) if ndim == 4 else (x.T if ndim == 2 else x)


def gram_schmidt(m):
    m = m.copy()
    for i in range(m.shape[1]):
        m[:, i] /= np.linalg.norm(m[:, i])
        for j in range(i + 1, m.shape[1]):
            m[:, j] -= (m[:, i] @ m[:, j]) * m[:, i]
    return m


def numpy_powersgd(grads, errors, qs, rank, rate=2):
    """One PowerSGD step on N ranks' {name: torch-layout grad}: (output, new errors, new qs)."""
    n = len(grads)
    xs = [{k: g[k] + e[k] for k in g} for g, e in zip(grads, errors)]
    out, new_qs = {}, {}
    for k in grads[0]:
        ms = [x[k].reshape(x[k].shape[0], -1) for x in xs]
        rows, cols = ms[0].shape
        r = min(rows, cols, rank)
        if (rows + cols) * r * rate < rows * cols:
            q = gram_schmidt(qs[k])
            p = gram_schmidt(sum(m @ q for m in ms))
            new_qs[k] = sum(m.T @ p for m in ms) / n
            out[k] = (p @ new_qs[k].T).reshape(xs[0][k].shape)
        else:
            out[k] = sum(x[k] for x in xs) / n
    return out, [{k: x[k] - out[k] for k in x} for x in xs], new_qs


def test_ddp_powersgd_matches_numpy_reference_with_error_feedback():
    model, n, steps, start = TinyConvNet(), 2, 5, 2
    variables = init(model)
    tx = optax.sgd(0.1, momentum=0.9)
    batches = [random_batch(8, seed=s) for s in range(steps)]
    rng = np.random.default_rng(7)
    q0 = {"Conv_0.kernel": rng.normal(size=(27, 1)), "Dense_0.kernel": rng.normal(size=(4, 1))}

    strategy = create_strategy("ddp", model, classifier(model), tx, make_mesh(n), compress="powersgd",
                               powersgd_rank=1, powersgd_options={"start_iter": start, "initial_q": q0})
    state = strategy.engine.init_state(variables)
    for x, y in batches:
        state, _ = strategy.engine.step(state, strategy.engine.shard_batch(batch(x, y)))

    params, opt_state, qs = variables["params"], tx.init(variables["params"]), dict(q0)
    errors = [{k: 0.0 for k in ("Conv_0.kernel", "Conv_0.bias", "Dense_0.kernel", "Dense_0.bias")}] * n
    update = jax.jit(tx.update)
    for t, (x, y) in enumerate(batches):
        shards = [{f"{m}.{leaf}": to_torch(g[m][leaf]) for m in g for leaf in g[m]}
                  for g in shard_grads(model, params, x, y, n)]
        if t < start:  # vanilla: DDP's average; nothing else changes
            out = {k: sum(s[k] / n for s in shards) for k in shards[0]}
        else:
            out, errors, qs = numpy_powersgd(shards, errors, qs, rank=1)
        grads = {m: {leaf: from_torch(out[f"{m}.{leaf}"], params[m][leaf].ndim) for leaf in params[m]} for m in params}
        updates, opt_state = update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)

    assert max_rel_error(state.params, params) <= 1e-12
    assert max_rel_error(state.extra["q"], qs) <= 1e-12
    ours = _flat(state.extra["error"])
    for r in range(n):  # each device's own error, the uncompressed biases' included
        want = {k: from_torch(errors[r][k], v.ndim - 1) for k, v in ours.items()}
        assert max_rel_error({k: v[r] for k, v in ours.items()}, want) <= 1e-12


def _flat(tree):
    return {".".join(k.key for k in path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("name", ["ddp", "zero1"])
def test_powersgd_resumes_on_another_device_count_from_the_mean_error(tmp_path, name):
    """Checkpointed on 4 devices after two compressed steps, resumed on 2: each of the 2
    devices starts with the 4 devices' mean error and Q as saved (the rule in
    sync/powersgd.py's docstring), and the next three steps are the uninterrupted 4-device
    run's: params, optimizer state, Q and mean error within 1e-12 (float64). Resumed with
    zero errors instead, the run is another one: the saved errors carry real state."""
    from jaxdp.checkpoint import Checkpointer

    model, start = TinyConvNet(), 2
    variables = {"params": init(model)["params"]}  # model_state {}, as abstract_state's model.init has it
    tx = optax.sgd(0.1, momentum=0.9)
    batches = [batch(*random_batch(8, seed=s)) for s in range(7)]
    rng = np.random.default_rng(7)
    q0 = {"Conv_0.kernel": rng.normal(size=(27, 1)), "Dense_0.kernel": rng.normal(size=(4, 1))}

    def make(n):
        return create_strategy(name, model, classifier(model), tx, make_mesh(n), compress="powersgd",
                               powersgd_rank=1, powersgd_options={"start_iter": start, "initial_q": q0})

    def run(strategy, state, steps):
        for b in steps:
            state, _ = strategy.engine.step(state, strategy.engine.shard_batch(b))
        return strategy.engine.canonical(state)

    def mean_error(state):
        return {k: np.asarray(e).mean(0) for k, e in _flat(state.extra["error"]).items()}

    four = make(4)
    state = run(four, four.engine.init_state(variables), batches[:4])  # steps 3 and 4 compressed
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(4, four.engine.stored(state), {})
    saved_error, saved_q = mean_error(state), jax.tree_util.tree_map(np.asarray, state.extra["q"])
    assert all(np.abs(saved_error[k]).max() > 1e-3 for k in ("Conv_0.kernel", "Dense_0.kernel"))
    reference = run(four, four.engine.from_canonical(state), batches[4:])

    two = make(2)  # restored as jaxdp train restores: into shapes and shardings only
    stored, _ = ckpt.restore(two.engine.restore_target(batches[0]))
    ckpt.close()
    resumed = two.engine.canonical(two.engine.from_stored(stored))
    assert int(resumed.step) == 4
    for k, e in _flat(resumed.extra["error"]).items():  # the rule: every device gets the mean
        assert e.shape == (2,) + saved_error[k].shape
        for d in range(2):
            np.testing.assert_array_equal(np.asarray(e[d]), saved_error[k], err_msg=k)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, resumed.extra["q"], saved_q))

    after = run(two, two.engine.from_canonical(resumed), batches[4:])
    assert max_rel_error(after.params, reference.params) <= 1e-12
    assert max_rel_error(after.opt_state, reference.opt_state) <= 1e-12
    assert max_rel_error(after.extra["q"], reference.extra["q"]) <= 1e-12
    want = mean_error(reference)
    scale = max(np.abs(e).max() for e in want.values())
    assert max(np.abs(e - want[k]).max() for k, e in mean_error(after).items()) <= 1e-12 * scale

    zeroed = resumed.replace(extra={**resumed.extra, "error": jax.tree_util.tree_map(
        np.zeros_like, resumed.extra["error"])})
    assert max_rel_error(run(two, two.engine.from_canonical(zeroed), batches[4:]).params, reference.params) > 1e-6


# --- torch's own powerSGD_hook, on 2 gloo ranks, fed the same gradients ----------------------

TORCH_WORKER = textwrap.dedent('''
    import pickle, sys
    from collections import defaultdict
    import torch, torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    rank, world, store, src, dst = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
    torch.set_num_threads(1)

    class Bucket:  # what DDP hands a comm hook: one flat buffer and views of it per parameter
        def __init__(self, buffer, shapes):
            self._buffer, self._views, offset = buffer, [], 0
            for shape in shapes:
                size = int(torch.Size(shape).numel())
                self._views.append(buffer[offset:offset + size].view(shape))
                offset += size
        def buffer(self): return self._buffer
        def gradients(self): return self._views
        def index(self): return 0
        def is_last(self): return True

    results = []
    for cfg in pickle.load(open(src, "rb")):
        order, shapes = cfg["order"], cfg["shapes"]
        state = ps.PowerSGDState(None, matrix_approximation_rank=cfg["rank"], start_powerSGD_iter=cfg["start"],
                                 use_error_feedback=cfg["ef"], warm_start=True)
        # Inject the initial Qs where the hook keeps them: grouped by shape, in bucket order.
        groups = defaultdict(list)
        for name in order:
            n, m = shapes[name][0], int(torch.Size(shapes[name]).numel()) // shapes[name][0]
            r = min(n, m, cfg["rank"])
            if ps._should_compress(n, m, r, state.min_compression_rate)[0]:
                groups[(n, m)].append(name)
        names = [name for group in groups.values() for name in group]
        state.q_memory_dict[0] = torch.cat([torch.from_numpy(cfg["q0"][k]).reshape(-1) for k in names])
        p_size = sum(shapes[k][0] * cfg["q0"][k].shape[1] for k in names)
        state.p_memory_dict[0] = torch.empty(p_size, dtype=torch.float64)
        steps = []
        for grads in cfg["grads"]:
            flat = torch.cat([torch.from_numpy(grads[rank][k]).reshape(-1) for k in order])
            out = ps.powerSGD_hook(state, Bucket(flat, [shapes[k] for k in order])).wait()
            error = state.error_dict.get(0)
            views = lambda t: Bucket(t, [shapes[k] for k in order]).gradients()
            split = lambda t: {k: v.clone().numpy() for k, v in zip(order, views(t))}
            steps.append({"out": split(out), "error": split(error) if error is not None else None})
        results.append(steps)
    pickle.dump(results, open(dst, "wb"))
    dist.barrier()  # without it, a rank tearing down gloo early can abort the other ("Resource deadlock avoided")
    dist.destroy_process_group()
''')


def run_torch_hook(configs, world, tmp_path):
    src = tmp_path / "in.pkl"
    src.write_bytes(pickle.dumps(configs))
    procs = [subprocess.Popen([sys.executable, "-c", TORCH_WORKER, str(r), str(world), str(tmp_path / "store"),
                               str(src), str(tmp_path / f"out{r}.pkl")], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
             for r in range(world)]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out.decode()[-3000:]
    return [pickle.loads((tmp_path / f"out{r}.pkl").read_bytes()) for r in range(world)]


def test_powersgd_matches_torch_powerSGD_hook(tmp_path):
    pytest.importorskip("torch")
    n, iters, start = 2, 5, 2
    shapes = {"conv_a.kernel": (3, 3, 4, 8), "conv_b.kernel": (3, 3, 4, 8), "fc.kernel": (16, 10),
              "fc.bias": (10,), "small.kernel": (2, 2), "bn.scale": (8,)}
    tree = {}
    for name, shape in shapes.items():
        module, leaf = name.split(".")
        tree.setdefault(module, {})[leaf] = np.zeros(shape)
    rng = np.random.default_rng(0)
    # (rank, error feedback): Gram-Schmidt (r <= 2) and Householder QR (r > 2); EF on and off.
    variants = [(1, True), (3, True), (2, False)]
    configs, jax_runs = [], []
    for rank, ef in variants:
        grads = [[{k: rng.normal(size=s) for k, s in shapes.items()} for _ in range(n)] for _ in range(iters)]
        compressed = PowerSGD(rank, start_iter=start).plan(tree)
        q0 = {k: rng.normal(size=(int(np.prod(shapes[k])) // shapes[k][-1], r)) for k, r in compressed.items()}
        configs.append({"rank": rank, "ef": ef, "start": start, "q0": q0,
                        "order": list(reversed(list(shapes))),  # any bucket order: the math is per tensor
                        "shapes": {k: to_torch(np.zeros(s)).shape for k, s in shapes.items()},
                        "grads": [[{k: to_torch(g[k]) for k in shapes} for g in it] for it in grads]})
        jax_runs.append(_jax_powersgd(PowerSGD(rank, start_iter=start, use_error_feedback=ef, initial_q=q0),
                                      tree, grads, n))
    torch_runs = run_torch_hook(configs, n, tmp_path)

    for v, ((rank, ef), ours) in enumerate(zip(variants, jax_runs)):
        for it in range(iters):
            for k, s in shapes.items():
                want = from_torch(torch_runs[0][v][it]["out"][k], len(s))
                got = ours[it]["out"][k]
                assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max(), (rank, it, k)
                if ef and it >= start:
                    for r in range(n):
                        want = from_torch(torch_runs[r][v][it]["error"][k], len(s))
                        assert np.abs(ours[it]["error"][k][r] - want).max() <= 1e-12 * np.abs(want).max()


def _jax_powersgd(powersgd, tree, grads, n):
    """Run PowerSGD.reduce on n devices over the iterations' per-device gradients."""
    mesh = make_mesh(n)
    axis = "data"
    extra = powersgd.init(tree, n)
    specs = powersgd.specs(axis)

    def step(g, extra, t):
        g = jax.tree_util.tree_map(lambda x: x[0], g)
        vanilla = lambda g: jax.tree_util.tree_map(lambda x: jax.lax.psum(x / n, axis), g)  # noqa: E731
        return powersgd.reduce(g, extra, t, axis, jax.lax.psum, vanilla)

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(axis), specs, P()), out_specs=(P(), specs)))
    runs = []
    for t, per_device in enumerate(grads):
        stacked = {}
        for name in per_device[0]:
            module, leaf = name.split(".")
            stacked.setdefault(module, {})[leaf] = np.stack([d[name] for d in per_device])
        out, extra = fn(stacked, extra, jnp.asarray(t))
        runs.append({"out": _flat(out), "error": _flat(extra["error"]) if "error" in extra else None})
    return runs
