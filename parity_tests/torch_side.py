"""torch_ref's side of a parity run: K steps on the plan's ranks (``torch_ref.launcher``), and
a cache of those runs, since several jaxdp pairs share one twin (ddp, dp, ring and async all
run against DDP) and the injected bugs share the clean run's.

The cache lives in the process, and, where ``JAXDP_PARITY_TORCH_CACHE`` names a directory, in
files there too: the test session sets it (conftest), so that its xdist workers share each torch
run, whichever test module needs it first.

Nothing here imports torch at module level.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from parity_tests.inputs import full_batch_order
from parity_tests.plan import Plan

_TORCH_RUNS: Dict[Any, List[dict]] = {}  # torch_cache_key, or (key, steps) for a prefix
_TORCH_RANKS: Dict[str, List[dict]] = {}  # torch_cache_key -> the ranks' rank_info


SHARED_CACHE_ENV = "JAXDP_PARITY_TORCH_CACHE"


def torch_records(p: Plan, state_dict: Mapping[str, np.ndarray], batches: Sequence[Tuple[np.ndarray, np.ndarray]],
                  *, steps: Optional[int] = None, reuse: bool = False) -> List[dict]:
    """torch_ref's records of the first ``steps`` of ``batches`` (the plan's run; default all of it).
    ``reuse``: from an earlier identical torch run (``torch_cache_key``) if there is one, and kept
    for the next; with a shared cache directory, the whole run is computed and kept."""
    steps = len(batches) if steps is None else steps
    if not reuse:
        return run_torch(p, state_dict, batches[:steps])
    key = torch_cache_key(p)
    cached = _TORCH_RUNS.get(key) or _TORCH_RUNS.get((key, steps))
    if cached is not None:
        return cached
    directory = os.environ.get(SHARED_CACHE_ENV)
    if directory:
        records = _shared_run(directory, key, p, lambda: run_torch(p, state_dict, batches))
        _TORCH_RUNS[key] = records
        return records
    records = run_torch(p, state_dict, batches[:steps])
    _TORCH_RUNS[key if steps == p.cfg.steps else (key, steps)] = records
    return records


def _shared_run(directory: str, key: str, p: Plan, run: Callable[[], List[dict]]) -> List[dict]:
    """``run()``'s records, computed once for every process that shares ``directory``: the
    first to ask runs it while the others wait on the key's lock, then read its file."""
    import fcntl
    import hashlib
    import pickle

    path = os.path.join(directory, hashlib.sha256(key.encode()).hexdigest()[:32] + ".pkl")
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(path):
            with open(path, "rb") as f:
                records, ranks = pickle.load(f)
            p.torch_ranks = _TORCH_RANKS[key] = ranks
            return records
        records = run()
        with open(path + ".tmp", "wb") as f:
            pickle.dump((records, p.torch_ranks), f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(path + ".tmp", path)
        return records


def run_torch(p: Plan, state_dict: Mapping[str, np.ndarray],
              batches: Sequence[Tuple[np.ndarray, np.ndarray]]) -> List[dict]:
    """K torch_ref steps on ``p.world`` ranks (``torch_ref.launcher.run_steps``), each in parity
    mode (``parity_mode.torch_rank_setup``: cuDNN's deterministic heuristic engines, no TF32)."""
    from parity_tests.parity_mode import torch_rank_setup
    from torch_ref.launcher import run_steps

    if p.full_batch or p.world == 1:
        feed = [full_batch_order(x, y, p.cfg.accum_steps) for x, y in batches]
    else:
        feed = list(batches)
    info: Dict[str, Any] = {}
    records = run_steps(p.world, p.torch_config, dict(state_dict), feed, timeout_s=p.cfg.timeout_s,
                        backend=p.backend, info=info,
                        rank_setup=functools.partial(torch_rank_setup, cudnn=p.cfg.torch_cudnn == "on"))
    p.torch_ranks = _TORCH_RANKS[torch_cache_key(p)] = info["ranks"]
    return records


def torch_ranks(p: Plan) -> Optional[List[dict]]:
    """Each torch rank's device, backend and TF32 flags (``torch_ref.launcher.rank_info``),
    also when the records came from an earlier identical run (``reuse_torch``)."""
    return p.torch_ranks or _TORCH_RANKS.get(torch_cache_key(p))


def torch_cache_key(p: Plan) -> str:
    """Runs with equal keys give equal torch results: tests share one launch between pairs
    whose twins are the same torch computation (e.g. ddp, dp, ring and async vs DDP)."""
    c = p.cfg
    tc = {k: (sorted((n, v.tobytes()) for n, v in val.items()) if k == "powersgd_q" else val)
          for k, val in p.torch_config.items()}
    return repr((p.world, p.full_batch, sorted(tc.items(), key=lambda kv: kv[0]), c.devices,
                 c.batch_per_device, c.image_size, c.dataset_size, c.seed, c.steps, p.backend, c.torch_cudnn))
