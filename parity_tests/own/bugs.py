"""Deliberate porting mistakes in a user's pair: each is one a real port makes, and the harness
must catch it at the first step where it shows, and name the tensor.

======================  ===================================================  =============================
bug                     the mistake                                          where the harness sees it
======================  ===================================================  =============================
layernorm_eps           the two sides' LayerNorm epsilons differ: torch's    step 0, ``loss``; the first
                        set to 1e-6, Flax's default, against the port's      module whose output differs:
                        1e-5                                                 the first LayerNorm
missing_bias            one Linear's bias is not applied in torch's          step 0, ``loss`` (its bias is
                        forward (``F.linear(x, W, 0 * b)``: it stays a       not zero); that Linear's output
                        parameter, its gradient 0)                           differs first
transposed_weight       the correspondence copies one square weight that is  step 0, ``loss``; its module's
                        transposed (a Linear's, HF's FlaxConv1D's) without   output differs first
                        its transpose (shapes agree, so no check of shapes
                        can see it)
loss_wrong_axis         the Flax loss averages the per-element losses over   step 0, ``loss``; every module's
                        the batch axis only and sums over the others         output agrees (the losses differ)
                        (``l.mean(0).sum()``, not ``l.mean()``)
skipped_grad_sync       torch steps without its gradient sync (DDP           step 0, ``grads/<first param>``
                        ``no_sync()``, FSDP2 ``set_requires_gradient_sync``  (the loss agrees: it comes before
                        (False) on every micro-batch): each rank updates     the sync)
                        with its own gradient
======================  ===================================================  =============================

A missing bias that the port leaves out altogether (``use_bias=False``) never reaches the
comparison: the correspondence refuses it before anything runs (torch only: ``....bias``).
The skipped sync is injected into torch: in jaxdp the same mistake does not compile (a
gradient still varying over the devices cannot become a replicated parameter: ``check_vma``).

Each bug transforms the pair (``on_pair``: both the harness's process and every torch rank
build the pair through it), the correspondence (``on_correspondence``) or the torch rank's
step (``in_torch_rank``). Jax- and torch-free at import.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

from parity_tests.config import ParityError
from parity_tests.own.pair import ModelPair

FLAX_LAYERNORM_EPS = 1e-6  # flax.linen.LayerNorm's default epsilon; torch's is 1e-5


def _torch_layernorm_eps(pair: ModelPair) -> ModelPair:
    from torch import nn

    for module in pair.torch_model.modules():
        if isinstance(module, nn.LayerNorm):
            module.eps = FLAX_LAYERNORM_EPS
    return pair


def _first_linear_with_bias(model):
    from torch import nn

    return next(((n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and m.bias is not None),
                (None, None))


def _without_bias(self, x):
    import torch.nn.functional as F

    return F.linear(x, self.weight, 0 * self.bias)  # BUG: 0 * b, not no bias (DDP refuses a param with no grad)


def _torch_bias_dropped(pair: ModelPair) -> ModelPair:
    import types

    _, linear = _first_linear_with_bias(pair.torch_model)
    linear.forward = types.MethodType(_without_bias, linear)  # a method: a copy of the model keeps the bug
    return pair


def _loss_over_wrong_axis(pair: ModelPair) -> ModelPair:
    loss = pair.flax_loss

    def wrong(outputs, batch):
        per_element = loss(outputs, batch)
        if per_element.ndim < 2:
            raise ParityError("bug loss_wrong_axis needs a Flax loss that returns per-element losses with >= 2 "
                              f"axes (batch first); this one returns shape {tuple(per_element.shape)}")
        return per_element.mean(axis=0).sum()  # BUG: l.mean() averages over every axis

    return pair.replace(flax_loss=wrong)


def _square_linear_untransposed(corr):
    import dataclasses

    from jaxdp.interop import LAYOUTS, Correspondence

    link = next((k for k in corr.links if k.layout.name == "linear" and len(set(k.shape)) == 1), None)
    if link is None:
        return corr
    untransposed = dataclasses.replace(link, layout=LAYOUTS["identity"])  # BUG: no .T
    return Correspondence([untransposed if k is link else k for k in corr.links], corr.ignored, corr.tied)


@contextlib.contextmanager
def _never_synced():
    """Every micro-step of torch_ref's Runner without its gradient sync."""
    from torch_ref import strategies

    original = strategies.Parallel.micro_step
    strategies.Parallel.micro_step = lambda self, sync: original(self, False)  # BUG: no all-reduce ever
    try:
        yield
    finally:
        strategies.Parallel.micro_step = original


def _needs(what: str, test: Callable[[Any], bool]):
    return lambda pair, run: None if test(pair) else f"it needs {what}"


def _has_layernorm(pair) -> bool:
    from torch import nn

    return any(isinstance(m, nn.LayerNorm) for m in pair.torch_model.modules())


def _several_ranks(pair, run) -> Optional[str]:
    return None if run.devices >= 2 else "it needs --devices >= 2 (one rank has nothing to sync)"


@dataclass(frozen=True)
class PairBug:
    name: str
    what: str
    category: str                       # where the harness must see it first (at step 0)
    pair: Callable[[ModelPair], ModelPair] = lambda pair: pair
    correspondence: Callable[[Any], Any] = lambda corr: corr
    torch_rank: Callable[[], Any] = contextlib.nullcontext
    requires: Callable[[ModelPair, Any], Optional[str]] = lambda pair, run: None


BUGS = {b.name: b for b in (
    PairBug("layernorm_eps", f"torch's LayerNorm epsilon {FLAX_LAYERNORM_EPS:g} (Flax's default), the port's 1e-5",
            "loss", pair=_torch_layernorm_eps, requires=_needs("a torch LayerNorm", _has_layernorm)),
    PairBug("missing_bias", "one torch Linear's bias not applied in its forward", "loss", pair=_torch_bias_dropped,
            requires=_needs("a torch Linear with a bias", lambda p: _first_linear_with_bias(p.torch_model)[1] is not None)),
    PairBug("transposed_weight", "one square weight copied without its transpose", "loss",
            correspondence=_square_linear_untransposed),
    PairBug("loss_wrong_axis", "the Flax loss averaged over the batch axis only (l.mean(0).sum())", "loss",
            pair=_loss_over_wrong_axis),
    PairBug("skipped_grad_sync", "torch steps without its gradient sync (each rank its own gradient)", "grads",
            torch_rank=_never_synced, requires=_several_ranks),
)}


def named(name: str) -> PairBug:
    """The bug called ``name``; ParityError in one line if there is none."""
    if name not in BUGS:
        raise ParityError(f"unknown bug {name!r} for a pair; choose one of {', '.join(BUGS)}")
    return BUGS[name]


def check(name: Optional[str], pair: ModelPair, run) -> None:
    """ParityError in one line for a bug this pair and run cannot show."""
    why = None if name is None else named(name).requires(pair, run)
    if why:
        raise ParityError(f"bug {name} cannot show in this run: {why}")


def on_pair(name: Optional[str], pair: ModelPair) -> ModelPair:
    return pair if name is None else named(name).pair(pair)


def on_correspondence(name: Optional[str], corr):
    if name is None:
        return corr
    out = BUGS[name].correspondence(corr)
    if name == "transposed_weight" and out is corr:
        raise ParityError("bug transposed_weight cannot show in this run: it needs a square weight that is "
                          "transposed (a Linear's against a Dense)")
    return out


def in_torch_rank(name: Optional[str]):
    return contextlib.nullcontext() if name is None else BUGS[name].torch_rank()
