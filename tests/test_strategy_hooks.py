"""A strategy writes hooks (``jaxdp.strategies.hooks``), and the engine does the rest.

A strategy class that overrides the engine's work (``step``, ``evaluate``, ``canonical``, ...) is a
second engine in disguise: its program, layout or dispatch drifts from everyone else's unnoticed.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jaxdp.strategies  # noqa: E402,F401  (every strategy module registers its class)
from jaxdp.strategies.base import Strategy  # noqa: E402
from jaxdp.strategies.engine import Engine, ShardMapEngine  # noqa: E402
from jaxdp.strategies.hooks import StrategyHooks  # noqa: E402

HOOKS = set(StrategyHooks.__annotations__) | {n for n in vars(StrategyHooks) if not n.startswith("_")}


def strategy_classes():
    found, todo = [], list(Strategy.__subclasses__())
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return [c for c in found if c.__module__.startswith("jaxdp.strategies.")]


def test_strategies_override_only_the_hooks():
    classes = strategy_classes()
    assert {c.__name__ for c in classes} >= {"DDP", "ZeRO", "DataParallel", "AsyncPS"}
    for cls in classes:
        overridden = {n for n in vars(cls) if hasattr(Strategy, n) and not n.startswith("__")} - {"facts_for"}
        assert overridden <= HOOKS, f"{cls.__name__} overrides the engine's {sorted(overridden - HOOKS)}"


def test_the_hooks_have_defaults_but_local_step():
    """What a strategy must write is ``local_step``; every other hook has a default on ``Strategy``."""
    assert HOOKS >= {"local_step", "local_eval", "init_extra", "extra_specs", "learn_units", "batch_axes",
                     "check_vma", "sync", "engine_class", "facts", "model_parallel"}
    assert all(hasattr(Strategy, hook) for hook in HOOKS)


def test_strategy_is_its_hooks_and_what_they_share():
    """The engine is the front (``strategy.engine.step``, ``.init``, ``.canonical``, ...): no name of
    ``Strategy`` forwards to it, and none is another module's function under a second name."""
    import inspect

    engine_names = {n for cls in (Engine, ShardMapEngine) for n in vars(cls) if not n.startswith("_")}
    assert not engine_names & set(vars(Strategy)), sorted(engine_names & set(vars(Strategy)))
    aliases = sorted(n for n, v in vars(Strategy).items() if inspect.isfunction(v) and v.__module__ != Strategy.__module__)
    assert aliases == []
