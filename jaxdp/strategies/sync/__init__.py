"""Gradient synchronisation: small transforms shaped like optax's, each with its own state.

A transform has ``init(params, n) -> state``, ``update(grads, state, where) -> (grads, state)``,
``specs(axis)`` (where its state lives; None: nowhere, it has none) and ``stored`` /
``from_stored`` (its state's checkpoint form, which does not depend on the device count).
``where`` (``Where``) is what it needs to know about the step it runs in. A strategy holds one,
as ``strategy.sync``, and its state is ``TrainState.extra``:

- ``allreduce.AllReduce``: DDP's gradient all-reduce, in torch's buckets (``buckets.py``), with
  torch's communication hooks as options: the ring (``ring.py``), bf16/fp16 (``low_precision.py``)
  and PowerSGD (``powersgd.py``). ddp, async and zero1 use it;
- ``sharded.ReduceScatter``: each device receives its chunk of the average (zero2);
- ``sharded.GatherOnUse``: the params gathered per FSDP unit on use, whose transposes have
  reduce-scattered the gradient already (zero3, hsdp).
"""

from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class Where:
    """The step a sync runs in, per device inside ``jax.shard_map``."""

    step: Any  # the updates so far (PowerSGD's iteration count)
    axis: Any  # the axis, or axes, the gradient is averaged over
    n: int  # the data-parallel devices it is averaged over
    order: Sequence = ()  # the params' definition order (DDP's buckets run in reverse)
    shards: int = 1  # the devices a chunked tensor is split over
    groups: Sequence = ()  # DDP's buckets as groups of leaf indices (what a sharded sync moves at once)


class Stateless:
    """The state half of a transform that has none."""

    stateful = False

    def init(self, params, n: int):
        return None

    def specs(self, axis):
        return None

    def stored(self, state):
        return state

    def from_stored(self, stored, n: int):
        return stored
