"""Which strategy fits a model on N devices of a given memory, at what batch, for what traffic.

``plan(...)`` (``jaxdp plan``) gives, for every strategy on N devices (hsdp: every
replicas x shards mesh with both > 1), per device:

- the model state from the ZeRO formulas (``state.strategy_formulas``: params, optimizer
  state and ``extra``, padded as the layout pads; the gradients live inside the step);
- the compiled step's memory at the asked per-device batch b = B/N: ``memory_analysis()``
  of the strategy's own step, ``argument + output - alias + temp`` as ``jaxdp bench``
  counts it (temp: activations, gradients, gathered params, workspace);
- whether that fits in the device memory, and the largest per-device batch that does.
  Memory is linear in the batch (activations are, the state is not), so the line through
  two compiles, at b and 2b, gives it (if memory does not grow yet, XLA reusing buffers,
  4b, 8b, ... up to 16b); a third compile at that batch checks it (if it does not fit,
  the line through the two largest points is tried once more);
- the traffic per step: ring bytes each device sends, the strategy's formula.

**The rule for the recommendation**: of the strategies that fit at b, the one with the
least traffic per step; a tie goes to the one registered first (``jaxdp.registry``: ddp,
zero1, zero2, zero3, hsdp, async: the fewer collectives per step), e.g. ddp at N = 1.

**How it compiles for N devices it does not have.** jax 0.10.2 lowers a program over an
``AbstractMesh`` (``jit(f).trace(...).lower(lowering_platforms=("cpu",))``), but compiling
it asks for a device assignment of N devices, and the memory is a property of the compiled
executable. So the plan runs where XLA simulates N CPU devices
(``--xla_force_host_platform_device_count=N``: ``jaxdp plan --devices N`` sets it before
jax starts), and lowers each strategy's real step (``lower_step``) on shapes only: the
state is ``abstract_state`` (``ShapeDtypeStruct`` with shardings), the batch likewise.
XLA compiles the one per-device SPMD program and nothing is allocated: measured, a
ResNet-18 of width 1024 (2.8 G params, 45 GB with Adam) at N = 64 plans each strategy in
about 5 s under 0.7 GB of resident memory. The numbers are XLA:CPU's buffer assignment;
a GPU's fusions and workspaces differ. With ``target`` (``jaxdp plan --target h100``) the same
programs are compiled for compile-only GPUs instead (``jaxdp.runtime.target``): XLA:GPU's buffer
assignment, still without cuDNN's workspace (nothing is autotuned). The plan says which it read.

The candidates are the registry's rows with ``planned`` (``candidates()``). Not planned: ``dp`` (``pmap``'s layout holds one state slot per device on a leading axis,
which ``abstract_state`` does not build; its memory is ddp's plus device 0's gathered
gradients).
"""

import math
from typing import Callable, List, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxdp import registry
from jaxdp.analysis.hlo import compiled_memory
from jaxdp.analysis.measure import build_strategy, check_batchnorm_has_values
from jaxdp.analysis.state import model_state_bytes, strategy_formulas
from jaxdp.models import create_model
from jaxdp.runtime.mesh import MeshDims, make_mesh
from jaxdp.runtime.target import compile_only_devices
from jaxdp.strategies import conversions, options_of

MAX_BATCH = 1 << 16  # per device: the search stops here (shapes beyond it reach XLA's int32 indexing)


def candidates() -> tuple:
    """The strategies ``plan`` weighs, in the registry's order (the order ties go by)."""
    return registry.names(planned=True)


def rule() -> str:
    return "least traffic per step among those that fit; ties: the first of " + ", ".join(candidates())


class PlanError(ValueError):
    """Options that cannot be planned (one line on the command line)."""


def meshes(name: str, n: int) -> List[Optional[tuple]]:
    """The meshes ``name`` is planned on: a strategy with a replica axis (hsdp) every (replicas, shards)
    with both > 1, others the 1-D one."""
    if not registry.row(name).replicas:
        return [None]
    return MeshDims.replica_splits(n)


def plan(model: str = "resnet18", devices: int = 8, device_memory: Optional[float] = None,
         global_batch_size: int = 256, *, width: int = 64, blocks: Optional[Sequence[int]] = None, stem: str = "cifar",
         optimizer: str = "sgd", dtype: str = "float32", image_size: int = 32,
         strategies: Optional[Sequence[str]] = None, staleness: int = 1, verify: bool = True, target=None,
         accum_steps: int = 1, accum_reduce: str = "each") -> dict:
    """The plan as a dict: the inputs, one row per (strategy, mesh) and the recommended row's index.
    ``strategies``: a subset of ``candidates()`` (None: all of them). ``target``: a GPU target
    (``jaxdp.runtime.target.Target`` of ``devices`` GPUs in all): every program is compiled for it,
    and ``device_memory`` defaults to its memory (else 80 GiB)."""
    n = devices
    if n < 1 or global_batch_size % n:
        raise PlanError(f"--global-batch-size {global_batch_size} must split evenly over --devices {n}")
    pool = compile_only_devices(target) if target is not None else None
    if device_memory is None:
        device_memory = target.gpu.memory_bytes if target is not None else 80 * 2**30
    if pool is None and len(jax.devices()) < n:
        raise PlanError(f"jax sees {len(jax.devices())} devices, the plan needs {n}: run `jaxdp plan --devices {n}` "
                        "(it simulates them), and leave --xla_force_host_platform_device_count out of XLA_FLAGS")
    planned = candidates()
    strategies = planned if strategies is None else strategies
    unknown = set(strategies) - set(planned)
    if unknown:
        raise PlanError(f"cannot plan {', '.join(sorted(unknown))}; choose from {', '.join(planned)}")
    if dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    b = global_batch_size // n
    net = create_model(model, width=width, blocks=blocks, stem=stem, dtype=dtype)
    check_batchnorm_has_values(net, b, image_size)
    rows = [plan_strategy(name, mesh_shape, net, n, b, device_memory, optimizer=optimizer, image_size=image_size,
                          staleness=staleness, verify=verify, devices=pool,
                          accum=dict(accum_steps=accum_steps, accum_reduce=accum_reduce))
            for name in planned if name in strategies for mesh_shape in meshes(name, n)]
    compiled_for = (f"{target.describe()}: compile-only GPUs, XLA:GPU's buffer assignment" if target is not None
                    else f"{n} simulated CPU devices: XLA:CPU's buffer assignment")
    return {"model": model, "width": width, "blocks": list(getattr(net, "stage_sizes", ())), "dtype": dtype,
            "compiled_for": compiled_for, "target": target.gpu.name if target is not None else None,
            "optimizer": optimizer, "image_size": image_size, "devices": n, "device_memory": device_memory,
            "global_batch_size": global_batch_size, "batch_per_device": b, "psi": rows[0]["psi"] if rows else None,
            "accum_steps": accum_steps, "accum_reduce": accum_reduce,
            "rows": rows, "recommended": recommend(rows), "rule": rule()}


def recommend(rows: List[dict]) -> Optional[int]:
    """The index of the row ``rule()`` picks (rows in ``candidates()``' order), None if none fits."""
    fitting = [i for i, row in enumerate(rows) if row["fits"]]
    return min(fitting, key=lambda i: (rows[i]["traffic_bytes"], i)) if fitting else None


def plan_strategy(name: str, mesh_shape, net, n: int, b: int, device_memory: float, *, optimizer: str,
                  image_size: int, staleness: int, verify: bool, devices=None, accum: Optional[dict] = None) -> dict:
    """One row of the plan: formulas, the compiled memory at b, the largest batch that fits.
    ``devices``: a GPU target's compile-only devices (None: this machine's). ``accum``: ``accum_steps``
    and ``accum_reduce`` (the latter where the strategy takes it)."""
    takes = options_of(name)
    accum = dict(accum or {})
    options = {k: v for k, v in (("mesh_shape", mesh_shape), ("staleness", staleness),
                                 ("accum_reduce", accum.get("accum_reduce", "each"))) if k in takes}
    options["accum_steps"] = k_steps = accum.get("accum_steps", 1)
    strategy = build_strategy(name, make_mesh(n, devices=devices), net, optimizer, options)
    compiled = {}

    def total(batch: int) -> int:
        if batch not in compiled:
            compiled[batch] = step_memory(strategy, batch, image_size)
        return compiled[batch]["total_bytes"]

    largest = largest_batch(total, b, device_memory, verify, multiple=k_steps)  # compiles at b first: sets shapes
    formulas = strategy_formulas(strategy)
    state = formulas["formula_padded"]
    formula_total = model_state_bytes(state) + state["grads"] + state["unsharded_grads"]
    return {"strategy": name, "mesh_shape": mesh_shape, "psi": formulas["psi"],
            "state_bytes": model_state_bytes(state), "grads_bytes": state["grads"],
            "unsharded_grads_bytes": state["unsharded_grads"],
            "memory": compiled[b], "fits": compiled[b]["total_bytes"] <= device_memory and formula_total <= device_memory,
            **largest,
            "traffic_bytes": formulas["traffic_formula_bytes"] or 0.0}


def step_memory(strategy, batch_per_device: int, image_size: int) -> dict:
    """``memory_analysis()`` of the strategy's step at this per-device batch, compiled from shapes alone."""
    return with_total(compiled_memory(compile_from_shapes(strategy, batch_per_device, image_size)))


def compile_from_shapes(strategy, batch_per_device: int, image_size: int):
    """The strategy's step compiled for an image batch of this size, from shapes alone (nothing
    is allocated); sets ``strategy.shapes``."""
    rows = batch_per_device * strategy.num_devices
    split = NamedSharding(strategy.mesh, P(strategy.batch_axes))
    batch = {"image": jax.ShapeDtypeStruct((rows, image_size, image_size, 3), strategy.model.dtype, sharding=split),
             "label": jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=split)}
    return strategy.engine.lower_step(conversions.abstract_state(strategy, batch), batch).compile()


def with_total(memory: dict) -> dict:
    """``memory`` plus ``total`` = argument + output - alias + temp: the donated state counted once."""
    return dict(memory, total_bytes=memory["argument_bytes"] + memory["output_bytes"] - memory["alias_bytes"]
                + memory["temp_bytes"])


def largest_batch(total: Callable[[int], int], b: int, capacity: float, verify: bool = True,
                  multiple: int = 1) -> dict:
    """The largest per-device batch (a ``multiple`` of the micro-batches) whose ``total(batch)`` bytes fit
    in ``capacity``, from the line through ``total(b)`` and ``total(2b)``; with ``verify``, ``total`` at
    the answer checks it."""
    points = {b: total(b), 2 * b: total(2 * b)}
    for _ in range(3):  # small batches may fit in buffers XLA reuses anyway: go on until memory grows
        if _line(points)[0] > 0 or max(points) >= MAX_BATCH:
            break
        points[2 * max(points)] = total(2 * max(points))
    guess = _on_line(points, capacity) // multiple * multiple
    if verify and guess > 0 and guess not in points:
        points[guess] = total(guess)
        if points[guess] > capacity:  # not quite linear: once more through the two largest points
            guess = min(_on_line(points, capacity), guess - 1) // multiple * multiple
            if guess > 0 and guess not in points:
                points[guess] = total(guess)
    slope, fixed = _line(points)
    return {"max_batch_per_device": guess, "max_batch_bytes": points.get(guess),
            "verified": guess == 0 or (guess in points and points[guess] <= capacity),
            "fixed_bytes": fixed, "bytes_per_image": slope}


def _line(points: dict):
    (b1, m1), (b2, m2) = sorted(points.items())[-2:]
    slope = (m2 - m1) / (b2 - b1)
    return slope, m2 - slope * b2


def _on_line(points: dict, capacity: float) -> int:
    slope, fixed = _line(points)
    if slope <= 0:
        return MAX_BATCH if fixed <= capacity else 0
    return max(0, min(MAX_BATCH, math.floor((capacity - fixed) / slope)))
