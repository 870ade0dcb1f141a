"""Parity of data x tensor parallelism: jaxdp on a ``data x model`` mesh against its torch twin
(``torch_ref.tensor_parallel``: ``parallelize_module`` on a 2-D ``DeviceMesh``, then DDP or
FSDP2 on its ``dp`` dim), and against the same model on one device.

One run: the ViT is initialised in torch and converted (``jaxdp.interop``); both sides take
the same per-data-rank batches for ``steps`` steps; every step's loss, each data rank's
loss, every averaged gradient and every parameter after the update are compared in the
canonical layout, with ``parity_tests.compare``'s float64 bounds (rel <= 1e-10).

Injected bug (``bug="missing_row_all_reduce"``): the row-parallel layers do not sum their
partial outputs over ``model``; every device continues with device 0's partial sum. (A
plain missing ``psum`` does not even trace: ``shard_map``'s varying/invariant types refuse
a per-device partial sum where a replicated value is due. Keeping one device's part is the
closest bug that gets through, and only the numbers can show it.) The harness must catch it
at step 0.

Nothing imports jax or torch at module level (``--devices`` must reach XLA first).
"""

import contextlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

SMALL_VIT = dict(num_classes=10, image_size=16, patch=8, dim=16, depth=2, heads=4, mlp_dim=32)
BUGS = {"missing_row_all_reduce": "row-parallel layers (attn.proj, mlp.fc2) keep device 0's partial sum "
                                  "instead of all-reducing over model"}


@dataclass
class TPConfig:
    strategy: str = "ddp"        # ddp | zero3 on the data axis
    data: int = 2
    model: int = 2
    steps: int = 10
    batch_per_rank: int = 4
    optimizer: str = "sgd"       # sgd (momentum 0.9) | adamw
    lr: float = 0.05
    seed: int = 0
    vit: Dict[str, int] = field(default_factory=lambda: dict(SMALL_VIT))

    @property
    def torch_config(self):
        return {"dp": self.data, "tp": self.model, "strategy": self.strategy, "dtype": "float64",
                "model": dict(self.vit), "optimizer": self.optimizer, "lr": self.lr, "momentum": 0.9,
                "weight_decay": 0.01}


def init_state_dict(cfg: TPConfig) -> Dict[str, np.ndarray]:
    import torch

    from torch_ref.vit import VisionTransformer

    torch.manual_seed(cfg.seed)
    model = VisionTransformer(**cfg.vit).double()
    return {k: v.numpy().copy() for k, v in model.state_dict().items()}


def make_batches(cfg: TPConfig):
    """Per step: images (data, b, H, W, 3) and labels (data, b), one row block per data rank."""
    rng = np.random.default_rng(cfg.seed)
    size = cfg.vit["image_size"]
    shape = (cfg.data, cfg.batch_per_rank)
    return [(rng.normal(size=shape + (size, size, 3)), rng.integers(0, cfg.vit["num_classes"], shape))
            for _ in range(cfg.steps)]


def jax_optimizer(cfg: TPConfig):
    import optax

    if cfg.optimizer == "sgd":
        return optax.sgd(cfg.lr, momentum=0.9)
    return optax.adamw(cfg.lr, weight_decay=0.01)


@contextlib.contextmanager
def injected(bug: Optional[str]):
    """jaxdp with ``bug`` for the duration (the ViT's row-parallel layers lose their psum)."""
    if bug is None:
        yield
        return
    if bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r}; choose one of {', '.join(BUGS)}")
    import jax

    from jaxdp.models.vit import model as vit_model

    def first_part_only(axis):
        def dot_general(*args, **kwargs):
            part = jax.lax.dot_general(*args, **kwargs)
            return jax.lax.all_gather(part, axis, to="invarying")[0]
        return dot_general

    original = vit_model.summed_over
    vit_model.summed_over = first_part_only
    try:
        yield
    finally:
        vit_model.summed_over = original


def run_jax(cfg: TPConfig, state_dict, batches, mesh_axes: Optional[dict] = None, bug: Optional[str] = None):
    """jaxdp's records; ``mesh_axes`` defaults to ``data x model`` ({"data": 1}: one device)."""
    import jax
    import jax.numpy as jnp

    from jaxdp.interop import tree_to_torch_names, variables_from_state_dict
    from jaxdp.mesh import make_mesh
    from jaxdp.models.vit import EncoderBlock, ViT
    from jaxdp.strategies import create_strategy
    from jaxdp.task import classifier

    axes = mesh_axes or {"data": cfg.data, "model": cfg.model}
    name = cfg.strategy if axes != {"data": 1} else "ddp"
    with jax.enable_x64(True), injected(bug):
        model = ViT(**cfg.vit, dtype=jnp.float64, param_dtype=jnp.float64)
        options = {"units": (EncoderBlock,)} if name == "zero3" else {}
        strategy = create_strategy(name, model, classifier(model), jax_optimizer(cfg), make_mesh(**axes),
                                   return_grads=True, **options)
        state = strategy.init_state(variables_from_state_dict(state_dict, dtype="float64"))
        records = []
        for images, labels in batches:
            batch = {"image": images.reshape(-1, *images.shape[2:]), "label": labels.reshape(-1).astype(np.int32)}
            state, metrics = strategy.step(state, strategy.shard_batch(batch))
            metrics = jax.device_get(metrics)
            canon = jax.device_get(strategy.canonical(state))
            records.append({"loss": float(metrics["loss"]),
                            "grads": tree_to_torch_names(strategy.canonical_grads(metrics["grads"])),
                            "params": tree_to_torch_names(canon.params)})
            if axes["data"] == len(images):  # one loss per data rank, as torch's dp ranks report
                records[-1]["loss_per_rank"] = [float(x) for x in np.asarray(metrics["loss_per_device"])]
    return records


def run_torch(cfg: TPConfig, state_dict, batches) -> List[dict]:
    from torch_ref.tensor_parallel import run_tp_steps

    return run_tp_steps(cfg.torch_config, state_dict, batches)


def run(cfg: TPConfig, reference: str = "torch", bug: Optional[str] = None):
    """Compare jaxdp on ``data x model`` with ``reference``: "torch" (the twin) or "one-device"
    (jaxdp, the whole model and batch on one device). Returns ``compare.Comparison``."""
    from parity_tests import compare

    state_dict, batches = init_state_dict(cfg), make_batches(cfg)
    got = run_jax(cfg, state_dict, batches, bug=bug)
    if reference == "torch":
        want = run_torch(cfg, state_dict, batches)
    else:
        want = run_jax(cfg, state_dict, batches, mesh_axes={"data": 1})
        got = [{k: v for k, v in r.items() if k != "loss_per_rank"} for r in got]  # one device has one rank
    return compare.compare_runs(got, want, compare.FLOAT64)
