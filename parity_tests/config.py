"""A parity run's configuration: one step's options (``jaxdp.config.step``, the names
``jaxdp train`` and torch_ref use) plus the run's size and the harness's own.

The defaults are a tiny float64 ResNet for a few steps on 2 devices: tight bounds in seconds.
Jax- and torch-free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from jaxdp import names
from jaxdp.config.step import ModelOptions, OptimizerOptions, StrategyOptions


class ParityError(ValueError):
    """A parity run that cannot be set up as asked (unknown pair, impossible option)."""


@dataclass
class ParityConfig(OptimizerOptions, ModelOptions, StrategyOptions):
    # the step's defaults changed for parity: a tiny model, float64, a small lr, PowerSGD early
    width: int = 4
    blocks: Optional[Tuple[int, ...]] = (1, 1, 1, 1)
    dtype: str = "float64"
    lr: float = 0.01
    powersgd_start_iter: int = 2
    # the run
    steps: int = 5
    devices: int = 2
    mesh: Optional[str] = None  # named axis sizes, "data=2,model=2" (parity_tests.layouts): their product is devices
    microbatches: Optional[int] = None  # pipeline micro-batches with a stage axis in mesh (default: the stage count)
    batch_per_device: int = 8
    image_size: int = 32  # centre crop of the 32x32 images (a ViT's position embeddings follow it)
    dataset_size: int = 256
    seed: int = 0
    # the harness
    timeout_s: float = 300.0
    backend: str = "auto"  # torch side: auto | nccl | gloo (torch_ref.dist.resolve_backend)
    torch_cudnn: str = "on"  # on | off: torch's own CUDA convolutions as a reference (parity_mode)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def model_options(self) -> Dict[str, Any]:
        """The options of this model's family (``jaxdp.names``), as both ``create_model``s take them;
        one left None keeps the named model's, and a ViT's image_size is the crop. (The ResNet
        fields have parity's defaults, so another family ignores them; a ViT size given for
        another family's model is refused.)"""
        own = names.family(self.model)
        stray = [k for k in names.VIT_SIZES if k not in own.options and getattr(self, k) is not None]
        if stray:
            raise ValueError(f"{', '.join(stray)} size a ViT, not {self.model}")
        values = {k: getattr(self, k) for k in own.options}
        if values.get("blocks"):
            values["blocks"] = tuple(values["blocks"])
        return {k: v for k, v in values.items() if v is not None}

    def run_summary(self) -> str:
        """The report's line on the model, data and optimizer (``report.header``)."""
        return (f"{self.model_summary()} {self.dtype}, {self.image_size}x{self.image_size}, "
                f"{self.batch_per_device}/device, accum {self.accum_steps}, sync_bn {self.sync_bn}, "
                f"{self.optimizer} lr {self.lr} ({self.schedule}), {self.steps} steps")

    def model_summary(self) -> str:
        """'resnet18 width 4 blocks (1, 1, 1, 1)' or 'vit-tiny depth 2 dim 16 ...' for reports."""
        opts = {k: v for k, v in self.model_options().items() if k not in ("stem", "image_size")}
        return " ".join([self.model, *(f"{k} {v}" for k, v in opts.items())])
