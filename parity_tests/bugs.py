"""Deliberately broken jaxdp variants: each is a real porting mistake, and the harness must
catch it and name it.

Each bug is a set of monkeypatches, one per site of the code where the mistake can be made
(they differ: ZeRO-3 divides by N in its own sync, ``dp`` sums on device 0, ...), all applied
at once: a strategy's step runs the site its own code uses, and the others are not called.
So the catalogue names no strategy: any registered pair (``jaxdp.registry``, ``pairs.PAIRS``)
takes every bug, a new one included, through the code it shares (a new strategy built on
``sync.AllReduce`` makes its 1/N mistake there); the ``missed_bug`` outcome of a run (exit 3)
says when a strategy's own code holds no site. ``injection(name, cfg)`` returns a context
manager that patches and restores on exit (also on an exception), or raises ``ParityError`` in
one line where the bug cannot apply. Patch *before* the strategy traces its step (the runner
builds a fresh strategy and jit inside the ``with``), so the compiled step contains the bug.

=======================  ==============================================  ===========================================
bug                      the mistake                                     where the harness must see it first
=======================  ==============================================  ===========================================
same_padding             ``padding="SAME"`` on the stride-2 3x3 convs:   step 0, ``loss`` (the forward already
                         XLA pads (0, 1), torch (1, 1)                   differs)
biased_var               running_var updated with the biased batch       step 0, ``buffers/...running_var`` (loss,
                         variance (flax's choice) instead of torch's     grads and params are unaffected: training
                         unbiased ``var * n / (n - 1)``                  mode normalises with batch statistics)
missing_1_over_n         the gradient reduction sums without dividing    step 0, ``grads/...`` (every gradient is N x)
                         by N
wrong_shard_bn           BN running stats kept from the LAST device      step 0, ``buffers/...`` (DDP keeps rank 0's)
                         instead of rank 0 (DDP broadcasts rank 0's)
late_lr_schedule         warmup_cosine hands over to the cosine one      step w + 1 (11 for the tests' w = 10: a
                         step late, ``join_schedules([warmup, cosine],   harness comparing 11 steps sees nothing),
                         [w + 1])`` (the peak step counted as warmup):   ``params/...``. lr(w) is the peak either
                         lr(t) is the right lr(t - 1) for every t > w    way (warmup(w) = cosine(0)), so update w
                                                                         is right and update w + 1 is the first
                                                                         wrong one; its loss and grads come from
                                                                         update w's params, and the momentum
                                                                         buffer / Adam's moments are lr-free:
                                                                         only the params differ
adam_bias_correction     Adam's bias correction with step + 1:           step 0, ``params/...``: m and v (torch's
                         m / (1 - b1^(t+1)), v / (1 - b2^(t+1)) with     exp_avg, exp_avg_sq) do not depend on the
                         t = 1 at the first update                       count, so loss, grads and optimizer state
                                                                         agree; step 0's update is sqrt(1 + b2) /
                                                                         (1 + b1) of torch's (a zero-initialised
                                                                         BN bias off by 26%)
shard_grad_perturbation  one device's share of ONE gradient,             step 0, ``grads/layer3.0.conv2.weight``,
                         ``layer3.0.conv2.weight``, 1e-6 (relative)      rel err <= 1e-6 (that chunk's share of the
                         too large: rank 0's contribution to the         tensor's largest entry): over float64's
                         all-reduce, or device 0's chunk of the          1e-10, under float32's ~1e-5.   No other
                         reduce-scattered gradient                       gradient is off
error_feedback_dropped   PowerSGD's new error computed from this step's  step s + 1 (s = ``powersgd_start_iter``),
                         gradient alone, ``g - out``, not from the       ``comm_state/.../error``: at step s the
                         error-corrected ``(g + e) - out`` (the old      old error is zero, so nothing differs;
                         error is applied, then lost)                    step s + 1's grads use step s's (right)
                                                                         error, and only the error it leaves is
                                                                         wrong. A harness comparing grads alone
                                                                         sees it one step later
=======================  ==============================================  ===========================================

Where each is patched (every site at once; which strategies run each site):

=======================  ==============================================================================
same_padding             ``resnet.model._Layers.conv``: every strategy (ZeRO-3/HSDP's units use the same factory)
biased_var               ``resnet.model.BatchNorm``: every strategy
missing_1_over_n         ddp, async, zero1: ``sync.AllReduce.reduce_bucket`` (the bucketed all-reduce they
                         all compose); zero2: ``sync.ReduceScatter.update``; zero3, hsdp:
                         ``sync.GatherOnUse.update`` (the division after the gathers' transposes
                         reduce-scattered the grads);
                         dp: ``dp.gather_to_first`` (the sum on device 0)
wrong_shard_bn           ddp, async, zero1, zero2, zero3, hsdp: ``ddp_buffers`` in every strategy module
                         that imported it (whichever module's step runs); dp: ``dp.local_grads``'s model state
late_lr_schedule         ``jaxdp.optim.make_schedule`` (the runner builds jaxdp's schedule with it): every
                         strategy (its optimizer evaluates the schedule at its count, sharded or not)
adam_bias_correction     ``optax._src.transform.scale_by_adam``, which ``optax.adam``/``optax.adamw``
                         (``jaxdp.optim.make_optimizer``'s chains) call when the optimizer is built: every
                         strategy (ZeRO runs the same transform on its chunks)
shard_grad_perturbation  ddp, async, zero1: ``sync.AllReduce.update`` (rank 0's gradient before the
                         buckets: its contribution to the sum); zero2: ``sync.ReduceScatter.update``'s output
                         (device 0's averaged chunk); zero3, hsdp: ``sync.GatherOnUse.update``'s input (the
                         chunk the gathers' transposes summed on device 0; HSDP: device (0, 0)'s, before
                         the replica all-reduce); dp: ``dp.local_grads`` (chunk 0's gradient, before the
                         gather to device 0)
error_feedback_dropped   ``jaxdp.strategies.sync.powersgd.PowerSGD._compress``: ddp and zero1 (the strategies that take
                         ``--compress powersgd``)
=======================  ==============================================================================

The 1/N bugs scale a reduction's input or output by N rather than rewrite it, so they
follow the real code whatever it calls its collectives (exact for N a power of 2); the
shard perturbation scales one tensor the same way, on the first device only.

Some bugs need a config that can show them (``requires``, refused in one line otherwise):
late_lr_schedule a warmup_cosine schedule and ``--steps >= warmup_steps + 2``, and its step
depends on the config (``Bug.first_step``); adam_bias_correction adam or adamw;
shard_grad_perturbation a ResNet (the tensor it perturbs); missing_1_over_n and
wrong_shard_bn several devices (and per-device BN).
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from parity_tests import pairs
from parity_tests.config import ParityError


# ----------------------------------------------------------------------------- patching

@dataclass(frozen=True)
class Patch:
    """Replace ``name`` in each owner by ``make(original)``; restore on exit.

    ``owners``: "package.module" or "package.module:Class" (a class's own attribute, so
    a subclass's override is never touched by its parent's patch), or a function
    returning such objects when they are only known at patch time."""

    owners: Any
    name: str
    make: Callable[[Any], Any]

    def targets(self) -> List[Any]:
        owners = self.owners() if callable(self.owners) else self.owners
        return [_resolve(o) if isinstance(o, str) else o for o in owners]

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for target in self.targets():
                stack.enter_context(_patched(target, self.name, self.make))
            yield


def _resolve(path: str):
    module, _, cls = path.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, cls) if cls else obj


@contextlib.contextmanager
def _patched(obj, name: str, make: Callable[[Any], Any]) -> Iterator[None]:
    # A class's own attribute (KeyError if it only inherits it: patch where it is defined).
    original = obj.__dict__[name] if isinstance(obj, type) else getattr(obj, name)
    setattr(obj, name, make(original))
    try:
        yield
    finally:
        setattr(obj, name, original)


def _modules_calling_ddp_buffers() -> List[Any]:
    """Every ``jaxdp.strategies`` module holding base's ``ddp_buffers`` (base included):
    a step calls it through its own module's name (ddp, async_ps, zero), and a new
    strategy module is covered without a new row."""
    import jaxdp.strategies as package
    from jaxdp.strategies import base

    modules = [importlib.import_module(f"{package.__name__}.{m.name}")
               for m in pkgutil.iter_modules(package.__path__)]
    return [m for m in modules if getattr(m, "ddp_buffers", None) is base.ddp_buffers]


# ----------------------------------------------------------------------------- the mistakes

def _same_padding_conv(original):
    """Stride-2 3x3 convolutions with ``padding="SAME"`` (pads (0, 1) where torch pads (1, 1))."""
    import flax.linen as nn

    from jaxdp.models import resnet

    def conv(self, features, kernel, stride=1, name=None, row_parallel=False):
        if stride == 2 and kernel == 3 and self.model_axis is None:  # (no channel-parallel sum to keep)
            return nn.Conv(features, (kernel, kernel), strides=(stride, stride), padding="SAME",
                           use_bias=False, kernel_init=resnet.conv_init, dtype=self.dtype,
                           param_dtype=self.param_dtype, name=name)
        return original(self, features, kernel, stride, name, row_parallel)

    return conv


def _biased_var_batchnorm(original):
    """BatchNorm whose running_var takes the biased batch variance (flax.linen.BatchNorm's habit)."""
    import flax.linen as nn
    import jax

    class BiasedVarBatchNorm(original):
        @nn.compact
        def __call__(self, x, train: bool):
            features = x.shape[-1]
            scale = self.param("scale", nn.initializers.ones, (features,), self.param_dtype)
            bias = self.param("bias", nn.initializers.zeros, (features,), self.param_dtype)
            ra_mean = self.variable("batch_stats", "mean", lambda: jax.numpy.zeros((features,), self.param_dtype))
            ra_var = self.variable("batch_stats", "var", lambda: jax.numpy.ones((features,), self.param_dtype))
            xs = x.astype(jax.numpy.promote_types(self.dtype, jax.numpy.float32))
            if train:
                mean, var, _ = self._batch_stats(xs)
                if not self.is_initializing():
                    m = self.momentum
                    ra_mean.value = (1 - m) * ra_mean.value + m * mean.astype(self.param_dtype)
                    ra_var.value = (1 - m) * ra_var.value + m * var.astype(self.param_dtype)  # BUG: biased
            else:
                mean, var = ra_mean.value.astype(xs.dtype), ra_var.value.astype(xs.dtype)
            y = (xs - mean) * (jax.lax.rsqrt(var + self.epsilon) * scale.astype(xs.dtype)) + bias.astype(xs.dtype)
            return y.astype(self.dtype)

    return BiasedVarBatchNorm


def _times_n(tree, n):
    import jax

    return jax.tree_util.tree_map(lambda v: v * n, tree)


def _sync_fed_n_times(original):
    """A gradient sync's ``update(self, grads, state, where)``, which divides by N, fed N x: it sums.
    BUG: psum(g), not psum(g / N)."""
    def update(self, grads, state, where):
        return original(self, _times_n(grads, where.n), state, where)

    return update


def _bucket_fed_n_times(original):
    """``AllReduce.reduce_bucket(self, grads, axis, n)`` fed N x its gradients: it sums.
    BUG: psum(g), not psum(g / N)."""
    def reduce_bucket(self, grads, axis, n):
        return original(self, [g * n for g in grads], axis, n)

    return reduce_bucket


def _unweighted_gather_to_first(original):
    """dp's gather to device 0 without the chunk weights b/B: device 0 sums N means."""
    def gather_to_first(x, axis, n):
        return original(x * n, axis, n)  # BUG: the (b / B) weight undone

    return gather_to_first


def _from_last_device(tree, axis):
    import jax

    from jaxdp.strategies.base import broadcast_from

    return broadcast_from(tree, axis, source=jax.lax.axis_size(axis) - 1)


def _last_device_buffers(original):
    """``ddp_buffers`` that keeps the last device's running stats. BUG: DDP keeps rank 0's."""
    def ddp_buffers(model_state, axis, sync_bn):
        return model_state if sync_bn else _from_last_device(model_state, axis)

    return ddp_buffers


def _last_chunk_stats(original):
    """dp's ``local_grads`` handing on the last chunk's model state (BN stats; device 0 broadcasts them)."""
    from jaxdp.runtime.mesh import DATA_AXIS

    def local_grads(*args, **kwargs):
        loss, grads, model_state, metrics = original(*args, **kwargs)
        return loss, grads, _from_last_device(model_state, DATA_AXIS), metrics  # BUG: not chunk 0's

    return local_grads


def _warmup_one_step_late(original):
    """``make_schedule`` whose warmup_cosine hands over to the cosine one step late.

    BUG: ``join_schedules([warmup, cosine], [w + 1])`` (the peak step counted as part of the
    warmup) instead of ``[w]``. warmup(w) = base_lr * w / w = base_lr = cosine(0), so the
    lr of update w is still right; from update w + 1 on the cosine runs one step behind:
    lr(t) = correct lr(t - 1) for t > w."""
    import jax.numpy as jnp

    def make_schedule(name, base_lr, total_steps, *, warmup_steps=0, **kwargs):
        schedule = original(name, base_lr, total_steps, warmup_steps=warmup_steps, **kwargs)
        if name != "warmup_cosine" or not warmup_steps:
            return schedule
        w = warmup_steps
        return lambda count: schedule(jnp.where(count > w, count - 1, count))  # BUG: the join at w + 1

    return make_schedule


def _adam_bias_correction_off_by_one(original):
    """``optax``'s ``scale_by_adam`` whose bias correction counts one update too many.

    BUG: m_hat = m / (1 - b1^(t+1)), v_hat = v / (1 - b2^(t+1)) with t = 1 at the first
    update (torch's ``step`` after its increment), i.e. ``bias_correction(mu, b1, count_inc + 1)``.
    optax's own arithmetic otherwise: its update runs on a state whose count is one ahead,
    and the state it returns counts right (so torch's ``step`` still matches), and the
    moments m, v do not depend on the count at all."""
    def scale_by_adam(*args, **kwargs):
        import optax

        adam = original(*args, **kwargs)

        def update(updates, state, params=None):
            out, new = adam.update(updates, state._replace(count=state.count + 1), params)  # BUG: step + 1
            return out, new._replace(count=state.count + 1)

        return optax.GradientTransformation(adam.init, update)

    return scale_by_adam


SHARD_TENSOR = "layer3.0.conv2.weight"  # in every ResNet variant (basic or bottleneck blocks, any width)
SHARD_PERTURBATION = 1e-6


def _axes(axis) -> Tuple[str, ...]:
    return tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)


def _on_first_device_perturbed(tree, axes):
    """``tree`` (params-shaped: grads, or their chunks) with ``SHARD_TENSOR``'s leaf scaled by
    1 + 1e-6 on the first device of ``axes`` only (index 0 along every one of them)."""
    import jax
    import jax.numpy as jnp

    from jaxdp.interop import param_name_map

    target = param_name_map(tree)[SHARD_TENSOR]
    first = jnp.all(jnp.stack([jax.lax.axis_index(a) == 0 for a in _axes(axes)]))

    def leaf(keypath, x):
        path = tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in keypath)
        if path != tuple(target):
            return x
        return x * jnp.where(first, 1 + SHARD_PERTURBATION, 1.0).astype(x.dtype)  # BUG: device 0's only

    return jax.tree_util.tree_map_with_path(leaf, tree)


def _perturbed_allreduce_input(original):
    """``AllReduce.update`` with rank 0's contribution to one tensor 1e-6 too large."""
    def update(self, grads, state, where):
        return original(self, _on_first_device_perturbed(grads, where.axis), state, where)

    return update


def _perturbed_reduce_scatter_output(original):
    """ZeRO-2's ``ReduceScatter.update`` with device 0's averaged chunk of one tensor 1e-6 too large."""
    def update(self, grads, state, where):
        chunks, state = original(self, grads, state, where)
        return _on_first_device_perturbed(chunks, where.axis), state

    return update


def _perturbed_chunk_before_division(original):
    """ZeRO-3/HSDP's ``GatherOnUse.update`` fed (global) device 0's summed chunk of one tensor 1e-6
    too large (HSDP: device (0, 0)'s, over replica and data)."""
    def update(self, grads, state, where):
        axes = (self.replica_axis, where.axis) if self.replica_axis else where.axis
        return original(self, _on_first_device_perturbed(grads, axes), state, where)

    return update


def _perturbed_first_chunk_grads(original):
    """dp's ``local_grads`` with chunk 0's gradient of one tensor 1e-6 too large (before the gather to device 0)."""
    from jaxdp.runtime.mesh import DATA_AXIS

    def local_grads(*args, **kwargs):
        loss, grads, model_state, metrics = original(*args, **kwargs)
        return loss, _on_first_device_perturbed(grads, DATA_AXIS), model_state, metrics

    return local_grads


# ----------------------------------------------------------------------------- the table

def _error_feedback_dropped(original):
    """PowerSGD's compression whose new error forgets the old one: ``g - out``, not ``(g + e) - out``."""
    def compress(self, grads, extra, step, axis, sum_fn):
        import jax

        out, new_extra = original(self, grads, extra, step, axis, sum_fn)
        forgot = jax.tree_util.tree_map(lambda new, old: new - old, new_extra["error"], extra["error"])
        return out, {**new_extra, "error": forgot}
    return compress


def _needs_several_devices(cfg) -> Optional[str]:
    return "it needs --devices >= 2 (one device has nothing to average)" if cfg.devices < 2 else None


def _needs_per_device_bn(cfg) -> Optional[str]:
    if cfg.sync_bn:
        return "with --sync-bn every device holds the same BN statistics, so which one is kept cannot matter"
    return _needs_several_devices(cfg)


def _needs_late_warmup_end(cfg) -> Optional[str]:
    if cfg.schedule != "warmup_cosine" or cfg.warmup_steps < 1:
        return ("it needs --schedule warmup_cosine with --warmup-steps >= 1 (the mistake is where the "
                "warmup hands over to the cosine)")
    if cfg.steps < cfg.warmup_steps + 2:
        return (f"it needs --steps >= warmup_steps + 2 = {cfg.warmup_steps + 2}: the first wrong lr is "
                f"that of step {cfg.warmup_steps + 1}")
    return None


def _needs_two_compressed_steps(cfg) -> Optional[str]:
    if cfg.compress != "powersgd":
        return "it needs --compress powersgd"
    if cfg.steps < cfg.powersgd_start_iter + 2:
        return (f"it shows at step {cfg.powersgd_start_iter + 1} (the second compressed one), "
                f"so it needs --steps >= {cfg.powersgd_start_iter + 2}; got {cfg.steps}")
    return None


def _needs_adam(cfg) -> Optional[str]:
    if cfg.optimizer not in ("adam", "adamw"):
        return f"it needs --optimizer adam or adamw ({cfg.optimizer} has no bias correction)"
    return None


def _needs_the_shard_tensor(cfg) -> Optional[str]:
    from parity_tests.inputs import torch_model

    if SHARD_TENSOR not in dict(torch_model(cfg).named_parameters()):
        return f"it perturbs {SHARD_TENSOR}, a ResNet tensor; {cfg.model} has none"
    return None


@dataclass(frozen=True)
class Bug:
    name: str
    what: str
    patches: Tuple[Patch, ...]    # every site of the code where a step makes this mistake
    step: Any                     # where the harness must report the first divergence (or cfg -> that step)
    category: str                 # ... in which category
    leaf: str = ""                # ... and, if set, a tensor whose name ends with this
    requires: Callable[[Any], Optional[str]] = lambda cfg: None  # why a config cannot show it

    def first_step(self, cfg) -> int:
        """The step the harness must report for ``cfg`` (a late bug's depends on the config)."""
        return self.step(cfg) if callable(self.step) else self.step

    def injection(self, cfg) -> contextlib.AbstractContextManager:
        """The patches for ``cfg``'s run; ParityError where this bug cannot apply."""
        if cfg.strategy not in pairs.PAIRS:
            raise ParityError(f"bug {self.name} cannot be injected into strategy {cfg.strategy!r}: "
                              f"it applies to {', '.join(pairs.PAIRS)}")
        why = self.requires(cfg)
        if why:
            raise ParityError(f"bug {self.name} cannot show in this run: {why}")
        return self.applied()

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Every site patched, whatever the config (tests that check restoring call it directly)."""
        with contextlib.ExitStack() as stack:
            for patch in self.patches:
                stack.enter_context(patch.applied())
            yield


ALLREDUCE = "jaxdp.strategies.sync.allreduce:AllReduce"  # ddp, async, zero1: the bucketed all-reduce they compose
REDUCE_SCATTER = "jaxdp.strategies.sync.sharded:ReduceScatter"  # zero2
GATHER_ON_USE = "jaxdp.strategies.sync.sharded:GatherOnUse"  # zero3, hsdp
DP = "jaxdp.strategies.dp"  # dp's own step: the gather to device 0

BUGS: Dict[str, Bug] = {b.name: b for b in (
    Bug("same_padding", "'SAME' padding on the stride-2 convs",
        (Patch(["jaxdp.models.resnet.model:_Layers"], "conv", _same_padding_conv),), 0, "loss"),
    Bug("biased_var", "biased variance in BN running_var",
        (Patch(["jaxdp.models.resnet.model"], "BatchNorm", _biased_var_batchnorm),), 0, "buffers", "running_var"),
    Bug("missing_1_over_n", "gradient reduction without 1/N", (
        Patch([ALLREDUCE], "reduce_bucket", _bucket_fed_n_times),
        Patch([REDUCE_SCATTER, GATHER_ON_USE], "update", _sync_fed_n_times),
        Patch([DP], "gather_to_first", _unweighted_gather_to_first),
    ), 0, "grads", requires=_needs_several_devices),
    Bug("wrong_shard_bn", "BN running stats from the last device", (
        Patch(_modules_calling_ddp_buffers, "ddp_buffers", _last_device_buffers),
        Patch([DP], "local_grads", _last_chunk_stats),
    ), 0, "buffers", requires=_needs_per_device_bn),
    Bug("late_lr_schedule", "warmup_cosine's cosine starting one step late (after the warmup)",
        (Patch(["jaxdp.optim"], "make_schedule", _warmup_one_step_late),),
        lambda cfg: cfg.warmup_steps + 1, "params", requires=_needs_late_warmup_end),
    Bug("adam_bias_correction", "Adam's bias correction with step + 1",
        # optax.adam/adamw (jaxdp.optim.make_optimizer's chains) call it through this module
        (Patch(["optax._src.transform"], "scale_by_adam", _adam_bias_correction_off_by_one),),
        0, "params", requires=_needs_adam),
    Bug("shard_grad_perturbation", f"device 0's gradient chunk of {SHARD_TENSOR} off by 1e-6 (relative)", (
        Patch([ALLREDUCE], "update", _perturbed_allreduce_input),
        Patch([REDUCE_SCATTER], "update", _perturbed_reduce_scatter_output),
        Patch([GATHER_ON_USE], "update", _perturbed_chunk_before_division),
        Patch([DP], "local_grads", _perturbed_first_chunk_grads),
    ), 0, "grads", SHARD_TENSOR, requires=_needs_the_shard_tensor),
    Bug("error_feedback_dropped", "PowerSGD's error feedback computed without the old error",
        (Patch(["jaxdp.strategies.sync.powersgd:PowerSGD"], "_compress", _error_feedback_dropped),),
        lambda cfg: cfg.powersgd_start_iter + 1, "comm_state", "error", requires=_needs_two_compressed_steps),
)}


def injection(name: str, cfg) -> contextlib.AbstractContextManager:
    """The context manager that injects bug ``name`` into ``cfg``'s strategy (ParityError if it cannot)."""
    if name not in BUGS:
        raise ParityError(f"unknown bug {name!r}; choose one of {', '.join(BUGS)}")
    return BUGS[name].injection(cfg)


def patch_sites() -> List[Tuple[Any, str]]:
    """(owner, name) of every spot some injection replaces: for tests that check restoring."""
    return [(t, p.name) for bug in BUGS.values() for p in bug.patches for t in p.targets()]
