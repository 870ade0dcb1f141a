"""Deliberately broken jaxdp variants: each is a real porting mistake, and the harness must
catch it and name it.

Each bug is a set of monkeypatches, one per strategy: the spot where *that* strategy's
step makes the mistake (they differ: ZeRO-3 divides by N in its own code, ``dp`` sums on
device 0, ...). ``injection(name, cfg)`` returns a context manager that patches and
restores on exit (also on an exception), or raises ``ParityError`` in one line where the
bug cannot apply. Patch *before* the strategy traces its step (the runner builds a fresh
strategy and jit inside the ``with``), so the compiled step contains the bug.

================  ==============================================  ===========================================
bug               the mistake                                     where the harness must see it first
================  ==============================================  ===========================================
same_padding      ``padding="SAME"`` on the stride-2 3x3 convs:   step 0, ``loss`` (the forward already
                  XLA pads (0, 1), torch (1, 1)                   differs)
biased_var        running_var updated with the biased batch       step 0, ``buffers/...running_var`` (loss,
                  variance (flax's choice) instead of torch's     grads and params are unaffected: training
                  unbiased ``var * n / (n - 1)``                  mode normalises with batch statistics)
missing_1_over_n  the gradient reduction sums without dividing    step 0, ``grads/...`` (every gradient is N x)
                  by N
wrong_shard_bn    BN running stats kept from the LAST device      step 0, ``buffers/...`` (DDP keeps rank 0's)
                  instead of rank 0 (DDP broadcasts rank 0's)
================  ==============================================  ===========================================

Where each is patched, per strategy:

================  ==============================================================================
same_padding      ``resnet._Layers.conv``: every strategy (ZeRO-3/HSDP's units use the same factory)
biased_var        ``resnet.BatchNorm``: every strategy
missing_1_over_n  ddp, async, zero1: ``sync.AllReduce.reduce_bucket`` (the bucketed all-reduce they
                  all compose); zero2: ``ZeRO.reduce_scatter``; zero3, hsdp: ``ZeRO.average_chunks``
                  (the division after the gathers' transposes reduce-scattered the grads);
                  dp: ``dp.gather_to_first`` (the sum on device 0)
wrong_shard_bn    ddp, async, zero1, zero2, zero3, hsdp: ``ddp_buffers`` in every strategy module
                  that imported it (whichever module's step runs); dp: ``dp.local_grads``'s model state
================  ==============================================================================

The 1/N bugs scale a reduction's input or output by N rather than rewrite it, so they
follow the real code whatever it calls its collectives (exact for N a power of 2).
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

from parity_tests.runner import ParityError

STRATEGIES = ("ddp", "async", "zero1", "zero2", "zero3", "hsdp", "dp")


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

    def conv(self, features, kernel, stride=1, name=None):
        if stride == 2 and kernel == 3:
            return nn.Conv(features, (kernel, kernel), strides=(stride, stride), padding="SAME",
                           use_bias=False, kernel_init=resnet.conv_init, dtype=self.dtype,
                           param_dtype=self.param_dtype, name=name)
        return original(self, features, kernel, stride, name)

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


def _fed_n_times(original):
    """A reduction method ``(self, x)`` that divides by N, fed N x: it sums. BUG: psum(g), not psum(g / N)."""
    def method(self, x, *args, **kwargs):
        return original(self, _times_n(x, self.num_devices), *args, **kwargs)

    return method


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
    from jaxdp.mesh import DATA_AXIS

    def local_grads(*args, **kwargs):
        loss, grads, model_state, metrics = original(*args, **kwargs)
        return loss, grads, _from_last_device(model_state, DATA_AXIS), metrics  # BUG: not chunk 0's

    return local_grads


# ----------------------------------------------------------------------------- the table

def _everywhere(patch: Patch) -> Dict[str, Patch]:
    return dict.fromkeys(STRATEGIES, patch)


def _needs_several_devices(cfg) -> Optional[str]:
    return "it needs --devices >= 2 (one device has nothing to average)" if cfg.devices < 2 else None


def _needs_per_device_bn(cfg) -> Optional[str]:
    if cfg.sync_bn:
        return "with --sync-bn every device holds the same BN statistics, so which one is kept cannot matter"
    return _needs_several_devices(cfg)


@dataclass(frozen=True)
class Bug:
    name: str
    what: str
    patches: Mapping[str, Patch]  # strategy -> where its step makes this mistake
    step: int                     # where the harness must report the first divergence
    category: str                 # ... in which category
    leaf: str = ""                # ... and, if set, a tensor whose name ends with this
    requires: Callable[[Any], Optional[str]] = lambda cfg: None  # why a config cannot show it

    def injection(self, cfg) -> contextlib.AbstractContextManager:
        """The patch for ``cfg.strategy``; ParityError where this bug cannot apply."""
        if cfg.strategy not in self.patches:
            raise ParityError(f"bug {self.name} cannot be injected into strategy {cfg.strategy!r}: "
                              f"it applies to {', '.join(self.patches)}")
        why = self.requires(cfg)
        if why:
            raise ParityError(f"bug {self.name} cannot show in this run: {why}")
        return self.patches[cfg.strategy].applied()


ALLREDUCE_BUCKET = Patch(["jaxdp.strategies.sync:AllReduce"], "reduce_bucket", _bucket_fed_n_times)
STAGE3_DIVISION = Patch(["jaxdp.strategies.zero:ZeRO"], "average_chunks", _fed_n_times)
DDP_BUFFERS = Patch(_modules_calling_ddp_buffers, "ddp_buffers", _last_device_buffers)

BUGS: Dict[str, Bug] = {b.name: b for b in (
    Bug("same_padding", "'SAME' padding on the stride-2 convs",
        _everywhere(Patch(["jaxdp.models.resnet:_Layers"], "conv", _same_padding_conv)), 0, "loss"),
    Bug("biased_var", "biased variance in BN running_var",
        _everywhere(Patch(["jaxdp.models.resnet"], "BatchNorm", _biased_var_batchnorm)), 0, "buffers",
        "running_var"),
    Bug("missing_1_over_n", "gradient reduction without 1/N", {
        "ddp": ALLREDUCE_BUCKET, "async": ALLREDUCE_BUCKET, "zero1": ALLREDUCE_BUCKET,
        "zero2": Patch(["jaxdp.strategies.zero:ZeRO"], "reduce_scatter", _fed_n_times),
        "zero3": STAGE3_DIVISION, "hsdp": STAGE3_DIVISION,
        "dp": Patch(["jaxdp.strategies.dp"], "gather_to_first", _unweighted_gather_to_first),
    }, 0, "grads", requires=_needs_several_devices),
    Bug("wrong_shard_bn", "BN running stats from the last device", {
        **dict.fromkeys(("ddp", "async", "zero1", "zero2", "zero3", "hsdp"), DDP_BUFFERS),
        "dp": Patch(["jaxdp.strategies.dp"], "local_grads", _last_chunk_stats),
    }, 0, "buffers", requires=_needs_per_device_bn),
)}


def injection(name: str, cfg) -> contextlib.AbstractContextManager:
    """The context manager that injects bug ``name`` into ``cfg``'s strategy (ParityError if it cannot)."""
    if name not in BUGS:
        raise ParityError(f"unknown bug {name!r}; choose one of {', '.join(BUGS)}")
    return BUGS[name].injection(cfg)


def patch_sites() -> List[Tuple[Any, str]]:
    """(owner, name) of every spot some injection replaces: for tests that check restoring."""
    patches = {id(p): p for bug in BUGS.values() for p in bug.patches.values()}
    return [(t, p.name) for p in patches.values() for t in p.targets()]
