"""A pair of models of the user's own: what they give, and how the harness finds it again in
every torch rank.

The torch ranks are separate processes (``torch_ref.launcher``: a forkserver), so the pair
reaches them by name: a *factory*, a module-level function that returns the ``ModelPair``,
named ``package.module:function`` (or given as the function itself, or a
``functools.partial`` of one, which pickles by reference). Each rank imports it and builds
its own copy; the weights come from the harness (the one init it made, or the weights the
factory loaded, copied from the harness's process), never from a rank's own init.

Jax- and torch-free at import: a pair's module is imported only when a run needs it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
import pickle
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

from parity_tests.config import ParityError


# where both sides' first weights come from: torch's init under the run's seed, Flax's ``init``
# with it, or the weights the factory loaded into the torch model (a checkpoint: no seed)
INIT_FROM = ("torch", "flax", "loaded")


class PairError(ParityError):
    """A pair that cannot run, or cannot reach the torch ranks: one line that says why."""


@dataclass(frozen=True)
class ModelPair:
    """Your model twice: in Flax and in PyTorch, and what both sides compute on a batch.

    A batch is a dict of numpy arrays sharing a leading batch dimension (``sample_batch``);
    each side gets it as its own arrays (floating leaves in the run's dtype, integer leaves as
    jnp int32 / torch int64).

    - ``flax_model``: a ``flax.linen.Module``. If it has a ``dtype`` field (the compute dtype its
      layers take, Flax's convention) the harness sets it to the run's: float64, float32, or
      bfloat16 over float32 params (and ``param_dtype``, if it has one, to the params' dtype).
      Or a Flax NNX ``nnx.Module``, built with its params: the harness sets the ``dtype``
      attribute of every submodule that has one and casts its Params and BatchStats to the
      params' dtype (``parity_tests.own.nnx_pair``); its names are its attribute paths
      (``blocks/0/qkv``), and it trains through jaxdp's NNX path.
    - ``torch_model``: an ``nn.Module`` on the CPU; its float32 init (under
      ``torch.manual_seed(seed)``) is copied to both sides (``init_from="flax"``: the Flax
      model's ``init`` instead; ``init_from="loaded"``: the weights the factory loaded into it,
      ``from_pretrained`` or ``load_state_dict``, kept as they are whatever the seed).
    - ``sample_batch(rng, rows)``: ``rows`` rows of data from a ``numpy.random.Generator``.
    - ``flax_loss(outputs, batch)``, ``torch_loss(outputs, batch)``: a scalar, or per-element
      losses that the harness averages (torch's ``reduction="mean"``). Under bfloat16 the
      floating outputs reach the loss in float32 on both sides.
    - ``flax_inputs(batch)``, ``torch_inputs(batch)``: the model's arguments taken from a batch:
      a tuple of positional arguments, a dict of keyword arguments, or both as ``(args, kwargs)``
      (default ``(batch,)``; ``torch_inputs`` defaults to ``flax_inputs``, which works when it
      only indexes). ``flax_kwargs``: keyword arguments of every Flax call (``{"train": True}``);
      the torch model runs in ``train()`` mode.
    - ``correspondence``: what the rules of ``parity_tests.own.correspondence`` cannot match: a
      dict ``{torch name: "collection/flax/path" | (path, layout) | None}`` (None: a torch
      tensor with no Flax counterpart, e.g. a constant buffer, not compared), or a function
      ``(torch name, torch shape) -> path | (path, layout) | None`` (None: no opinion).
    - ``flax_units``, ``torch_units``: the FSDP units for zero2/zero3/hsdp, module classes or
      path patterns (Flax: '/'-joined, ``"blocks_*"``, NNX ``"blocks/*"``; torch: '.'-joined, ``"blocks.*"``).
      They must cut the model alike (checked through the correspondence).
    """

    flax_model: Any
    torch_model: Any
    sample_batch: Callable[[Any, int], Mapping[str, Any]]
    flax_loss: Callable[[Any, Mapping[str, Any]], Any]
    torch_loss: Callable[[Any, Mapping[str, Any]], Any]
    flax_inputs: Optional[Callable[[Mapping[str, Any]], tuple]] = None
    torch_inputs: Optional[Callable[[Mapping[str, Any]], tuple]] = None
    flax_kwargs: Mapping[str, Any] = field(default_factory=dict)
    correspondence: Union[Mapping[str, Any], Callable, None] = None
    flax_units: Sequence[Any] = ()
    torch_units: Sequence[Any] = ()
    init_from: str = "torch"
    name: str = ""

    def inputs(self, side: str) -> Callable[[Mapping[str, Any]], Any]:
        """How ``side`` ("flax" or "torch") takes the model's arguments from a batch."""
        flax_inputs = self.flax_inputs or _whole_batch
        return flax_inputs if side == "flax" else (self.torch_inputs or flax_inputs)

    def arguments(self, side: str, batch: Mapping[str, Any]) -> Tuple[tuple, Dict[str, Any]]:
        """``side``'s call on ``batch`` as ``(args, kwargs)``; the Flax side's ``flax_kwargs`` included."""
        args, kwargs = call_arguments(self.inputs(side)(batch), f"{side}_inputs")
        return args, ({**self.flax_kwargs, **kwargs} if side == "flax" else kwargs)

    def replace(self, **changes) -> "ModelPair":
        return dataclasses.replace(self, **changes)


def _whole_batch(batch):
    return (batch,)


def call_arguments(given: Any, what: str) -> Tuple[tuple, Dict[str, Any]]:
    """What an inputs function returned, as ``(args, kwargs)``: a tuple (or list) of positional
    arguments, a dict of keyword arguments, or ``(args, kwargs)``; ``PairError`` otherwise."""
    if isinstance(given, Mapping):
        return (), dict(given)
    if (isinstance(given, tuple) and len(given) == 2 and isinstance(given[0], (tuple, list))
            and isinstance(given[1], Mapping)):
        return tuple(given[0]), dict(given[1])
    if isinstance(given, (tuple, list)):
        return tuple(given), {}
    raise PairError(f"{what} returned {type(given).__name__}: it returns the model's arguments as a tuple, "
                    "a dict of keyword arguments, or (args tuple, kwargs dict)")


# ----------------------------------------------------------------------------- the factory


@dataclass(frozen=True)
class Factory:
    """How every process finds the pair: ``ref`` ("module:function") or a picklable callable."""

    ref: Union[str, Callable[[], ModelPair]]

    @property
    def label(self) -> str:
        if isinstance(self.ref, str):
            return self.ref
        fn = self.ref.func if isinstance(self.ref, functools.partial) else self.ref
        return f"{fn.__module__}:{fn.__qualname__}" + ("(...)" if fn is not self.ref else "")

    def build(self) -> ModelPair:
        make = resolve(self.ref) if isinstance(self.ref, str) else self.ref
        pair = make()
        if not isinstance(pair, ModelPair):
            raise PairError(f"{self.label} returned {type(pair).__name__}, not a parity_tests.own.ModelPair")
        if pair.init_from not in INIT_FROM:
            raise PairError(f"{self.label}: init_from must be one of {', '.join(map(repr, INIT_FROM))}, "
                            f"got {pair.init_from!r}")
        return pair


def factory(pair: Any) -> Factory:
    """``pair`` as a ``Factory`` every torch rank can use, or ``PairError`` in one line: a name
    "module:function", a module-level function, or a ``functools.partial`` of one."""
    if isinstance(pair, Factory):
        return pair
    if isinstance(pair, str):
        resolve(pair)  # refused here, in the caller's process, if it cannot be found
        return Factory(pair)
    if isinstance(pair, ModelPair):
        raise PairError("pass the function that builds the pair (or its name, 'module:function'), not the pair: "
                        "the torch ranks are separate processes and build it themselves")
    if not callable(pair):
        raise PairError(f"a pair is named 'module:function' or given as that function, got {type(pair).__name__}")
    _called_without_arguments(pair, getattr(pair, "__qualname__", type(pair).__name__))
    fn = pair.func if isinstance(pair, functools.partial) else pair
    qualname = getattr(fn, "__qualname__", "")
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise PairError(f"the pair factory {qualname} is a lambda or a local function, which the torch ranks "
                        "(separate processes) cannot import: define it at module level")
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        raise PairError(f"the pair factory {qualname} lives in an interactive session, which the torch ranks "
                        "(separate processes) cannot import: put it in a module and pass 'module:function'")
    try:
        pickle.dumps(pair)
    except Exception as e:  # noqa: BLE001 - any pickling failure means the ranks cannot get it
        raise PairError(f"the pair factory cannot be sent to the torch ranks ({type(e).__name__}: {e}): "
                        "pass a module-level function or its name 'module:function'") from None
    return Factory(pair)


def resolve(ref: str) -> Callable[[], ModelPair]:
    """The function named ``package.module:function``. The current directory is searched too (as
    ``python -m`` does), so ``examples.parity_own_model:make_pair`` works from a clone's root."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise PairError(f"--pair takes package.module:function, got {ref!r}")
    try:
        module = _import(module_name)
    except ImportError as e:
        raise PairError(f"cannot import {module_name!r} for pair {ref!r}: {e}") from None
    try:
        fn = functools.reduce(getattr, attr.split("."), module)
    except AttributeError:
        raise PairError(f"{module_name} has no {attr!r} (pair {ref!r})") from None
    if not callable(fn):
        raise PairError(f"{ref} is a {type(fn).__name__}, not a function that returns the pair")
    _called_without_arguments(fn, ref)
    return fn


def _called_without_arguments(fn: Callable, label: str) -> None:
    """``PairError`` in one line for a callable that cannot be called with no arguments, as every
    rank calls a pair factory (``os:system``, say), before anything is started."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (some builtins): called as it is
        return
    try:
        signature.bind()
    except TypeError:
        raise PairError(f"{label} takes arguments {signature}: a pair factory is called with none and returns a "
                        "parity_tests.own.ModelPair") from None


def _import(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        top = module_name.split(".")[0]
        if e.name != top or os.getcwd() in sys.path:
            raise
    # The ranks inherit this process's sys.path (multiprocessing's preparation data): they find it too.
    sys.path.insert(0, os.getcwd())
    return importlib.import_module(module_name)
