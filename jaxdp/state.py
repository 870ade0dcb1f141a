"""The one training state every strategy uses; only its placement differs."""

from typing import Any

import flax.struct
import jax


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # optimizer updates applied so far
    params: Any
    batch_stats: Any
    opt_state: Any
    extra: Any = None  # strategy-owned state, e.g. compression error feedback
