"""Parity of data x tensor parallelism: jaxdp on a ``data x model`` mesh against its torch twin
(``torch_ref.tensor_parallel``: ``parallelize_module`` on a 2-D ``DeviceMesh``, then DDP or
FSDP2 on its ``dp`` dim), and against the same model on one device.

Two model families (``TPConfig.family``, a row of ``parity_tests.mp_families``): the ViT, split
Megatron's way, and the ResNet, channel-parallel inside each block
(``jaxdp/models/resnet/parallel.py``; its torch twin is written by hand,
``torch_ref/resnet_tp.py``, as torch's TP styles refuse ``Conv2d``).

One run: the model is initialised in torch and converted (``jaxdp.interop``); both sides take
the same per-data-rank batches for ``steps`` steps; every step's loss, each data rank's
loss, every averaged gradient, every parameter after the update and (ResNet) the BatchNorm
running statistics are compared in the canonical layout, with ``parity_tests.compare``'s
float64 bounds (rel <= 1e-10). The ResNet's BatchNorm is per data rank (no SyncBN) on both
sides, its buffers data rank 0's (DDP broadcasts them).

Injected bug (``bug="missing_row_all_reduce"``): the row-parallel layers (a ResNet block's
``conv2``) do not sum their partial outputs over ``model``; every device continues with
device 0's partial sum. (A
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

from jaxdp import registry
from parity_tests import mp_families

SMALL_VIT = dict(num_classes=10, image_size=16, patch=8, dim=16, depth=2, heads=4, mlp_dim=32)
SMALL_RESNET = dict(name="resnet18", num_classes=10, width=4, blocks=(1, 1, 1, 1))
BUGS = {"missing_row_all_reduce": "row-parallel layers (attn.proj, mlp.fc2, a ResNet block's conv2) keep "
                                  "device 0's partial sum instead of all-reducing over model"}


@dataclass
class TPConfig:
    strategy: str = "ddp"        # ddp | zero3 on the data axis
    data: int = 2
    model: int = 2
    steps: int = 10
    batch_per_rank: int = 4
    optimizer: str = "sgd"       # sgd (momentum 0.9) | adamw
    lr: float = 0.05
    weight_decay: float = 0.0    # both sides' (jaxdp parity --mesh: torch.optim's default, jaxdp.names)
    seed: int = 0
    family: str = "vit"          # a row of mp_families.FAMILIES: vit | resnet | toy
    vit: Dict[str, int] = field(default_factory=lambda: dict(SMALL_VIT))
    resnet: Dict[str, object] = field(default_factory=lambda: dict(SMALL_RESNET))
    family_row: mp_families.MPFamily = field(init=False, repr=False, compare=False)  # the family's row

    def __post_init__(self):
        self.family_row = mp_families.family(self.family)

    @property
    def torch_config(self):
        return {"dp": self.data, "tp": self.model, "strategy": registry.row(self.strategy).torch_twin, "dtype": "float64",
                "family": self.family, "model": self.family_row.sizes(self), "optimizer": self.optimizer,
                "lr": self.lr, "momentum": 0.9, "weight_decay": self.weight_decay}


def init_state_dict(cfg: TPConfig) -> Dict[str, np.ndarray]:
    """The config's torch model, seeded with ``cfg.seed``, in float64: the start both sides load."""
    import torch

    torch.manual_seed(cfg.seed)
    return {k: v.numpy().copy() for k, v in cfg.family_row.torch_model(cfg).double().state_dict().items()}


def make_batches(cfg: TPConfig):
    """Per step: inputs (data, b, ...) (images (data, b, H, W, 3); the toy's features (data, b, 10)) and
    labels (data, b), one row block per data rank."""
    rng, shape = np.random.default_rng(cfg.seed), (cfg.data, cfg.batch_per_rank)
    example, classes = cfg.family_row.input_shape(cfg), cfg.family_row.classes(cfg)
    return [(rng.normal(size=shape + example), rng.integers(0, classes, shape)) for _ in range(cfg.steps)]


def jax_optimizer(cfg: TPConfig):
    """torch.optim's equal with the config's lr and weight decay (sgd: momentum 0.9, as the twin's)."""
    from jaxdp.optim import make_optimizer

    return make_optimizer(cfg.optimizer, cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)


@contextlib.contextmanager
def injected(bug: Optional[str]):
    """jaxdp with ``bug`` for the duration (the ViT's row-parallel layers lose their psum)."""
    if bug is None:
        yield
        return
    if bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r}; choose one of {', '.join(BUGS)}")
    import jax

    from jaxdp.models.resnet import model as resnet
    from jaxdp.models.vit import layers as vit_layers

    def first_part_only(axis, op=jax.lax.dot_general):
        def part_of_device_0(*args, **kwargs):
            return jax.lax.all_gather(op(*args, **kwargs), axis, to="invarying")[0]
        return part_of_device_0

    originals = [(m, m.summed_over) for m in (vit_layers, resnet)]
    for m, _ in originals:
        m.summed_over = first_part_only
    try:
        yield
    finally:
        for m, original in originals:
            m.summed_over = original


def run_jax(cfg: TPConfig, state_dict, batches, mesh_axes: Optional[dict] = None, bug: Optional[str] = None,
            options: Optional[dict] = None):
    """jaxdp's records; ``mesh_axes`` defaults to ``data x model`` ({"data": 1}: one device);
    ``options``: more of the strategy's (a pipeline's ``microbatches``)."""
    import jax

    from jaxdp.interop import tree_to_torch_names
    from jaxdp.runtime.mesh import make_mesh
    from jaxdp.strategies import conversions, create_strategy, options_of
    from jaxdp.loss.task import classifier

    axes = mesh_axes or {"data": cfg.data, "model": cfg.model}
    name = cfg.strategy if axes != {"data": 1} else "ddp"
    with jax.enable_x64(True), injected(bug):
        model, units = cfg.family_row.jax_model(cfg)
        options = {**({"units": units} if "units" in options_of(name) else {}), **(options or {})}
        strategy = create_strategy(name, model, classifier(model), jax_optimizer(cfg), make_mesh(**axes),
                                   return_grads=True, **options)
        state = strategy.engine.init_state(cfg.family_row.variables(cfg, model, state_dict))
        records = []
        for images, labels in batches:
            batch = {"image": images.reshape(-1, *images.shape[2:]), "label": labels.reshape(-1).astype(np.int32)}
            state, metrics = strategy.engine.step(state, strategy.engine.shard_batch(batch))
            metrics = jax.device_get(metrics)
            canon = jax.device_get(strategy.engine.canonical(state))
            records.append({"loss": float(metrics["loss"]),
                            "grads": tree_to_torch_names(conversions.canonical_grads(strategy, metrics["grads"])),
                            "params": tree_to_torch_names(canon.params)})
            if canon.model_state.get("batch_stats"):
                records[-1]["buffers"] = tree_to_torch_names(canon.model_state["batch_stats"], "batch_stats")
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
        # One device has one rank: compare the mean loss only.
        got, want = ([{k: v for k, v in r.items() if k != "loss_per_rank"} for r in run] for run in (got, want))
    return compare.compare_runs(got, want, compare.FLOAT64)
