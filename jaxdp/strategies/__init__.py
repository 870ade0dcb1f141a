"""Data-parallel strategies, one module each. They share ``base.Strategy``:

- ``ddp``: replicated state, bucketed gradient all-reduce (torch DDP); ring all-reduce and compression options.
- ``dp``: torch's single-controller ``nn.DataParallel`` (pmap): grads summed on device 0, params broadcast.
- ``async``: bounded-staleness parameter server: each worker reads params 0..k updates old (k = 0 is DDP).
- ``zero1``: DDP with the optimizer state sharded; updated params all-gathered.
- ``zero2``: ZeRO-1 with gradients reduce-scattered instead of all-reduced.
- ``zero3``: params sharded too, gathered per unit (block) on use and again in backward (FSDP).
- ``hsdp``: ZeRO-3 within each shard group of an (R, S) mesh, all-reduce across the R replicas.
"""

from jaxdp.strategies.base import Strategy, StrategyError
from jaxdp.strategies.async_ps import AsyncPS
from jaxdp.strategies.ddp import DDP
from jaxdp.strategies.dp import DataParallel
from jaxdp.strategies.hsdp import HSDP
from jaxdp.strategies.zero1 import ZeRO1
from jaxdp.strategies.zero2 import ZeRO2
from jaxdp.strategies.zero3 import ZeRO3

REGISTRY = {"ddp": DDP, "zero1": ZeRO1, "zero2": ZeRO2, "zero3": ZeRO3, "hsdp": HSDP,
            "dp": DataParallel, "async": AsyncPS}
STRATEGIES = tuple(REGISTRY)


def create_strategy(name: str, model, tx, mesh, **options) -> Strategy:
    """Build a strategy by name; unknown names and options get a one-line error."""
    if name not in REGISTRY:
        raise StrategyError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    try:
        return REGISTRY[name](model, tx, mesh, **options)
    except TypeError as e:  # an option this strategy does not take
        raise StrategyError(f"strategy {name!r}: {e}") from None


__all__ = ["AsyncPS", "DDP", "DataParallel", "HSDP", "ZeRO1", "ZeRO2", "ZeRO3", "REGISTRY", "STRATEGIES", "Strategy", "StrategyError", "create_strategy"]
