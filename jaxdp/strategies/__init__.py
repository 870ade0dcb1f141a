"""Data-parallel strategies, one module each. They share ``base.Strategy``:

- ``ddp``: replicated state, bucketed gradient all-reduce (torch DDP).
"""

from jaxdp.strategies.base import Strategy, StrategyError
from jaxdp.strategies.ddp import DDP

REGISTRY = {"ddp": DDP}
STRATEGIES = tuple(REGISTRY)


def create_strategy(name: str, model, tx, mesh, **options) -> Strategy:
    """Build a strategy by name; unknown names and options get a one-line error."""
    if name not in REGISTRY:
        raise StrategyError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    try:
        return REGISTRY[name](model, tx, mesh, **options)
    except TypeError as e:  # an option this strategy does not take
        raise StrategyError(f"strategy {name!r}: {e}") from None


__all__ = ["DDP", "REGISTRY", "STRATEGIES", "Strategy", "StrategyError", "create_strategy"]
