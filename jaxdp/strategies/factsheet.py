"""A strategy's facts: what config, inspect, bench and the parity harness know about it without building one.

Each strategy module defines its own ``Facts`` beside its class (``ddp.FACTS``, ``zero.facts_for``);
``jaxdp.strategies.facts(name)`` finds them through the registry. The options a strategy takes are
``takes`` (and those every strategy takes, ``options.COMMON``): ``jaxdp.strategies.options`` refuses
any other, with ``why_not``'s reason where the name has one.
"""

from dataclasses import dataclass, field
from typing import Any, Callable, FrozenSet, Mapping, Optional, Tuple


@dataclass(frozen=True)
class Sizes:
    """What a traffic formula is written in: ring bytes each device sends per step."""

    psi: int  # Ψ, params
    psi_pad: int  # Ψ_pad: params padded for the shard count (``layout.padded_shape``)
    n: int  # devices
    p: int  # bytes per param
    allreduce: float = 0.0  # the gradient all-reduce's ring bytes, 2(N-1)/N·cΨ or PowerSGD's (with its options)
    mesh_shape: Optional[Tuple[int, int]] = None  # hsdp's (R, S)
    root_pad: int = 0  # Ψ_root padded: the params outside every FSDP unit, gathered once per step, not twice


@dataclass(frozen=True)
class Facts:
    name: str
    twin: str = ""  # the PyTorch twin, in words (torch_ref's name for it: the registry row's ``torch_twin``)
    twin_when: Mapping[str, Any] = field(default_factory=dict)  # options the twin needs, e.g. async's staleness 0
    sharded: Tuple[str, ...] = ()  # which of "params", "grads", "opt" a device holds 1/N of (hsdp: 1/S)
    traffic: Optional[Callable[[Sizes], float]] = None  # ring bytes per device per step (None: not known)
    traffic_text: str = "unknown"  # the same in symbols; "{allreduce}" stands for the all-reduce's
    takes: FrozenSet[str] = frozenset()  # its options: StrategyOptions fields, and keywords of its own (units)
    why_not: Mapping[str, str] = field(default_factory=dict)  # why it refuses an option others take
