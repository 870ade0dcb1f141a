"""One run of a pair on both sides: its plan, K steps of torch's ranks and of jaxdp's strategy from
a ``setup.Setup``, and the same again in float64 (what a low-precision run is measured against).
``runner.run_pair`` and ``budget.measure`` are built of these.

Nothing here imports jax or torch at module level.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

from parity_tests.own import config as run_config
from parity_tests.own.config import PairRun
from parity_tests.own.pair import Factory


def planned(run: PairRun):
    """``parity_tests.plan.plan`` for a pair: the built-in models' keys dropped from torch's config."""
    from parity_tests.plan import plan

    run_config.check(run)
    p = plan(run)
    for key in ("model", "num_classes"):
        p.torch_config.pop(key, None)
    return p


def sides(p, fac: Factory, bug: Optional[str], setup, variables=None) -> dict:
    """K steps of the plan on each side from ``setup``: ``{"torch": records, "jax": records, "seconds"}``."""
    from parity_tests.own.jax_pair import run_jax_pair
    from parity_tests.own.torch_rank import run_torch_pair

    t0 = time.perf_counter()
    torch_records = run_torch_pair(p, fac, bug, setup.state_dict, setup.batches, setup.corr.torch_buffers,
                                   setup.corr.torch_frozen)
    t1 = time.perf_counter()
    jax_records = run_jax_pair(p, setup.pair, setup.flax_model, setup.corr,
                               setup.variables if variables is None else variables, setup.batches)
    return {"torch": torch_records, "jax": jax_records, "seconds": {"torch": t1 - t0, "jax": time.perf_counter() - t1}}


def float64_reference(fac: Factory, run: PairRun, bug: Optional[str], setup) -> dict:
    """Both sides of ``run`` once more in float64, from ``setup``'s weights and batches (exact in
    float64): the reference each side's low-precision run is measured against (``budget``)."""
    import numpy as np

    from parity_tests.inputs import cast
    from parity_tests.own.jax_pair import flax_model_at

    state_dict = cast(setup.state_dict, np.float64)
    wide = dataclasses.replace(setup, state_dict=state_dict, batches=cast(setup.batches, np.float64),
                               flax_model=flax_model_at(setup.pair.flax_model, "float64"))
    return sides(planned(dataclasses.replace(run, dtype="float64")), fac, bug, wide,
                 setup.corr.to_flax(state_dict, np.float64))
