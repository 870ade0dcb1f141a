"""``PairRun``: one parity run of a user's own pair, described with ``jaxdp parity``'s options
(``ParityConfig``) less those that size the built-in models and their images.

Jax- and torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

from parity_tests.config import ParityConfig, ParityError

# jaxdp parity's options that describe the built-in ResNet/ViT, its images or its mesh layouts: a
# pair brings its own model and data. ``sync_bn`` needs a model whose BatchNorm takes its axes, and
# torch's SyncBatchNorm a GPU; ``compress`` names params by the built-in models' grammar (PowerSGD).
NOT_FOR_PAIRS = ("model", "width", "blocks", "stem", "depth", "dim", "heads", "mlp_dim", "patch", "num_classes",
                 "image_size", "dataset_size", "mesh", "microbatches", "sync_bn", "compress", "powersgd_rank",
                 "powersgd_start_iter")


@dataclass
class PairRun(ParityConfig):
    """What to run: ``strategy``, ``devices``, ``dtype`` (float64 | float32 | bfloat16), ``steps``,
    ``batch_per_device`` (rows of ``sample_batch`` per device and step), ``accum_steps``, the
    optimizer (``optimizer``, ``lr``, ``momentum``, ``nesterov``, ``weight_decay``, ``betas``,
    ``eps``, ``clip_grad_norm``, ``schedule``, ``warmup_steps``), the strategy's options
    (``bucket_cap_mb``, ``mesh_shape``, ``remat``, ...), ``seed`` (init and data), ``backend``.
    ``pair``: the factory's name, filled in by ``run_pair``."""

    pair: str = ""

    def model_options(self) -> Dict[str, Any]:
        return {}

    def model_summary(self) -> str:
        return f"pair {self.pair}"

    def run_summary(self) -> str:
        return (f"{self.model_summary()} {self.dtype}, {self.batch_per_device} rows/device, accum {self.accum_steps}, "
                f"{self.optimizer} lr {self.lr} ({self.schedule}), {self.steps} steps")


def refused_options(run: PairRun) -> List[str]:
    """The options of ``NOT_FOR_PAIRS`` that ``run`` sets (its defaults are ``ParityConfig``'s)."""
    defaults = ParityConfig()
    return [name for name in NOT_FOR_PAIRS if getattr(run, name) != getattr(defaults, name)]


def check(run: PairRun) -> None:
    given = refused_options(run)
    if given:
        flags = ", ".join("--" + n.replace("_", "-") for n in given)
        raise ParityError(f"{flags} {'does' if len(given) == 1 else 'do'} not apply to --pair: a pair brings its own "
                          "model and data (and runs on a data mesh; hsdp takes --mesh-shape)")
