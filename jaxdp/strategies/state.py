"""The one training state every strategy uses; only its placement differs."""

from typing import Any

import flax.struct
import jax


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # optimizer updates applied so far
    params: Any
    model_state: Any  # the model's mutable collections, e.g. {"batch_stats": ...}; {} for none
    opt_state: Any
    extra: Any = None  # strategy-owned state: PowerSGD's error feedback, async's params history
