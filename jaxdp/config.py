"""The training run's configuration: one flat dataclass shared by the CLI and the trainer."""

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Optional, Tuple


@dataclass
class TrainConfig:
    # what to train
    model: str = "resnet18"
    width: int = 64
    blocks: Optional[Tuple[int, int, int, int]] = None
    stem: str = "cifar"
    dtype: str = "float32"
    # data
    dataset: str = "synthetic"
    data_dir: Optional[str] = None
    download: bool = False
    synthetic_size: Tuple[int, int] = (10000, 2000)
    # how to train it
    strategy: str = "ddp"
    devices: Optional[int] = None  # default: every device
    global_batch_size: int = 128
    accum_steps: int = 1
    sync_bn: bool = False
    bucket_cap_mb: float = 25.0
    strategy_options: dict = field(default_factory=dict)  # strategy-specific extras
    # optimisation
    epochs: int = 1
    optimizer: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-4
    schedule: str = "cosine"
    warmup_steps: int = 0
    seed: int = 0
    # bookkeeping
    out: str = "runs/default"
    resume: bool = False
    checkpoint_every: int = 0  # steps; 0 = once per epoch
    progress: bool = True

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def fingerprint(self) -> dict:
        """The fields a resumed run must share with the checkpoint it resumes.

        Devices, output paths and progress display may change across a resume;
        anything that changes the math may not.
        """
        ignored = {"out", "resume", "progress", "devices", "checkpoint_every", "data_dir", "download"}
        return {k: v for k, v in json.loads(self.to_json()).items() if k not in ignored}
