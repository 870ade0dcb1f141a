"""One strategy measured: model state per device against the formulas (``state``), compiled
memory and collectives per step (``hlo``), as the dict ``jaxdp inspect --json`` prints.

The compiled memory is ``memory_analysis()`` of ``strategy.engine.lower_step(...).compile()``
(argument, output, alias, temp bytes); the collectives are counted in ``compiled.as_text()``
(``traffic``: per kind; ``collectives``: each one, with what overlaps it) and, as
``ring_bytes_as_written``, in the HLO before XLA's passes, printed where it differs: XLA:CPU
promotes a bf16 all-reduce to f32.

For a GPU target (``target``: ``jaxdp.runtime.target``), the mesh is built over compile-only
GPUs, the state and the batch are shapes with shardings (nothing is allocated), and the report
adds the target, the hosts and an estimated step time (``estimate.py``).
"""

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxdp import names
from jaxdp.analysis.axes import axis_report
from jaxdp.analysis.estimate import estimate, step_flops, timeline
from jaxdp.analysis.plot import describe, draw_schedule, require_matplotlib
from jaxdp.analysis.hlo import compiled_memory, parse_collectives
from jaxdp.analysis.options import InspectOptions
from jaxdp.analysis.schedule import collective_list, entry_ops
from jaxdp.analysis.state import device_bytes, kept_grad_bytes, state_bytes, strategy_formulas
from jaxdp.loss.task import classifier
from jaxdp.models import create_model, fsdp_units
from jaxdp.models.batchnorm import BatchNorm
from jaxdp.optim import make_optimizer
from jaxdp.runtime.mesh import make_mesh
from jaxdp.runtime.target import compile_only_devices
from jaxdp.strategies import create_strategy, options_of


class InspectError(ValueError):
    """Options that cannot be inspected (one line on the command line)."""


def inspect_strategy(name: str, n: int, how: Optional[InspectOptions] = None, **fields) -> dict:
    """Build strategy ``name`` on ``n`` devices (they must exist: simulate them before jax
    starts), or on the named ``how.mesh`` (``{"data": 2, "model": 2}``), for a freshly initialised
    built-in model, and ``measure`` it. ``how``: ``InspectOptions`` (``fields``: any of its fields,
    replacing ``how``'s). ``how.options``: the strategy's own (``allreduce``, ``compress``,
    ``powersgd_rank``, ``staleness``); zero3 and hsdp get the model's FSDP units
    (``jaxdp.models.fsdp_units``) unless they name ``units``. ``how.target``: a
    ``jaxdp.runtime.target.Target``: its ``devices`` compile-only GPUs instead of ``n`` devices here."""
    how = dataclasses.replace(how or InspectOptions(), **fields)
    if how.plot:
        require_matplotlib()
    batch_per_device = 1 if how.batch_per_device is None else how.batch_per_device
    model, image_size, dtype = how.model, how.image_size, how.dtype
    if batch_per_device < 1 or image_size < 1:
        raise InspectError(f"--batch-per-device and --image-size must be >= 1, got {batch_per_device}, {image_size}")
    if dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    takes_image_size = "image_size" in names.family(model).options  # a ViT's position embeddings follow it
    sizes = dict(how.vit or {}, **({"image_size": image_size} if takes_image_size else {}))
    net = create_model(model, width=how.width, blocks=how.blocks, stem=how.stem, dtype=dtype, **sizes)
    check_batchnorm_has_values(net, batch_per_device, image_size)
    options = dict(how.options or {}, **({"mesh_shape": how.mesh_shape} if "mesh_shape" in options_of(name) else {}))
    devices = compile_only_devices(how.target) if how.target is not None else None
    built = make_mesh(**how.mesh, devices=devices) if how.mesh else make_mesh(n, devices=devices)
    strategy = build_strategy(name, built, net, how.optimizer, options)
    batch = random_batch(net, batch_per_device * strategy.num_devices, image_size, how.seed)
    report = measure(strategy, batch, seed=how.seed, compile=how.compile, schedule=how.schedule, target=how.target,
                     plot=how.plot)
    report.update(model=model, width=how.width, blocks=list(getattr(net, "stage_sizes", ())), dtype=dtype,
                  optimizer=how.optimizer, options={k: v for k, v in options.items() if v is not None})
    if "units" in options_of(name):
        report.update(fsdp_units=[getattr(u, "__name__", u) for u in strategy.units.classes + strategy.units.patterns],
                      fsdp_unit_count=len(strategy.unit_paths))
    return report


def random_batch(net, rows: int, image_size: int, seed: int = 0) -> dict:
    """``rows`` random images and labels for the classifier ``net``, in its dtype."""
    rng = np.random.default_rng(seed)
    return {"image": rng.normal(size=(rows, image_size, image_size, 3)).astype(np.dtype(net.dtype)),
            "label": rng.integers(0, net.num_classes, rows).astype(np.int32)}


def build_strategy(name: str, mesh, net, optimizer: str, options: Optional[dict] = None):
    """Strategy ``name`` training ``net`` (a classifier) on ``mesh`` with ``optimizer`` at its default lr
    (``jaxdp.names``; sgd with momentum 0.9) and the model's FSDP units: what ``inspect`` and ``plan`` measure."""
    tx = make_optimizer(optimizer, names.optimizer(optimizer).default_lr)
    return create_strategy(name, net, classifier(net), tx, mesh, **fsdp_options(name, net, options))


def fsdp_options(name: str, model, options: Optional[dict] = None) -> dict:
    """``options`` plus, for a strategy that takes ``units`` (zero3, hsdp), ``units=fsdp_units(model)``
    (unless given): the model's own FSDP units, as torch_ref's FSDP2 wraps them."""
    options = dict(options or {})
    if "units" in options_of(name) and "units" not in options:
        options["units"] = fsdp_units(model)
    return options


def check_batchnorm_has_values(net, batch_per_device: int, image_size: int) -> None:
    """InspectError if some BatchNorm would see 1 value per channel on a device: the unbiased
    running variance divides by count - 1. Found by tracing the model (no compute)."""
    def forward(x):
        variables = net.init(jax.random.key(0), x, train=False)
        _, state = net.apply(variables, x, train=False,
                             capture_intermediates=lambda module, _: isinstance(module, BatchNorm))
        return state.get("intermediates", {})  # none: the model has no BatchNorm

    x = jax.ShapeDtypeStruct((batch_per_device, image_size, image_size, 3), net.dtype)
    outputs = jax.tree_util.tree_leaves(jax.eval_shape(forward, x))
    smallest = min((o.shape for o in outputs), key=lambda shape: int(np.prod(shape[:-1])), default=None)
    if smallest is not None and np.prod(smallest[:-1]) < 2:
        h, w = smallest[1:3]
        raise InspectError(
            f"--image-size {image_size} with --batch-per-device {batch_per_device} leaves a BatchNorm "
            f"{batch_per_device} image(s) of {h}x{w} = 1 value per channel (its running variance divides "
            f"by count - 1); use --batch-per-device 2 or a larger --image-size")


def measure(strategy, batch, *, variables=None, state=None, seed: int = 0, compile: bool = True,
            schedule: bool = False, target=None, plot: Optional[str] = None) -> dict:
    """Everything in the module docstring, for a built strategy and a host batch (a pytree of
    global numpy arrays, e.g. ``{"image", "label"}``). The state measured: ``state`` if given
    (a state of this strategy; nothing is run, so nothing is donated), else ``init_state(variables)``
    for full ``variables`` (``{"params", "batch_stats"}``), else ``strategy.engine.init`` (sharded, from ``seed``);
    for a GPU ``target``, the state's and the batch's shapes and shardings alone (``engine.step_shapes``).
    ``schedule``: also the compiled step's collectives and compute in execution order (``schedule.py``);
    ``plot`` (a GPU ``target``): a PNG of the estimated step's two streams (``plot.py``)."""
    strategy.learn_structure(batch)
    if target is not None:
        state, sharded = strategy.engine.step_shapes(batch)
    else:
        if state is None:
            state = strategy.engine.init(jax.random.key(seed), batch) if variables is None else \
                strategy.engine.init_state(variables)
        sharded = strategy.engine.shard_batch(batch)
    images = np.asarray(jax.tree_util.tree_leaves(batch)[0])
    formulas = strategy_formulas(strategy)
    state_formulas = {part: formulas.pop(part) for part in ("formula", "formula_padded")}
    measured = state_bytes(state, strategy, strategy.local_shapes)
    measured["grads"] = kept_grad_bytes(strategy, state, sharded)
    report = {
        "strategy": strategy.facts.name, "devices": strategy.num_devices, "shards": strategy.shards,
        "mesh": {name: int(size) for name, size in strategy.mesh.shape.items()}, **formulas,
        "batch_per_device": int(images.shape[0]) // strategy.num_devices, "image_size": images.shape[-2],
        "state": {"measured": measured, **state_formulas},
    }
    if target is not None:
        report.update(target=target.gpu.name, hosts=target.hosts, batch_bytes=device_bytes(sharded))
    devices = strategy.mesh.devices.size  # every device of the mesh, model and stage axes too
    if compile:
        lowered = strategy.engine.lower_step(state, sharded)
        compiled = lowered.compile()
        text = compiled.as_text()
        report["memory"] = compiled_memory(compiled)
        report["traffic"] = parse_collectives(text, devices)
        # The program as written, before XLA's passes: XLA:CPU promotes a bf16 all-reduce to f32
        # (measured: 2x the bytes for --compress bf16; fp16 stays 2 bytes).
        written = parse_collectives(lowered.compiler_ir("hlo").as_hlo_text(), devices)
        report["ring_bytes_as_written"] = written["ring_bytes"]
        report["collectives"] = collective_list(text, [d.process_index for d in strategy.mesh.devices.flat])
        report["backend"] = strategy.mesh.devices.flat[0].platform
        if target is not None:
            flops = step_flops(strategy.engine.step_jaxpr(state, sharded))
            report.update(estimate(target.gpu, compute_dtype(strategy, state), flops, text, report["collectives"]))
            if plot:
                draw_schedule(timeline(text, target.gpu, report["collectives"]), plot, describe(report))
        if schedule:
            report["schedule"] = [dataclasses.asdict(op) for op in entry_ops(text)]
    report["axes"] = axis_report(strategy, report.get("traffic"), report.get("memory", {}).get("temp_bytes"),
                                 report["opt_bytes_per_param"], report["batch_per_device"], report["image_size"],
                                 report["traffic_formula_bytes"], jax.ShapeDtypeStruct(images.shape[1:], images.dtype))
    return report


def compute_dtype(strategy, state) -> str:
    """The model's compute dtype (a built-in model's ``dtype``), else its params' widest float."""
    dtype = getattr(strategy.model, "dtype", None)
    if dtype is not None:
        return str(np.dtype(dtype))
    floats = [np.dtype(x.dtype) for x in jax.tree_util.tree_leaves(state.params) if jnp.issubdtype(x.dtype, jnp.floating)]
    return str(max(floats, key=lambda d: d.itemsize, default=np.dtype("float32")))
