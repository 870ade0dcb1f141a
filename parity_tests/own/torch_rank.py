"""torch_ref's side of a pair's run: each rank builds the pair from its factory, and steps it
with torch_ref's ``Runner`` (``step_api.build``: the same wrappers, optimizers, schedules and
record as the built-in pairs), the pair supplying the model, the batches, the loss and the
FSDP units (``PairTask``). The ranks come from ``torch_ref.launcher.run_ranks``.

Nothing here imports torch at module level (the parent process imports this module too).
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from parity_tests.own.outputs import map_arrays
from parity_tests.own.pair import Factory, ModelPair


class PairTask:
    """``step_api``'s task for a pair: dict batches, the pair's inputs (args and kwargs) and loss
    (averaged; the outputs in their own containers), and the torch buffers the correspondence maps
    as the compared buffers."""

    def __init__(self, pair: ModelPair, buffers: Sequence[str], dtype: str):
        self.pair, self.buffers, self.dtype = pair, frozenset(buffers), dtype

    def to_device(self, batch: Mapping[str, np.ndarray], device, dtype, memory_format=None):
        import torch

        def one(x):
            t = torch.from_numpy(np.ascontiguousarray(x))
            return t.to(device=device, dtype=dtype if t.is_floating_point() else torch.int64)

        return {k: one(v) for k, v in batch.items()}

    def rows(self, batch) -> int:
        return next(iter(batch.values())).shape[0]

    def split(self, batch, k: int):
        chunks = {name: x.chunk(k) for name, x in batch.items()}
        return [{name: c[i] for name, c in chunks.items()} for i in range(k)]

    def loss(self, model, micro):
        import torch

        args, kwargs = self.pair.arguments("torch", micro)
        outputs = model(*args, **kwargs)
        if self.dtype == "bfloat16":  # the loss in float32, as jaxdp's side computes it
            outputs = map_arrays(outputs, lambda t: t.float() if torch.is_floating_point(t) else t)
        return self.pair.torch_loss(outputs, micro).mean(), None

    def compared_buffer(self, name: str) -> bool:
        return name in self.buffers


def build_pair(fac: Factory, bug: Optional[str], seed: int, run=None) -> ModelPair:
    """The pair as every process builds it: the torch model initialised under ``manual_seed(seed)``,
    then ``bug`` (``parity_tests.own.bugs``) applied to it, once ``run`` (if given) is one that can show it."""
    import torch

    from parity_tests.own import bugs

    torch.manual_seed(seed)
    pair = fac.build()
    if run is not None:
        bugs.check(bug, pair, run)
    return bugs.on_pair(bug, pair)


def pair_rank_steps(fac: Factory, bug: Optional[str], config: Mapping[str, Any], state_dict: Mapping[str, Any],
                    batches: List[Mapping[str, np.ndarray]], buffers: Sequence[str],
                    frozen: Sequence[str] = ()) -> Optional[List[dict]]:
    """One rank's work: the pair's torch model stepped on this rank's batches (rank 0's records;
    the ``frozen`` parameters, which do not train, recorded as values: ``non_trainable.torch_record``)."""
    from parity_tests.own import bugs, non_trainable
    from torch_ref import dist as tdist
    from torch_ref.step_api import build

    pair = build_pair(fac, bug, config["seed"])
    with bugs.in_torch_rank(bug):
        runner = build(config, state_dict, model=pair.torch_model, task=PairTask(pair, buffers, config["dtype"]),
                       units=tuple(pair.torch_units))
        records = [runner.step(batch) for batch in batches]
    return [non_trainable.torch_record(r, frozen) for r in records] if tdist.rank() == 0 else None


def per_rank(batches: Sequence[Mapping[str, np.ndarray]], p) -> List[List[Dict[str, np.ndarray]]]:
    """The global batches (rows in device order) as each torch rank's rows: rank r takes device r's
    block; one rank (N = 1, or ``p.full_batch``) takes every row, micro-batch k being every
    device's micro-batch k (``inputs.one_process_rows``), as jaxdp's accumulation splits them."""
    from parity_tests.inputs import one_process_rows

    n, k = p.cfg.devices, p.cfg.accum_steps
    out: List[List[Dict[str, np.ndarray]]] = [[] for _ in range(p.world)]
    for batch in batches:
        blocks = {name: x.reshape(n, -1, *x.shape[1:]) for name, x in batch.items()}
        if p.world == 1:
            out[0].append({name: one_process_rows(x, k)[0] for name, x in blocks.items()})
        else:
            for r in range(p.world):
                out[r].append({name: np.ascontiguousarray(x[r]) for name, x in blocks.items()})
    return out


def run_torch_pair(p, fac: Factory, bug: Optional[str], state_dict: Mapping[str, np.ndarray],
                   batches: Sequence[Mapping[str, np.ndarray]], buffers: Sequence[str],
                   frozen: Sequence[str] = ()) -> List[dict]:
    """The plan's torch ranks (``torch_ref.launcher.run_ranks``, gloo or nccl), each in parity mode."""
    from parity_tests.parity_mode import torch_rank_setup
    from torch_ref.launcher import run_ranks

    feed = per_rank(batches, p)
    info: Dict[str, Any] = {}
    args = [(fac, bug, p.torch_config, dict(state_dict), feed[r], list(buffers), list(frozen)) for r in range(p.world)]
    out = run_ranks(p.world, pair_rank_steps, args, backend=p.backend, timeout_s=p.cfg.timeout_s, info=info,
                    rank_setup=functools.partial(torch_rank_setup, cudnn=p.cfg.torch_cudnn == "on"))
    p.torch_ranks = info["ranks"]
    return out[0]
