"""Data-parallel strategies, one module each, each the hooks of ``base.Strategy`` run by one engine
(``engine.py``; ``pmap_engine.py`` for dp):

- ``ddp``: replicated state, bucketed gradient all-reduce (torch DDP); ring all-reduce and
  compression hooks are options of its ``sync.AllReduce``.
- ``dp``: torch's single-controller ``nn.DataParallel`` (pmap): grads summed on device 0, params broadcast.
- ``async``: bounded-staleness parameter server: each worker reads params 0..k updates old (k = 0 is DDP).
- ``zero``: ZeRO stages 1 (optimizer state sharded), 2 (+ gradients reduce-scattered), 3 (+ params,
  gathered per FSDP unit on use) and HSDP (stage 3 within groups of a 2-D mesh), one module.

Each name is a row of ``jaxdp.registry`` (its engine class and the options the name fixes).
Each strategy carries its own facts beside its class (``factsheet.Facts``: name, torch twin, the
options it takes, what it shards, its traffic formula; ``facts(name)``; its options with defaults:
``options_of(name)``). A strategy is built with the config tree's typed options, or with option
keywords (``create_strategy``), checked in one place (``options.py``). No strategy names a model:
models bring their FSDP units.
"""

import inspect as _inspect
from typing import Dict

from jaxdp import registry
from jaxdp.strategies import options
from jaxdp.strategies.async_ps import AsyncPS
from jaxdp.strategies.base import Strategy, StrategyError
from jaxdp.strategies.ddp import DDP
from jaxdp.strategies.dp import DataParallel
from jaxdp.strategies.factsheet import Facts
from jaxdp.strategies.zero import ZeRO


def __getattr__(name):
    """``STRATEGIES`` (the names) and ``REGISTRY`` (name -> (class, the options it fixes)), read
    from ``jaxdp.registry`` when asked, so a strategy registered later is in them."""
    if name == "STRATEGIES":
        return registry.names()
    if name == "REGISTRY":
        return {n: engine_of(n) for n in registry.names()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def engine_of(name: str):
    """``name``'s engine class and the options its registry row fixes (zero3: ``stage=3``)."""
    try:
        row = registry.row(name)
    except registry.UnknownStrategy as e:
        raise StrategyError(str(e)) from None
    return row.engine_class(), dict(row.fixed)


def facts(name: str) -> Facts:
    """What ``name`` is, without building it: the facts its module defines (``factsheet.py``)."""
    cls, fixed = engine_of(name)
    return cls.facts_for(**fixed)


def options_of(name: str) -> Dict[str, object]:
    """The options a strategy name takes, with defaults: those every strategy takes and those its
    facts list (``Facts.takes``; defaults from ``StrategyOptions``), and the keywords a program wires
    in (``Strategy``'s: ``seed``, ``return_grads``, ...; a class's own where its facts list them: ``units``)."""
    cls, fixed = engine_of(name)
    takes = facts(name).takes
    found = {k: getattr(options.DEFAULTS, k) for k in options.FIELDS if k in options.COMMON or k in takes}
    for klass in reversed(cls.__mro__):
        if "__init__" in vars(klass) and issubclass(klass, Strategy):
            for p in _inspect.signature(klass.__init__).parameters.values():
                if p.kind == p.KEYWORD_ONLY and (klass is Strategy or p.name in takes):
                    found[p.name] = p.default
    # An option some name fixes selects a row of this engine: the name says it, not an option.
    selectors = {k for n in registry.names() for k in registry.row(n).fixed if registry.row(n).engine_class() is cls}
    return {k: v for k, v in found.items() if k not in selectors}


def create_strategy(name: str, model, task, tx, mesh, **keywords) -> Strategy:
    """Build a strategy by name from option keywords (the typed form: the class itself, with the
    config tree's ``StrategyOptions``; ``jaxdp.strategies.options``); an unknown name or keyword
    gets a one-line error."""
    unknown = set(keywords) - set(options_of(name))
    if unknown:
        raise StrategyError(f"strategy {name!r} takes no option {', '.join(sorted(unknown))}; "
                            f"it takes {', '.join(sorted(options_of(name)))}")
    cls, fixed = engine_of(name)
    return cls(model, task, tx, mesh, **fixed, **keywords)


__all__ = ["AsyncPS", "DDP", "DataParallel", "ZeRO", "Facts", "REGISTRY", "STRATEGIES", "Strategy", "StrategyError",
           "create_strategy", "engine_of", "facts", "options_of"]
