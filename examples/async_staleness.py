"""Loss curves of the bounded-staleness parameter server for staleness bounds k = 0, 1, 4.

    .venv/bin/python examples/async_staleness.py [--out runs/async_staleness] [--png PATH] [--epochs 3]

Trains a narrow ResNet-18 (width 4, one block per stage) on the synthetic
CIFAR-shaped set over 4 simulated CPU devices (4 workers), once per k, with the
ordinary trainer (``--strategy async --staleness k``), and plots the training
loss per server update, raw and smoothed, into ``--png`` (default
``<out>/async_staleness.png``; docs/strategies.md's figure is
``docs/async_staleness.png``).
k = 0 is DDP; with k > 0 each worker's gradient was computed on params 0 to k
updates old, drawn per worker and update by the seeded schedule documented in
``jaxdp/strategies/async_ps.py``.

Runtime: about 3 minutes on 2 busy CPU cores (3 x 96 steps, ~20 s of compiling each).
"""

import argparse
import json
import os
import sys


def read_train_losses(run_dir):
    """(steps, losses) of the trainer's per-step records in ``metrics.jsonl``."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    train = [r for r in records if r.get("kind") == "train"]
    return [r["step"] for r in train], [r["loss"] for r in train]


def moving_average(values, window: int = 9):
    """Trailing mean over up to ``window`` values: the trend through the per-batch noise."""
    return [sum(values[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/async_staleness")
    p.add_argument("--png", default=None, help="where the plot goes (default <out>/async_staleness.png)")
    p.add_argument("--staleness", default="0,1,4", help="comma-separated k values")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.2)
    args = p.parse_args(argv)

    from jaxdp.runtime.mesh import simulate_cpu_devices

    simulate_cpu_devices(4)  # before jax is imported
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from jaxdp.config.tree import TrainConfig
    from jaxdp.run.train import train

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for k in (int(s) for s in args.staleness.split(",")):
        cfg = TrainConfig(strategy="async", staleness=k, width=4, blocks=(1, 1, 1, 1), devices=4,
                          synthetic_size=(2048, 512), global_batch_size=64, epochs=args.epochs,
                          lr=args.lr, momentum=0.9, schedule="constant", progress=False, overwrite=True,
                          out=os.path.join(args.out, f"k{k}"))
        summary = train(cfg)
        steps, losses = read_train_losses(cfg.out)
        ev = summary["eval"]
        print(f"k={k}: final train loss {losses[-1]:.3f}, eval loss {ev['loss']:.3f}, "
              f"eval accuracy {ev['accuracy']:.3f} ({summary['seconds']:.0f}s)")
        line, = ax.plot(steps, moving_average(losses), lw=1.8, label=f"k = {k}" + (" (DDP)" if k == 0 else ""))
        ax.plot(steps, losses, lw=0.6, alpha=0.35, color=line.get_color())
    ax.set(xlabel="server update", ylabel="training loss (thin: per batch; thick: 9-step mean)", yscale="log",
           title="Bounded staleness: each worker's params 0..k updates old\n"
                 "ResNet-18 width 4, synthetic set, 4 workers, SGD lr 0.2 momentum 0.9")
    ax.legend()
    path = args.png or os.path.join(args.out, "async_staleness.png")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"saved {os.path.abspath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
