"""jaxdp.optim against torch.optim and torch.optim.lr_scheduler, float64, step by step.

Relative error of a tensor is max|a - b| / max|b| (inf-norm): elementwise ratios are
meaningless for moments that pass near zero (torch's lerp and optax's b*m + (1-b)*g round
differently, which is a few ulp of the *tensor's* scale, not of each element).
"""

import jax
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from jaxdp.optim import (  # noqa: E402
    OPTIMIZERS,
    SCHEDULES,
    ConfigError,
    make_optimizer,
    make_schedule,
    torch_lr_lambda,
)
from parity_tests.optim_state import optimizer_state_from_torch, torch_optimizer_state  # noqa: E402

pytestmark = pytest.mark.float64  # exact comparisons in float64 (conftest turns x64 on)

TOL = 1e-12
STEPS = 20
SHAPES = {"conv": {"kernel": (3, 3, 2, 4)}, "dense": {"bias": (5,), "kernel": (6, 5)},
          "scale": ()}

# name -> (make_optimizer kwargs, torch class, torch kwargs)
OPT_CONFIGS = {
    "sgd_plain": ("sgd", dict(momentum=0.0), torch.optim.SGD, dict(momentum=0.0)),
    "sgd_plain_wd": ("sgd", dict(momentum=0.0, weight_decay=5e-4), torch.optim.SGD,
                     dict(momentum=0.0, weight_decay=5e-4)),
    "sgd_momentum": ("sgd", dict(momentum=0.9), torch.optim.SGD, dict(momentum=0.9)),
    "sgd_momentum_wd": ("sgd", dict(momentum=0.9, weight_decay=5e-4), torch.optim.SGD,
                        dict(momentum=0.9, weight_decay=5e-4)),
    "sgd_nesterov_wd": ("sgd", dict(momentum=0.9, nesterov=True, weight_decay=5e-4),
                        torch.optim.SGD, dict(momentum=0.9, nesterov=True, weight_decay=5e-4)),
    "adam": ("adam", dict(), torch.optim.Adam, dict()),
    "adam_wd": ("adam", dict(weight_decay=1e-2, betas=(0.8, 0.99), eps=1e-6), torch.optim.Adam,
                dict(weight_decay=1e-2, betas=(0.8, 0.99), eps=1e-6)),
    "adamw_1e-2": ("adamw", dict(weight_decay=1e-2), torch.optim.AdamW,
                   dict(weight_decay=1e-2)),
    "adamw_0.1": ("adamw", dict(weight_decay=0.1), torch.optim.AdamW, dict(weight_decay=0.1)),
}
BASE_LR = {"sgd": 0.1, "adam": 1e-2, "adamw": 1e-2}

# schedule name -> (make_schedule kwargs, torch scheduler factory(opt, base_lr))
SCHED_CONFIGS = {
    "constant": (dict(), None),
    "cosine": (dict(min_lr=1e-4), lambda o, lr: torch.optim.lr_scheduler.CosineAnnealingLR(
        o, T_max=STEPS, eta_min=1e-4)),
    "multistep": (dict(milestones=(5, 12, 12), gamma=0.5),
                  lambda o, lr: torch.optim.lr_scheduler.MultiStepLR(
                      o, milestones=[5, 12, 12], gamma=0.5)),
    "warmup_cosine": (dict(warmup_steps=4, min_lr=1e-4), None),  # LambdaLR, see _torch_sched
}


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.max(np.abs(b)) if b.size else 0.0
    err = np.max(np.abs(a - b)) if b.size else 0.0
    return err / scale if scale > 0 else err


def random_tree(rng):
    return jax.tree.map(lambda s: rng.standard_normal(s), SHAPES,
                        is_leaf=lambda x: isinstance(x, tuple))


def _torch_sched(sched_name, opt, base_lr):
    kw, factory = SCHED_CONFIGS[sched_name]
    if sched_name == "constant":
        return None
    if factory is not None:
        return factory(opt, base_lr)
    return torch.optim.lr_scheduler.LambdaLR(opt, torch_lr_lambda(sched_name, base_lr, STEPS, **kw))


class Pair:
    """torch.optim and the optax chain, fed the same params and gradients."""

    def __init__(self, cfg, sched_name, params0, use_jit=True):
        name, kw, tcls, tkw = OPT_CONFIGS[cfg]
        self.name = name
        base_lr = BASE_LR[name]
        skw = SCHED_CONFIGS[sched_name][0]
        lr = base_lr if sched_name == "constant" else make_schedule(sched_name, base_lr, STEPS, **skw)
        self.tx = make_optimizer(name, lr, **kw)
        self.params = jax.tree.map(jnp.asarray, params0)
        self.state = self.tx.init(self.params)
        leaves, self.treedef = jax.tree.flatten(params0)
        self.tparams = [torch.nn.Parameter(torch.tensor(x)) for x in leaves]
        self.topt = tcls(self.tparams, lr=base_lr, **tkw)
        self.tsched = _torch_sched(sched_name, self.topt, base_lr)

        def step(params, state, grads):
            updates, state = self.tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        self._step = jax.jit(step) if use_jit else step

    def step(self, grads):
        for p, g in zip(self.tparams, jax.tree.leaves(grads)):
            p.grad = torch.tensor(g)
        self.topt.step()
        if self.tsched is not None:
            self.tsched.step()
        self.params, self.state = self._step(self.params, self.state,
                                             jax.tree.map(jnp.asarray, grads))

    def torch_tree(self, fn):
        return jax.tree.unflatten(self.treedef, [fn(p) for p in self.tparams])

    def torch_state(self):
        """torch's opt.state as the dict-of-trees torch_optimizer_state returns."""
        states = [self.topt.state[p] for p in self.tparams]
        keys = set(states[0])
        assert all(set(s) == keys for s in states)
        out = {k: jax.tree.unflatten(self.treedef, [s[k].detach().numpy().copy() for s in states])
               for k in keys if k != "step"}
        if "step" in keys:
            steps = {float(s["step"]) for s in states}
            assert len(steps) == 1
            out["step"] = int(steps.pop())
        return out

    def check(self, where):
        tp = self.torch_tree(lambda p: p.detach().numpy())
        for path, a, b in zip(jax.tree_util.tree_leaves_with_path(self.params),
                              jax.tree.leaves(self.params), jax.tree.leaves(tp)):
            assert rel(a, b) <= TOL, f"{where} param {jax.tree_util.keystr(path[0])}: {rel(a, b):.3g}"
        ours = torch_optimizer_state(self.name, self.state)
        theirs = self.torch_state()
        assert set(ours) == set(theirs), (where, set(ours), set(theirs))
        for key in theirs:
            if key == "step":
                assert ours["step"] == theirs["step"], where
                continue
            for a, b in zip(jax.tree.leaves(ours[key]), jax.tree.leaves(theirs[key])):
                assert rel(a, b) <= TOL, f"{where} {key}: {rel(a, b):.3g}"


def grad_sequence(seed, n):
    rng = np.random.default_rng(seed)
    return [random_tree(rng) for _ in range(n)]


# Every optimizer config with a constant lr and with one schedule each (rotating through the
# non-constant schedules so each optimizer family meets each schedule at least once).
_ROTATE = {"sgd_plain": "multistep", "sgd_plain_wd": "cosine", "sgd_momentum": "warmup_cosine",
           "sgd_momentum_wd": "cosine", "sgd_nesterov_wd": "multistep", "adam": "warmup_cosine",
           "adam_wd": "cosine", "adamw_1e-2": "multistep", "adamw_0.1": "warmup_cosine"}
CASES = [(c, "constant") for c in OPT_CONFIGS] + [(c, s) for c, s in _ROTATE.items()]


@pytest.mark.parametrize("cfg,sched", CASES, ids=[f"{c}-{s}" for c, s in CASES])
def test_matches_torch_every_step(cfg, sched):
    params0 = random_tree(np.random.default_rng(0))
    pair = Pair(cfg, sched, params0)
    for t, g in enumerate(grad_sequence(1, STEPS)):
        pair.step(g)
        pair.check(f"step {t}")


def test_matches_torch_without_jit():
    # The eager path (op by op) must agree as well, not only the compiled one.
    params0 = random_tree(np.random.default_rng(0))
    pair = Pair("adamw_0.1", "cosine", params0, use_jit=False)
    for t, g in enumerate(grad_sequence(2, 3)):
        pair.step(g)
        pair.check(f"step {t}")


@pytest.mark.parametrize("cfg,sched", [("sgd_nesterov_wd", "multistep"), ("adam_wd", "cosine"),
                                       ("adamw_1e-2", "warmup_cosine")])
def test_load_torch_state_and_continue(cfg, sched):
    params0 = random_tree(np.random.default_rng(3))
    grads = grad_sequence(4, 10)
    pair = Pair(cfg, sched, params0)
    for g in grads[:5]:
        pair.step(g)
    # Replace the jaxdp side by a state built only from torch: params, opt.state, step count.
    torch_state = pair.torch_state()
    if pair.name == "sgd" and sched != "constant":
        torch_state["step"] = pair.tsched.last_epoch  # torch's SGD state has no step
    pair.params = jax.tree.map(jnp.asarray, pair.torch_tree(lambda p: p.detach().numpy().copy()))
    pair.state = optimizer_state_from_torch(pair.name, pair.tx, pair.params, torch_state)
    for t, g in enumerate(grads[5:], start=5):
        pair.step(g)
        pair.check(f"step {t} after load")


@pytest.mark.parametrize("cfg", ["sgd_momentum", "adam_wd"])
def test_state_round_trip_is_exact(cfg):
    name, kw = OPT_CONFIGS[cfg][:2]
    tx = make_optimizer(name, make_schedule("cosine", 0.1, 50), **kw)
    params = jax.tree.map(jnp.asarray, random_tree(np.random.default_rng(5)))
    state = tx.init(params)
    for g in grad_sequence(6, 3):
        updates, state = tx.update(jax.tree.map(jnp.asarray, g), state, params)
        params = optax.apply_updates(params, updates)
    ts = jax.tree.map(np.asarray, torch_optimizer_state(name, state))
    if name == "sgd":
        ts["step"] = 3
    back = optimizer_state_from_torch(name, tx, params, ts)
    assert jax.tree.structure(back) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def test_sgd_without_momentum_has_no_state_like_torch():
    tx = make_optimizer("sgd", 0.1, momentum=0.0)
    assert torch_optimizer_state("sgd", tx.init({"w": jnp.ones(3)})) == {}


def test_state_loading_refuses_mismatches():
    params = {"w": jnp.ones((2, 3))}
    tx = make_optimizer("sgd", make_schedule("cosine", 0.1, 10))
    with pytest.raises(ValueError, match="step"):
        optimizer_state_from_torch("sgd", tx, params, {"momentum_buffer": {"w": np.ones((2, 3))}})
    with pytest.raises(ValueError, match="shape"):
        optimizer_state_from_torch("sgd", tx, params,
                                   {"momentum_buffer": {"w": np.ones((3, 2))}, "step": 1})
    with pytest.raises(ValueError, match="does not match the params tree"):
        optimizer_state_from_torch("sgd", tx, params, {"momentum_buffer": [np.ones((2, 3))],
                                                       "step": 1})
    with pytest.raises(ValueError, match="exp_avg_sq"):
        optimizer_state_from_torch("adam", make_optimizer("adam", 1e-3), params,
                                   {"exp_avg": {"w": np.ones((2, 3))}, "step": 1})


# ----------------------------------------------------------------------------------------
# Schedules
# ----------------------------------------------------------------------------------------

def torch_lrs(factory, base_lr, n):
    """lr used by optimizer steps 0..n-1 (+ one more), as torch's scheduler reports them."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))], lr=base_lr)
    sched = factory(opt)
    out = [sched.get_last_lr()[0]]
    for _ in range(n):
        opt.step()
        sched.step()
        out.append(sched.get_last_lr()[0])
    return out


def assert_schedule(name, base_lr, total, kw, expected):
    """Every step within 1e-12 relative, plus a few ulp of base_lr absolute.

    The absolute term is the irreducible rounding of ``1 + cos(pi t / T)`` near t = T, where it
    cancels: the cos is only known to ~1 ulp of 1, so any implementation (torch's closed form,
    torch's recursive CosineAnnealingLR, optax, or optax under jit, where XLA turns ``/ T`` into
    ``* (1 / T)`` and moves the argument by an ulp) carries an error of ~ulp * base_lr / 2,
    which is > 1e-12 relative once (1 + cos) < ~1e-4 (long schedules, last ~1% of steps).
    """
    sched = make_schedule(name, base_lr, total, **kw)
    sched_jit = jax.jit(sched)
    n = len(expected)
    lam = torch_lr_lambda(name, base_lr, total, **kw)
    via_lambda = torch_lrs(lambda o: torch.optim.lr_scheduler.LambdaLR(o, lam), base_lr, n - 1)
    # All steps at once (jit, int32 like optax's count), and scalar calls (how optax calls it)
    # on the first and last 25 steps, where warmup, milestones and the cosine tail sit.
    vector = np.broadcast_to(np.asarray(sched_jit(jnp.arange(n, dtype=jnp.int32))), (n,))
    scalar_steps = set(range(min(n, 25))) | set(range(max(0, n - 25), n))
    for t, e in enumerate(expected):
        checks = [("int32 vector in jit", vector[t]), ("LambdaLR(torch_lr_lambda)", via_lambda[t])]
        if t in scalar_steps:
            checks += [("python int", sched(t)), ("int32 scalar in jit", sched_jit(jnp.int32(t)))]
        for label, got in checks:
            bound = TOL * abs(e) + 4 * np.finfo(np.float64).eps * base_lr
            assert abs(float(got) - e) <= bound, f"{name} step {t} {label}: {got} vs {e}"


@pytest.mark.parametrize("base_lr,total,min_lr", [(0.1, 20, 0.0), (0.1, 20, 1e-3), (3e-4, 7, 1e-5),
                                                  (0.4, 100, 0.0)])
def test_cosine_matches_cosine_annealing_lr(base_lr, total, min_lr):
    # torch's CosineAnnealingLR is recursive (lr_t = ratio * (lr_{t-1} - eta_min) + eta_min);
    # its rounding stays far below 1e-12 over total steps (checked up to step total).
    expected = torch_lrs(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(
        o, T_max=total, eta_min=min_lr), base_lr, total)
    assert_schedule("cosine", base_lr, total, dict(min_lr=min_lr), expected)


def test_cosine_holds_min_lr_after_total_steps_unlike_torch():
    sched = make_schedule("cosine", 0.1, 10, min_lr=1e-3)
    assert float(sched(10)) == pytest.approx(1e-3, rel=1e-15)
    assert float(sched(15)) == pytest.approx(1e-3, rel=1e-15)
    torch_after = torch_lrs(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(
        o, T_max=10, eta_min=1e-3), 0.1, 15)[15]
    assert torch_after > 1e-2  # torch's cosine is periodic: it climbs back after T_max


@pytest.mark.parametrize("milestones,gamma", [((5, 10, 15), 0.1), ((0, 3, 3, 8), 0.5),
                                              ((), 0.1), ((4,), 2.0)])
def test_multistep_matches_multistep_lr(milestones, gamma):
    expected = torch_lrs(lambda o: torch.optim.lr_scheduler.MultiStepLR(
        o, milestones=list(milestones), gamma=gamma), 0.2, 20)
    assert_schedule("multistep", 0.2, 20, dict(milestones=milestones, gamma=gamma), expected)


def test_constant():
    assert_schedule("constant", 0.05, 10, {}, [0.05] * 11)


@pytest.mark.parametrize("base_lr,total,warmup,min_lr", [(0.1, 20, 5, 0.0), (1e-3, 30, 1, 1e-5),
                                                         (0.2, 12, 0, 1e-3), (0.5, 2000, 500, 0.0)])
def test_warmup_cosine(base_lr, total, warmup, min_lr):
    # Warmup: base_lr * t / warmup, starting from 0. After it: torch's CosineAnnealingLR over
    # the remaining steps, shifted by `warmup` (an independent torch reference for that part).
    cosine = torch_lrs(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(
        o, T_max=total - warmup, eta_min=min_lr), base_lr, total - warmup)
    expected = [base_lr * t / warmup for t in range(warmup)] + cosine
    assert len(expected) == total + 1
    assert_schedule("warmup_cosine", base_lr, total,
                    dict(warmup_steps=warmup, min_lr=min_lr), expected)


# ----------------------------------------------------------------------------------------
# Refusals
# ----------------------------------------------------------------------------------------

OPT_REFUSALS = [
    (("nadam", 0.1), {}, "sgd, adam, adamw"),
    (("sgd", 0.1), dict(dampening=0.1), "dampening"),
    (("sgd", 0.1), dict(momentum=0.0, nesterov=True), "nesterov"),
    (("sgd", -0.1), {}, "learning_rate"),
    (("sgd", 0.1), dict(weight_decay=-1e-4), "weight_decay"),
    (("sgd", 0.1), dict(momentum=-0.9), "momentum"),
    (("adam", 1e-3), dict(betas=(1.0, 0.999)), "betas"),
    (("adamw", 1e-3), dict(betas=(0.9, -0.1)), "betas"),
    (("adam", 1e-3), dict(eps=-1e-8), "eps"),
    (("adam", 1e-3), dict(nesterov=True), "nesterov"),
    (("adamw", 1e-3), dict(dampening=0.5), "dampening"),
    (("adamw", 1e-3), dict(weight_decay=-0.01), "weight_decay"),
]


@pytest.mark.parametrize("args,kw,needle", OPT_REFUSALS)
def test_optimizer_refusals(args, kw, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        make_optimizer(*args, **kw)
    assert "\n" not in str(e.value)


def test_no_amsgrad_argument():
    with pytest.raises(TypeError):
        make_optimizer("adam", 1e-3, amsgrad=True)


SCHED_REFUSALS = [
    (("linear", 0.1, 10), {}, "constant, cosine, multistep, warmup_cosine"),
    (("cosine", -0.1, 10), {}, "base_lr"),
    (("cosine", 0.1, 0), {}, "total_steps"),
    (("cosine", 0.1, 10), dict(min_lr=0.2), "min_lr"),
    (("cosine", 0.1, 10), dict(min_lr=-1e-3), "min_lr"),
    (("warmup_cosine", 0.1, 10), dict(warmup_steps=10), "warmup_steps"),
    (("warmup_cosine", 0.1, 10), dict(warmup_steps=-1), "warmup_steps"),
    (("multistep", 0.1, 10), dict(milestones=(3, -1)), "milestones"),
    (("multistep", 0.1, 10), dict(milestones=(2.5,)), "milestones"),
    (("multistep", 0.1, 10), dict(milestones=(3,), gamma=-0.1), "gamma"),
    (("cosine", 0.1, 10), dict(warmup_steps=3), "warmup_steps"),
    (("constant", 0.1, 10), dict(milestones=(3,)), "milestones"),
    (("multistep", 0.1, 10), dict(min_lr=1e-3), "min_lr"),
]


@pytest.mark.parametrize("args,kw,needle", SCHED_REFUSALS)
def test_schedule_refusals(args, kw, needle):
    for fn in (make_schedule, torch_lr_lambda):
        with pytest.raises(ConfigError, match=needle) as e:
            fn(*args, **kw)
        assert "\n" not in str(e.value)


def test_names_and_error_type():
    assert OPTIMIZERS == ("sgd", "adam", "adamw")
    assert SCHEDULES == ("constant", "cosine", "multistep", "warmup_cosine")
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ConfigError, match="sgd, adam, adamw"):
        torch_optimizer_state("rmsprop", None)
