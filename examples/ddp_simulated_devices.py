"""DDP on 4 simulated CPU devices, step by step: a tutorial in one file.

Run:      python examples/ddp_simulated_devices.py
Takes:    about a minute on 2 CPU cores (most of it compiling).

What it shows: how jaxdp's pieces fit together without the trainer: the numpy
data pipeline hands out per-rank batches exactly as torch's DistributedSampler
would, the DDP strategy shards them (a batch is any pytree: here the classifier
task's {"image", "label"}) over a ("data",) mesh, and each step is one compiled
shard_map program whose only collective is the bucketed all-reduce.
"""

import os

# XLA reads this when jax is first imported: ask for 4 host devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402

from jaxdp.data import epoch_batches, load_dataset  # noqa: E402
from jaxdp.runtime.mesh import make_mesh  # noqa: E402
from jaxdp.models import create_model  # noqa: E402
from jaxdp.optim import make_optimizer, make_schedule  # noqa: E402
from jaxdp.strategies import create_strategy  # noqa: E402
from jaxdp.loss.task import classifier  # noqa: E402
from jaxdp.run.setup import example_batch  # noqa: E402

DEVICES, PER_DEVICE_BATCH, STEPS = 4, 16, 40


def main():
    # 1. Data: a deterministic synthetic CIFAR-shaped set (no download needed).
    train_set, _ = load_dataset("synthetic", synthetic_size=(2048, 256))

    # 2. Model and optimizer: torchvision's ResNet-18 layout, narrow for speed;
    #    SGD with momentum exactly as torch.optim.SGD computes it.
    model = create_model("resnet18", width=8, blocks=(1, 1, 1, 1))
    tx = make_optimizer("sgd", make_schedule("cosine", 0.1, STEPS), momentum=0.9, weight_decay=5e-4)

    # 3. Strategy: DDP over a 1-D mesh, training the classifier task (torch's cross_entropy
    #    on batches {"image", "label"}). Params and optimizer state are replicated; each
    #    device sees 1/4 of the batch; gradients are averaged as psum(g / N).
    mesh = make_mesh(DEVICES)
    ddp = create_strategy("ddp", model, classifier(model), tx, mesh)
    state = ddp.engine.init(jax.random.key(0), example_batch(model))  # BN running stats: state.model_state
    print(f"mesh {dict(mesh.shape)}; params live on {len(state.params['fc']['kernel'].devices())} devices")

    # 4. Train: batches arrive as (replicas, per-replica batch, H, W, C); row r goes to device r.
    step = 0
    for epoch in range(10):
        for batch in epoch_batches(train_set, num_replicas=DEVICES, batch_per_replica=PER_DEVICE_BATCH,
                                   epoch=epoch, seed=0):
            images = batch.images.reshape(-1, *batch.images.shape[2:])
            labels = batch.labels.reshape(-1)
            state, metrics = ddp.engine.step(state, ddp.engine.shard_batch({"image": images, "label": labels}))
            step += 1
            if step % 10 == 0:
                per_device = ", ".join(f"{x:.3f}" for x in jax.device_get(metrics["loss_per_device"]))
                print(f"step {step:3d}  loss {float(metrics['loss']):.4f}  per device [{per_device}]")
            if step == STEPS:
                return


if __name__ == "__main__":
    main()
