"""The strategy registry: every strategy as one row of data, importable without jax.

A row says what a strategy name is to everyone who reads names: the CLI's choices (before
jax loads), ``create_strategy``, ``jaxdp plan``, ``jaxdp bench``, the parity harness (its pairs,
float64 cases and injected bugs), gpu-check and torch_ref. Nothing outside this module lists the
strategy names, and nothing branches on one: what differs is an attribute of a row, of its
engine class or of its torch twin. (The other names a user picks: ``jaxdp.names``.)

A strategy with a torch twin is three files: its module (the engine class), its row here, and its
twin in torch_ref (a ``torch_ref.strategies.Twin``, which ``torch_twin`` names).

A row (``Row``):

- ``name``: what the user types (``--strategy zero3``, ``Trainer(strategy="zero3")``).
- ``engine``: the class that runs it, ``"module:Class"`` (imported on first use: this module
  imports no jax) or the class itself (a strategy defined in a test or a user's script).
- ``fixed``: the constructor options the name fixes (zero3: ``stage=3``). The options it takes,
  with their defaults, are the engine constructor's other keywords (``jaxdp.strategies.options_of``):
  one of them, ``units``, says it gathers params per FSDP unit. Whether it runs beside a ``model``
  axis is its engine's ``model_parallel``, and its formulas are its engine's ``Facts``.
- ``torch_twin``: its PyTorch twin: a name of ``torch_ref.strategies.TWINS`` (the built-in ones), or
  ``"module:attr"``, a ``Twin`` in a module of its own (``torch_ref.strategies.twin`` resolves it,
  in every torch rank too); a row with one is paired by ``jaxdp parity``; None: no twin.
  ``twin_without_gpus``: the twin used when there are fewer CUDA GPUs than devices (dp: DDP).
- ``replicas``: whether its mesh has a replica axis (replicate x shard). Without one its degrees on
  N devices are (1, N); with one, the mesh object's default (``jaxdp.runtime.mesh.MeshDims.hsdp_default``).
- ``planned``: ``jaxdp plan`` weighs it (dp is a single-controller pmap, not a mesh candidate).
- ``gpu_checked``: gpu-check pairs it (async's pair at staleness 0 is ddp's).

``register`` adds a row (a test's toy strategy too); ``registered`` adds one for a ``with`` block.
"""

import contextlib
import importlib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple, Union

from jaxdp.runtime.mesh import MeshDims  # jax-free: the degrees of a mesh

# DDP's gradient bucket cap in MiB, the one default of the CLI, the library and torch_ref.
# None is torch DDP's own default: a 1 MiB first bucket, then 25 MiB (jaxdp.strategies.sync.buckets).
BUCKET_CAP_MB: Optional[float] = None


@dataclass(frozen=True)
class Row:
    name: str
    engine: Union[str, type]
    fixed: Mapping[str, Any] = field(default_factory=dict)
    torch_twin: Optional[str] = None
    twin_without_gpus: Optional[str] = None
    replicas: bool = False
    planned: bool = True
    gpu_checked: bool = True

    def engine_class(self) -> type:
        if not isinstance(self.engine, str):
            return self.engine
        module, _, name = self.engine.partition(":")
        return getattr(importlib.import_module(module), name)


_ZERO = "jaxdp.strategies.zero:ZeRO"
_ROWS: Dict[str, Row] = {}


class UnknownStrategy(ValueError):
    """A name no row has (one line naming the choices)."""


def register(row: Row) -> Row:
    if row.name in _ROWS:
        raise ValueError(f"strategy {row.name!r} is registered already")
    _ROWS[row.name] = row
    return row


def unregister(name: str) -> None:
    _ROWS.pop(name, None)


@contextlib.contextmanager
def registered(row: Row) -> Iterator[Row]:
    """``row`` registered for the ``with`` block, removed after it whatever happens."""
    register(row)
    try:
        yield row
    finally:
        unregister(row.name)


def row(name: str) -> Row:
    if name not in _ROWS:
        raise UnknownStrategy(f"unknown strategy {name!r}; choose one of {', '.join(_ROWS)}")
    return _ROWS[name]


def names(**wanted) -> Tuple[str, ...]:
    """The registered names in registration order; ``names(planned=True)``: those whose row has it so."""
    return tuple(n for n, r in _ROWS.items() if all(getattr(r, k) == v for k, v in wanted.items()))


def mesh_shape(name: str, n: int) -> Optional[Tuple[int, int]]:
    """The (replicas, shards) both frameworks run ``name`` on at ``n`` devices on one host; None
    for a strategy without a replica axis (its mesh is the 1-D data axis)."""
    return MeshDims.hsdp_default(n) if row(name).replicas else None


for _row in (
    Row("ddp", "jaxdp.strategies.ddp:DDP", torch_twin="ddp"),
    Row("zero1", _ZERO, {"stage": 1}, torch_twin="zero1"),
    Row("zero2", _ZERO, {"stage": 2}, torch_twin="zero2"),
    Row("zero3", _ZERO, {"stage": 3}, torch_twin="zero3"),
    Row("hsdp", _ZERO, {"stage": 3, "hsdp": True}, torch_twin="hsdp", replicas=True),
    Row("dp", "jaxdp.strategies.dp:DataParallel", torch_twin="dp", twin_without_gpus="ddp", planned=False),
    Row("async", "jaxdp.strategies.async_ps:AsyncPS", torch_twin="ddp", gpu_checked=False),
):
    register(_row)
