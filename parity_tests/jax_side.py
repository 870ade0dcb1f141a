"""jaxdp's side of a parity run: the strategy of the plan, K steps from the shared weights and
batches, each step's record in torch_ref's format (torch names and layouts).

Nothing here imports jax at module level.
"""

from __future__ import annotations

import os
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from parity_tests.plan import Plan, powersgd_leaf


def configure_precision(cuda: bool) -> None:
    """XLA's highest matmul precision on GPUs (no TF32) for the jaxdp side.

    The torch side turns TF32 off inside each rank (``torch_ref.launcher.no_tf32``):
    the ranks are forked from a forkserver that may have started earlier, with another
    environment, so neither this process's torch flags nor its environment reach them.
    (float64 never uses TF32; on CPU this changes nothing.)"""
    import jax

    if cuda or jax.default_backend() == "gpu":
        os.environ["NVIDIA_TF32_OVERRIDE"] = "0"  # read by cuBLAS/cuDNN when XLA first loads them
        jax.config.update("jax_default_matmul_precision", "highest")


def jax_strategy(p: Plan, devices: Optional[Sequence] = None):
    """The jaxdp strategy for the plan (model, classifier task, optimizer, mesh), ``return_grads=True``.
    zero3/hsdp shard per FSDP unit, the model's own (``fsdp_units``: residual or encoder blocks), as
    torch_ref's FSDP2 twin ``fully_shard``s every block and then the root. ``devices``: the mesh's
    (default ``jax.devices()``), e.g. a GPU target's compile-only ones (``compile_step``)."""
    from jaxdp.runtime.mesh import make_mesh
    from jaxdp.models import create_model, fsdp_units
    from jaxdp.strategies import create_strategy, options_of
    from jaxdp.loss.task import classifier

    cfg = p.cfg
    model = create_model(cfg.model, num_classes=cfg.num_classes, dtype=cfg.dtype, **cfg.model_options())
    units = {"units": fsdp_units(model)} if "units" in options_of(cfg.strategy) else {}
    mesh = make_mesh(cfg.devices, devices=devices)
    return create_strategy(cfg.strategy, model, classifier(model), optimizer(p), mesh, accum_steps=cfg.accum_steps,
                           sync_bn=cfg.sync_bn, return_grads=True, **units, **p.jax_options)


def optimizer(p: Plan):
    """The run's optax chain (``jaxdp.optim``), its schedule over the torch side's ``total_steps``:
    torch_ref builds the same optimizer and schedule from the same config."""
    from jaxdp.optim import make_optimizer, make_schedule

    cfg = p.cfg
    lr = (cfg.lr if cfg.schedule == "constant" and cfg.warmup_steps == 0 else
          make_schedule(cfg.schedule, cfg.lr, p.torch_config["total_steps"], warmup_steps=cfg.warmup_steps))
    return make_optimizer(cfg.optimizer, lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                          weight_decay=cfg.weight_decay, betas=tuple(cfg.betas), eps=cfg.eps,
                          clip_grad_norm=cfg.clip_grad_norm)


def run_jax(p: Plan, state_dict: Mapping[str, np.ndarray],
            batches: Sequence[Tuple[np.ndarray, np.ndarray]]) -> List[dict]:
    """K jaxdp steps; one record per step in torch_ref's format (torch names and layouts).
    64-bit types exist only in a float64 run: a float32 run traces with x64 off, as a user's
    float32 program would (int32 indices, float32 constants), whatever the caller's setting."""
    import jax

    with jax.enable_x64(p.cfg.dtype == "float64"):
        p.jax_x64 = bool(jax.config.jax_enable_x64)
        return _jax_steps(p, state_dict, batches)


def compile_step(p: Plan, batch: Tuple[np.ndarray, np.ndarray], devices: Sequence):
    """The step ``run_jax`` runs for the plan, compiled for ``devices`` from shapes alone: a GPU target's
    compile-only devices (``jaxdp.runtime.target``) compile the program a GPU host would run, on a CPU.
    ``batch``: one step's (images, labels) as ``make_batches`` gives them. Nothing is allocated or run."""
    import jax

    with jax.enable_x64(p.cfg.dtype == "float64"):
        strategy = jax_strategy(p, devices)
        return strategy.engine.lower_step(*strategy.engine.step_shapes(global_batch(*batch))).compile()


def global_batch(images: np.ndarray, labels: np.ndarray) -> dict:
    """One step's (N, b, ...) images and labels -> the global batch, rows in device order."""
    return {"image": images.reshape(-1, *images.shape[2:]), "label": labels.reshape(-1)}


def _jax_steps(p: Plan, state_dict: Mapping[str, np.ndarray],
               batches: Sequence[Tuple[np.ndarray, np.ndarray]]) -> List[dict]:
    from jaxdp.interop import tree_to_torch_names

    strategy = jax_strategy(p)
    host = (global_batch(images, labels) for images, labels in batches)
    return step_records(strategy, initial_state(p, strategy, state_dict), host, p.cfg.optimizer, tree_to_torch_names,
                        lambda model_state: tree_to_torch_names(model_state.get("batch_stats", {}), "batch_stats"))


def initial_state(p: Plan, strategy, state_dict: Mapping[str, np.ndarray]):
    """The run's first state: torch's initial weights placed by the strategy, in the run's dtype
    (bfloat16 is mixed precision: float32 params, the master weights, and bf16 compute)."""
    from jaxdp.interop import variables_from_state_dict

    variables = variables_from_state_dict(state_dict, dtype="float32" if p.cfg.dtype == "bfloat16" else p.cfg.dtype)
    return strategy.engine.init_state(variables)


def step_records(strategy, state, host_batches: Iterable, optimizer_name: str,
                 torch_names: Callable, buffer_names: Callable) -> List[dict]:
    """One ``strategy.engine.step`` per host batch (the global batch, rows in device order), and each
    step's record in torch_ref's format (``compare.flatten``'s). ``torch_names(tree)``: a
    params-shaped tree (params, grads, optimizer state) -> {torch name: array in torch layout};
    ``buffer_names(model_state)``: the model state -> {torch buffer name: array}."""
    import jax

    from parity_tests.optim_state import torch_optimizer_state

    records = []
    for host in host_batches:
        state, metrics = strategy.engine.step(state, strategy.engine.shard_batch(host))
        metrics = jax.device_get(metrics)
        canon = jax.device_get(strategy.engine.canonical(state))
        opt = torch_optimizer_state(optimizer_name, canon.opt_state)
        opt_named: Dict[str, Dict[str, np.ndarray]] = {}
        for key, tree in opt.items():
            if key == "step":
                continue
            for name, value in torch_names(tree).items():
                opt_named.setdefault(name, {})[key] = value
        if "step" in opt:
            for name in opt_named:
                opt_named[name]["step"] = np.asarray(float(opt["step"]))
        records.append({
            "loss": float(metrics["loss"]),
            "loss_per_rank": [float(x) for x in np.asarray(metrics["loss_per_device"])],
            "grads": torch_names(metrics["grads"]),
            "params": torch_names(canon.params),
            "buffers": buffer_names(canon.model_state),
            "optimizer_state": opt_named,
        })
        comm = powersgd_state(canon.extra)
        if comm is not None:
            records[-1]["comm_state"] = comm
    return records


def powersgd_state(extra) -> Optional[Dict[str, Dict[str, np.ndarray]]]:
    """jaxdp's PowerSGD state (``extra``: per-device error, Q by leaf name) in the torch
    record's form: {torch name: {"error": (devices, *torch shape), "q": (m, r)}}."""
    import jax

    from jaxdp.interop import tree_to_torch_names

    if not isinstance(extra, dict) or "error" not in extra:
        return None
    errors = extra["error"]
    devices = jax.tree_util.tree_leaves(errors)[0].shape[0]
    per_device = [tree_to_torch_names(jax.tree_util.tree_map(lambda e: e[d], errors)) for d in range(devices)]
    out = {name: {"error": np.stack([named[name] for named in per_device])} for name in per_device[0]}
    torch_name = {powersgd_leaf(name): name for name in out}
    for leaf, q in (extra.get("q") or {}).items():
        out[torch_name[leaf]]["q"] = np.asarray(q)
    return out
