"""The training run's configuration: one flat dataclass shared by the CLI and the trainer."""

import dataclasses
import json
from dataclasses import dataclass
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
    # strategy-specific options: each strategy receives those its constructor takes
    bucket_cap_mb: float = 25.0  # ddp: gradient bucket size
    allreduce: str = "psum"  # ddp: "psum" | "ring" (reduce-scatter + all-gather by ppermute)
    compress: Optional[str] = None  # ddp: None | "bf16" | "fp16" | "powersgd"
    powersgd_rank: int = 1
    staleness: int = 0  # async parameter server: max updates a worker's weights may lag
    mesh_shape: Optional[Tuple[int, int]] = None  # hsdp: (replicas, shards)
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
    log_sample_ids: bool = False  # write each step's dataset ids to sample_ids.p<process>.jsonl
    # multi-process jobs (jaxdp launch, srun): see jaxdp.mesh.initialize_distributed
    init_timeout: int = 300  # seconds for every process to join
    heartbeat_timeout: int = 100  # seconds before the survivors give up on a silent peer

    STRATEGY_OPTIONS = ("bucket_cap_mb", "allreduce", "compress", "powersgd_rank", "staleness", "mesh_shape")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def fingerprint(self) -> dict:
        """The fields a resumed run must share with the checkpoint it resumes.

        Devices (and processes), output paths and progress display may change across
        a resume; anything that changes the math may not. The global batch is part of
        it: it fixes which samples each step takes, whatever the device count.
        """
        ignored = {"out", "resume", "progress", "devices", "checkpoint_every", "data_dir", "download",
                   "strategy", "mesh_shape", "bucket_cap_mb", "log_sample_ids", "init_timeout",
                   "heartbeat_timeout"}
        return {k: v for k, v in json.loads(self.to_json()).items() if k not in ignored}
