"""A pair's run set up in the harness's own process, before any rank starts: the pair built,
its correspondence derived, one init for both sides, the batches, and the refusals (a
correspondence that does not cover both models, units that cut them differently, active
dropout), each in one line.

Jax and torch are imported where they are used.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

import numpy as np

from parity_tests.inputs import cast
from parity_tests.own import bugs, nnx_pair
from parity_tests.own.config import PairRun
from parity_tests.own.correspondence import Correspondence, check_units, derive
from parity_tests.own.jax_pair import apply_fn, flax_model_at, host_batch, pair_loss
from parity_tests.own.pair import Factory, ModelPair, PairError
from parity_tests.own.torch_rank import build_pair

FSDP_TWINS = ("zero2", "zero3", "hsdp")


@dataclass
class Setup:
    pair: ModelPair
    flax_model: Any                       # at the run's compute dtype
    corr: Correspondence
    state_dict: Dict[str, np.ndarray]     # the one init, by torch name, in the run's dtype (bf16: float32)
    variables: Dict[str, Any]             # the same as Flax variables
    batches: List[Dict[str, np.ndarray]]  # global batches, rows in device order, the run's float dtype


def param_dtype(dtype: str):
    return np.float64 if dtype == "float64" else np.float32


def sample(pair: ModelPair, run: PairRun, rows: int) -> List[Dict[str, np.ndarray]]:
    """``run.steps`` batches of ``rows`` rows from the pair's ``sample_batch`` (seeded by ``run.seed``)."""
    rng = np.random.default_rng(run.seed)
    return [host_batch(pair.sample_batch(rng, rows), run.dtype) for _ in range(run.steps)]


def prepare(fac: Factory, run: PairRun, bug: Optional[str] = None) -> Setup:
    """Everything both sides share, or ``PairError`` (one line) for what cannot run."""
    import jax

    pair = build_pair(fac, bug, run.seed, run)
    model = flax_model_at(pair.flax_model, run.dtype)
    batches = sample(pair, run, run.devices * run.batch_per_device)
    example = {k: v[: run.batch_per_device] for k, v in batches[0].items()}
    with jax.enable_x64(run.dtype == "float64"):
        shapes = _flax_shapes(pair, model, example)
        corr = bugs.on_correspondence(bug, derive(pair.torch_model, shapes, pair.correspondence))
        state_dict = _one_init(pair, model, corr, run, example)
        corr.check_round_trip(state_dict)
        variables = corr.to_flax(state_dict, param_dtype(run.dtype))
        refuse_dropout(pair, model, variables, example, run.dtype)
        if run.strategy in FSDP_TWINS:
            _check_units(pair, model, corr, example)
    return Setup(pair, model, corr, state_dict, variables, batches)


def _flax_shapes(pair: ModelPair, model, example):
    import jax

    if nnx_pair.is_nnx(model):
        return jax.eval_shape(lambda: nnx_pair.variables(model))
    args = pair.inputs("flax")(example)
    return jax.eval_shape(lambda: model.init(jax.random.key(0), *args, **dict(pair.flax_kwargs)))


def _one_init(pair: ModelPair, model, corr: Correspondence, run: PairRun, example) -> Dict[str, np.ndarray]:
    """The torch model's init (float32, as built under ``manual_seed(seed)``), or with
    ``init_from="flax"`` the Flax model's (``init`` with key ``seed``) copied to torch names; in the
    run's dtype. Torch buffers with no Flax counterpart keep torch's values."""
    import jax

    own = {k: v.detach().cpu().numpy().copy() for k, v in pair.torch_model.state_dict().items()}
    if pair.init_from == "flax" and nnx_pair.is_nnx(model):  # built with its params
        own.update(corr.to_torch(jax.device_get(nnx_pair.variables(model))))
    elif pair.init_from == "flax":
        variables = model.init(jax.random.key(run.seed), *pair.inputs("flax")(example), **dict(pair.flax_kwargs))
        own.update(corr.to_torch(jax.device_get(variables)))
    return cast(own, param_dtype(run.dtype))


def refuse_dropout(pair: ModelPair, model, variables, example, dtype: str) -> None:
    """Dropout cannot draw the same masks in two frameworks: a model that draws random numbers in
    training is refused, in one line. Flax: the loss traced with no rng (a dropout asks for one);
    torch: dropout modules with p > 0, and the same batch run twice under two seeds."""
    import flax.errors
    import jax
    import torch
    from torch import nn

    if nnx_pair.is_nnx(model):
        why = nnx_pair.draws(pair, model, example, pair_loss(pair, dtype))
    else:
        try:
            jax.eval_shape(apply_fn(pair, model, dtype), variables, example)
            why = None
        except flax.errors.InvalidRngError as e:
            why = str(e).split(' (https')[0]
    if why:
        raise PairError(f"the Flax model draws random numbers in training ({why}): dropout cannot match across two "
                        "random number generators; turn it off for the parity run (rate 0 or deterministic=True)")
    dropouts = [f"{n} (p={m.p})" for n, m in pair.torch_model.named_modules()
                if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]
    if dropouts:
        raise PairError(f"the torch model has active dropout ({', '.join(dropouts)}): dropout cannot match across "
                        "two random number generators; set p=0 for the parity run")
    losses = []
    probe = copy.deepcopy(pair.torch_model).double().train()  # a copy: BatchNorm's running stats stay
    batch = {k: torch.from_numpy(np.asarray(v)).to(torch.float64 if np.issubdtype(v.dtype, np.floating) else torch.int64)
             for k, v in example.items()}
    for seed in (1, 2):
        torch.manual_seed(seed)
        with torch.no_grad():
            losses.append(pair.torch_loss(probe(*pair.inputs("torch")(batch)), batch).mean().item())
    if losses[0] != losses[1]:
        raise PairError("the torch model's loss differs between two runs of one batch (dropout or another random "
                        "draw in its forward): it cannot match across two random number generators")


def _check_units(pair: ModelPair, model, corr: Correspondence, example) -> None:
    import jax

    from jaxdp.strategies.units import Units, UnitError, unit_paths
    from torch_ref.strategies import fsdp_blocks

    args = pair.inputs("flax")(example)
    try:
        flax_units = nnx_pair.unit_paths(pair, model) if nnx_pair.is_nnx(model) else unit_paths(
            Units(pair.flax_units), lambda *a: model.init(jax.random.key(0), *a, **dict(pair.flax_kwargs)), *args)
    except UnitError as e:
        raise PairError(f"flax_units: {e}") from None
    blocks = set(map(id, fsdp_blocks(pair.torch_model, tuple(pair.torch_units))))
    torch_units = [n for n, m in pair.torch_model.named_modules() if id(m) in blocks]
    if pair.torch_units and not torch_units:
        raise PairError(f"torch_units: no torch module matches {tuple(pair.torch_units)}")
    problem = check_units(corr, flax_units, torch_units)
    if problem:
        raise PairError(problem)
