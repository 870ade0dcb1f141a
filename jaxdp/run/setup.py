"""Everything a training run needs before its state: the job, the model, the mesh, the
data, the schedule and the strategy; and the start-up header that says what was built.

Names, devices and the model's needs are checked before the dataset loads (CIFAR-10's md5
alone takes seconds), all of it before anything is written.
"""

import functools
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Optional

import jax
import numpy as np

from jaxdp import __version__, registry
from jaxdp.config.tree import (TrainConfig, TrainError, batchnorm_batch_error, check_choice, epoch_length, per_device_batch,
                          total_steps)
from jaxdp.data import load_dataset
from jaxdp.runtime.distributed import join_job
from jaxdp.runtime.mesh import STAGE_AXIS, MeshDims, make_mesh
from jaxdp.models import ModelError, create_model, fsdp_units
from jaxdp.optim import OPTIMIZERS, SCHEDULES, make_optimizer, make_schedule
from jaxdp.run.perf import enable_compile_cache
from jaxdp.runtime.startup import preset_device_count
from jaxdp.strategies import facts
from jaxdp.strategies.options import checked
from jaxdp.api.trainer import StrategySpec, Trainer, classifier

IMAGE_SHAPE = (32, 32, 3)  # CIFAR-10, the synthetic set and digits (padded)


@dataclass
class Setup:
    trainer: Any  # the public API's jaxdp.Trainer: the run drives it as any user would
    schedule: Any
    train_set: Any
    test_set: Any
    per_device: int  # images per device per update (all its micro-batches)
    steps_per_epoch: int
    total_steps: int  # updates in the whole run (--max-steps, else --epochs whole epochs)

    @property
    def strategy(self):
        """The trainer's strategy: the layout the run checkpoints and the data feed splits batches by."""
        return self.trainer.strategy


def build(cfg: TrainConfig) -> Setup:
    join_job(cfg.init_timeout, cfg.heartbeat_timeout)  # before anything asks jax for its devices
    enable_compile_cache(cfg.compile_cache)
    if cfg.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    model = create_model(cfg.model, width=cfg.width, blocks=cfg.blocks, stem=cfg.stem, dtype=cfg.dtype)
    check_choice("strategy", cfg.strategy, registry.names())  # now: a strategy registered late too
    check_choice("optimizer", cfg.optimizer, OPTIMIZERS)
    check_choice("schedule", cfg.schedule, SCHEDULES)
    checked(facts(cfg.strategy), cfg, {})  # its options, refused before anything is built (strategies.options)
    mesh = _make_mesh(cfg.devices, cfg.mesh, cfg.mesh_shape)
    n = MeshDims.of(mesh).data_parallel
    per_device = per_device_batch(cfg, n)
    pipeline = _pipeline_options(cfg, mesh, per_device)
    _check_batchnorm_batch(model, cfg, n)
    train_set, test_set = load_dataset(cfg.dataset, cfg.data_dir, cfg.download, tuple(cfg.synthetic_size), cfg.seed)
    steps = epoch_length(len(train_set), n, per_device)
    total = total_steps(cfg, steps)
    schedule = make_schedule(cfg.schedule, cfg.lr, total, **cfg.schedule_options(steps))
    tx = make_optimizer(cfg.optimizer, schedule, momentum=cfg.momentum, nesterov=cfg.nesterov,
                        weight_decay=cfg.weight_decay)
    wiring = dict(seed=cfg.seed, log_grad_norm=True, **pipeline)
    if "units" in facts(cfg.strategy).takes and not pipeline:  # a stage's vector is its one unit
        wiring["units"] = fsdp_units(model)  # the model family's FSDP units (jaxdp.models)
    # The parsed config is the strategy's typed options (TrainConfig is a StrategyOptions): it goes
    # as it is, through the Trainer, to the strategy's class (docs/architecture.md, "an option's way").
    trainer = Trainer(model, classifier(model), tx, StrategySpec(cfg.strategy, wiring, config=cfg), mesh)
    return Setup(trainer, schedule, train_set, test_set, per_device, steps, total)


def _pipeline_options(cfg: TrainConfig, mesh, per_device: int) -> dict:
    """``microbatches`` for a mesh with a stage axis; each accumulation step's batch must split into them."""
    dims = MeshDims.of(mesh)
    stages = dims.size(STAGE_AXIS)
    if stages == 1:
        if cfg.microbatches is not None:
            raise TrainError("--microbatches are pipeline micro-batches: give --mesh a stage axis (e.g. data=2,stage=2)")
        return {}
    m = cfg.microbatches or stages
    micro_batch = per_device // cfg.accum_steps
    if micro_batch % m:
        raise TrainError(f"{micro_batch} images per device and accumulation step do not split into {m} pipeline "
                         f"micro-batches: pick a --global-batch-size that is a multiple of "
                         f"{cfg.accum_steps * m * dims.data_parallel} or change --microbatches")
    return {"microbatches": m}


def _make_mesh(devices: Optional[int], named: Optional[str] = None, mesh_shape=None):
    """The run's mesh: ``--mesh`` (or ``--devices`` data-parallel devices), its data-parallel devices
    split into ``--mesh-shape R,S`` = replica x data degrees if given (one mesh, whichever way it is
    spelled); checked once against the devices there are (``MeshDims``), saying so when ``--devices N``
    could not simulate N CPU devices because XLA_FLAGS already fixed their count."""
    available = jax.devices()
    dims = MeshDims.parse(named) if named is not None else MeshDims(data=devices or len(available))
    if mesh_shape is not None:
        dims = dims.with_replicas(mesh_shape, f"--mesh-shape {','.join(map(str, mesh_shape))}")
    dims.check_devices(len(available), platform=available[0].platform, processes=jax.process_count(),
                       preset=preset_device_count())
    return make_mesh(**dims.sizes())


def _check_batchnorm_batch(model, cfg: TrainConfig, devices: int) -> None:
    """BatchNorm in training needs more than one value per channel, and it sees
    micro-batch x height x width values: only a micro-batch of one image can fall short
    (with the imagenet stem, the last stage is 1x1 on 32x32 images). Trace the model
    (shapes only, no compile) so that this is refused now, not at the first step."""
    micro_batch = cfg.global_batch_size // (devices * cfg.accum_steps)
    if micro_batch > 1 or (cfg.sync_bn and devices > 1):  # SyncBN counts every device's images
        return
    try:
        jax.eval_shape(functools.partial(model.init, train=True), jax.random.key(0),
                       jax.ShapeDtypeStruct((micro_batch, *IMAGE_SHAPE), model.dtype))
    except ModelError as e:
        raise batchnorm_batch_error(cfg, devices, e) from None


def example_batch(model, image_shape=IMAGE_SHAPE) -> dict:
    """A batch of shapes only, for ``strategy.engine.init``/``restore_target`` (params do not depend on the values)."""
    return {"image": np.zeros((1, *image_shape), np.dtype(model.dtype)), "label": np.zeros((1,), np.int32)}


def startup_header(cfg: TrainConfig, strategy, state, per_device: int) -> str:
    """Versions, devices, mesh, batch, parameter count and the model state each device
    holds (measured: the bytes of device 0's shards of the state just built)."""
    def installed(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    devices = strategy.mesh.devices.flatten()
    first = devices[0]
    held = sum(shard.data.nbytes for leaf in jax.tree_util.tree_leaves(state)
               for shard in getattr(leaf, "addressable_shards", ()) if shard.device == first)
    shapes = getattr(strategy, "shapes", None)  # the full params' shapes, once a state is built
    params = f"{sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes)):,}" if shapes else "?"
    mesh = " x ".join(f"{name}={size}" for name, size in strategy.mesh.shape.items())
    return "\n".join([
        f"jaxdp {__version__} (jax {jax.__version__}, flax {installed('flax')}, optax {installed('optax')}, "
        f"torch {installed('torch')})",
        f"backend {jax.default_backend()}: {len(devices)} x {first.device_kind}, {jax.process_count()} "
        f"process(es); mesh {mesh}",
        f"{cfg.strategy} training {cfg.model} ({params} params, {cfg.dtype}): micro-batch "
        f"{per_device // cfg.accum_steps} x {cfg.accum_steps} accumulation step(s) per device x {len(devices)} "
        f"devices = global batch {cfg.global_batch_size}",
        f"model state per device: {held / 2**20:.2f} MiB (params, optimizer state, buffers)",
    ])
