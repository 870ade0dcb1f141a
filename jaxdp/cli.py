"""The ``jaxdp`` command: ``jaxdp train ...`` (more subcommands register here).

Nothing here imports jax at module level: ``--devices N`` must be able to set
XLA's simulated-device flag before jax starts.
"""

import argparse
import sys
from typing import List, Optional


def _ints(text: str):
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_train_args(p: argparse.ArgumentParser) -> None:
    from jaxdp.config import TrainConfig

    d = TrainConfig()
    g = p.add_argument_group("model")
    g.add_argument("--model", default=d.model, help="resnet18 | resnet34 | resnet50")
    g.add_argument("--width", type=int, default=d.width, help="channels of the first stage (64 = torchvision)")
    g.add_argument("--blocks", type=_ints, default=d.blocks, help="blocks per stage, e.g. 1,1,1,1")
    g.add_argument("--stem", default=d.stem, help="cifar | imagenet")
    g.add_argument("--dtype", default=d.dtype, help="float32 | bfloat16 | float64")
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default=d.dataset, help="synthetic (offline default) | cifar10")
    g.add_argument("--data-dir", default=d.data_dir, help="CIFAR-10 folder or archive (default $JAXDP_DATA_DIR or ./data)")
    g.add_argument("--download", action="store_true", help="download CIFAR-10 if it is missing")
    g.add_argument("--synthetic-size", type=_ints, default=d.synthetic_size, help="train,test sizes of the synthetic set")
    g = p.add_argument_group("parallelism")
    g.add_argument("--strategy", default=d.strategy, help="ddp (more in jaxdp.strategies)")
    g.add_argument("--devices", type=int, default=d.devices, help="devices to use (default all); on CPU they are simulated")
    g.add_argument("--global-batch-size", "--batch-size", type=int, default=d.global_batch_size)
    g.add_argument("--accum-steps", type=int, default=d.accum_steps, help="micro-batches per update (torch no_sync)")
    g.add_argument("--sync-bn", action="store_true", help="global BatchNorm statistics (SyncBatchNorm)")
    g.add_argument("--bucket-cap-mb", type=float, default=d.bucket_cap_mb, help="ddp gradient bucket size")
    g.add_argument("--allreduce", default=d.allreduce, help="ddp: psum | ring")
    g.add_argument("--compress", default=d.compress, help="ddp gradient compression: bf16 | fp16 | powersgd")
    g.add_argument("--powersgd-rank", type=int, default=d.powersgd_rank)
    g.add_argument("--staleness", type=int, default=d.staleness, help="async: max staleness k of worker weights")
    g.add_argument("--mesh-shape", type=_ints, default=d.mesh_shape, help="hsdp: replicas,shards")
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=int, default=d.epochs)
    g.add_argument("--optimizer", default=d.optimizer, help="sgd | adam | adamw")
    g.add_argument("--lr", type=float, default=d.lr)
    g.add_argument("--momentum", type=float, default=d.momentum)
    g.add_argument("--nesterov", action="store_true")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)
    g.add_argument("--schedule", default=d.schedule, help="constant | cosine | multistep | warmup_cosine")
    g.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    g.add_argument("--seed", type=int, default=d.seed)
    g = p.add_argument_group("output")
    g.add_argument("--out", default=d.out, help="run directory: metrics.jsonl, config.json, checkpoints/")
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    g.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="steps (0 = each epoch)")
    g.add_argument("--no-progress", dest="progress", action="store_false")


def config_from_args(args: argparse.Namespace):
    from jaxdp.config import TrainConfig

    fields = TrainConfig.__dataclass_fields__
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})


def cmd_train(args: argparse.Namespace) -> int:
    from jaxdp.train import train

    cfg = config_from_args(args)
    summary = train(cfg)
    ev = summary.get("eval") or {}
    print(f"done: {summary['steps']} steps in {summary.get('seconds', 0):.1f}s; "
          f"eval accuracy {ev.get('accuracy', float('nan')):.4f}; run in {cfg.out}")
    return 0


def _user_errors():
    """Exceptions that mean 'the user asked for something impossible': one line, no traceback."""
    from jaxdp.checkpoint import CheckpointError
    from jaxdp.data import DatasetError
    from jaxdp.mesh import MeshError
    from jaxdp.models import ModelError
    from jaxdp.optim import ConfigError
    from jaxdp.strategies import StrategyError
    from jaxdp.train import TrainError

    return (CheckpointError, DatasetError, MeshError, ModelError, ConfigError, StrategyError, TrainError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxdp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train a ResNet with a data-parallel strategy")
    add_train_args(p)
    p.set_defaults(func=cmd_train)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    devices = getattr(args, "devices", None)
    if devices:
        from jaxdp.mesh import simulate_cpu_devices

        simulate_cpu_devices(devices)  # before jax is imported; a no-op for GPUs
    try:
        return args.func(args)
    except _user_errors() as e:
        print(f"jaxdp: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("jaxdp: interrupted; the last completed step was checkpointed (resume with --resume)",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
