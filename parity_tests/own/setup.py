"""A pair's run set up in the harness's own process, before any rank starts: the pair built,
its correspondence derived, one init for both sides, the batches, and the refusals (a
correspondence that does not cover both models, units that cut them differently, active
dropout), each in one line.

Jax and torch are imported where they are used.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

import numpy as np

from parity_tests.inputs import cast
from parity_tests.own import bugs, nnx_pair
from parity_tests.own.config import PairRun
from jaxdp.models.errors import key_listing
from jaxdp.interop import Correspondence, as_numpy
from jaxdp.interop.convert import complete, module_classes, trace_linen
from parity_tests.own.correspondence import check_round_trip, check_units, derive
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
        shapes, classes = _flax_shapes(pair, model, example)
        corr = bugs.on_correspondence(bug, derive(pair.torch_model, shapes, pair.correspondence, classes))
        state_dict = _one_init(pair, model, corr, run, example)
        if pair.init_from == "loaded":
            _check_loaded(fac, bug, run, state_dict)
        check_round_trip(corr, state_dict)
        variables = corr.to_flax(state_dict, param_dtype(run.dtype))
        refuse_dropout(pair, model, variables, example, run.dtype)
        if run.strategy in FSDP_TWINS:
            _check_units(pair, model, corr, example)
    return Setup(pair, model, corr, state_dict, variables, batches)


def _flax_shapes(pair: ModelPair, model, example):
    """The Flax variables' shapes, and the class of the module at each path (``jaxdp.interop.derive``)."""
    import jax

    if nnx_pair.is_nnx(model):
        return jax.eval_shape(lambda: nnx_pair.variables(model)), module_classes(model)
    args, kwargs = pair.arguments("flax", example)
    with user_code("the Flax model's init on flax_inputs(batch)"):
        return trace_linen(model, *args, **kwargs)


@contextlib.contextmanager
def user_code(what: str):
    """A pair's own code failing (a model called with the wrong inputs, a loss that does not fit
    the outputs): ``PairError`` in one line that says where, not a traceback from deep inside."""
    try:
        yield
    except PairError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the user's code raises
        first = (str(e).strip().splitlines() or [""])[0]
        raise PairError(f"{what} failed: {type(e).__name__}: {first}") from e


def _one_init(pair: ModelPair, model, corr: Correspondence, run: PairRun, example) -> Dict[str, np.ndarray]:
    """The torch model's weights (its init as built under ``manual_seed(seed)``, or with
    ``init_from="loaded"`` what the factory loaded; a bf16 checkpoint's values exactly), or with
    ``init_from="flax"`` the Flax model's (``init`` with key ``seed``) copied to torch names; in the
    run's dtype. Torch buffers with no Flax counterpart keep torch's values; a tied tensor's
    second name (``corr.tied``) holds its first name's values."""
    import jax

    converted = {}
    if pair.init_from == "flax" and nnx_pair.is_nnx(model):  # built with its params
        converted = corr.to_torch(jax.device_get(nnx_pair.variables(model)))
    elif pair.init_from == "flax":
        args, kwargs = pair.arguments("flax", example)
        converted = corr.to_torch(jax.device_get(model.init(jax.random.key(run.seed), *args, **kwargs)))
    return cast(complete(corr, pair.torch_model.state_dict(), converted), param_dtype(run.dtype))


def _check_loaded(fac: Factory, bug: Optional[str], run: PairRun, state_dict: Mapping[str, np.ndarray]) -> None:
    """``init_from="loaded"``: the pair built under another seed has the very same torch weights,
    else a tensor was drawn, not loaded (one the checkpoint lacks, which the model initialised)."""
    other = build_pair(fac, bug, run.seed + 1).torch_model.state_dict()
    drawn = [name for name, x in other.items()
             if name in state_dict and not np.array_equal(as_numpy(x).astype(state_dict[name].dtype), state_dict[name])]
    if drawn:
        raise PairError(f"init_from='loaded', but {key_listing(drawn)} differ{'s' if len(drawn) == 1 else ''} between "
                        "two builds of the pair under two seeds: drawn by the model's init, not loaded (a tensor "
                        "the checkpoint lacks?)")


def refuse_dropout(pair: ModelPair, model, variables, example, dtype: str) -> None:
    """Dropout cannot draw the same masks in two frameworks: a model that draws random numbers in
    training is refused, in one line. Flax: the loss traced with no rng (a dropout asks for one);
    torch: dropout modules with p > 0, and the same batch run twice under two seeds."""
    import flax.errors
    import jax
    import torch
    from torch import nn

    with user_code("the Flax model and flax_loss on flax_inputs(batch)"):
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
    args, kwargs = pair.arguments("torch", batch)
    for seed in (1, 2):
        torch.manual_seed(seed)
        with torch.no_grad(), user_code("the torch model and torch_loss on torch_inputs(batch)"):
            losses.append(pair.torch_loss(probe(*args, **kwargs), batch).mean().item())
    if losses[0] != losses[1]:
        raise PairError("the torch model's loss differs between two runs of one batch (dropout or another random "
                        "draw in its forward): it cannot match across two random number generators")


def _check_units(pair: ModelPair, model, corr: Correspondence, example) -> None:
    import jax

    from jaxdp.strategies.units import Units, UnitError, unit_paths
    from torch_ref.strategies import fsdp_blocks

    args, kwargs = pair.arguments("flax", example)
    try:
        flax_units = nnx_pair.unit_paths(pair, model) if nnx_pair.is_nnx(model) else unit_paths(
            Units(pair.flax_units), lambda: model.init(jax.random.key(0), *args, **kwargs))
    except UnitError as e:
        raise PairError(f"flax_units: {e}") from None
    blocks = set(map(id, fsdp_blocks(pair.torch_model, tuple(pair.torch_units))))
    torch_units = [n for n, m in pair.torch_model.named_modules() if id(m) in blocks]
    if pair.torch_units and not torch_units:
        raise PairError(f"torch_units: no torch module matches {tuple(pair.torch_units)}")
    problem = check_units(corr, flax_units, torch_units)
    if problem:
        raise PairError(problem)
