"""Optimizers and learning-rate schedules that reproduce ``torch.optim`` step for step.

Every optimizer here *is* an optax chain; this module only picks the chain whose
arithmetic is torch's and refuses options torch and optax do not share. The parity
harness holds these to float64 relative error <= 1e-12 per step against
``torch.optim`` (tests/test_optim.py).

=========  ==============================================  =====================================
name       torch                                           optax chain
=========  ==============================================  =====================================
sgd        ``SGD(lr, momentum, nesterov=, weight_decay=)``  ``chain(add_decayed_weights(wd),
           ``g += wd*p; buf = g`` (1st step) else           sgd(lr, momentum or None, nesterov))``
           ``mu*buf + g``; nesterov ``g + mu*buf``;
           ``p -= lr*that``
adam       ``Adam(lr, betas, eps, weight_decay=)``          ``chain(add_decayed_weights(wd),
           coupled L2 ``g += wd*p``, bias-corrected,         adam(lr, b1, b2, eps))``
           eps outside the sqrt
adamw      ``AdamW(lr, betas, eps, weight_decay=)``         ``adamw(lr, b1, b2, eps,
           ``p *= 1 - lr*wd`` then the Adam step            weight_decay=wd)``
=========  ==============================================  =====================================

``weight_decay`` defaults to 0.0 for all three. ``torch.optim.AdamW`` defaults to 1e-2 and
``optax.adamw`` to 1e-4, so neither library's default is used: torch_ref must pass the same
value explicitly.

Schedules are functions of the optimizer step count (optax's ``count``: the lr used by the
k-th update, k = 0, 1, ...). That is what ``torch.optim.lr_scheduler`` gives when
``scheduler.step()`` is called once after every ``optimizer.step()``.
``torch_lr_lambda`` returns the same closed form as a pure-python multiplier, so torch_ref can
drive every schedule through ``LambdaLR`` and both sides evaluate one formula.
"""

from __future__ import annotations

import bisect
import collections
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import optax

from jaxdp.loss.reductions import clip_by_global_norm
from jaxdp.names import OPTIMIZERS, SCHEDULES  # the names (jaxdp.names); their optax chains are here


class ConfigError(ValueError):
    """An optimizer or schedule option that is unknown or has no exact torch equivalent.

    The message is one line, names the option and, for names, lists the valid choices.
    """


def _choice(kind: str, name: Any, choices: Sequence[str]) -> str:
    if name not in choices:
        raise ConfigError(f"unknown {kind} {name!r}; valid choices: {', '.join(choices)}")
    return name


def _nonneg(option: str, value: Any) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{option} must be a number >= 0, got {value!r}") from None
    if not v >= 0.0:  # also catches nan
        raise ConfigError(f"{option} must be >= 0, got {value!r}")
    return v


def _int(option: str, value: Any, minimum: int) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        v = operator.index(value)
    except TypeError:
        raise ConfigError(f"{option} must be an integer >= {minimum}, got {value!r}") from None
    if v < minimum:
        raise ConfigError(f"{option} must be an integer >= {minimum}, got {value!r}")
    return v


# ----------------------------------------------------------------------------------------
# Schedules
# ----------------------------------------------------------------------------------------

# Options each schedule reads. Setting one a schedule ignores is refused rather than
# silently dropped (e.g. warmup_steps with "cosine" is almost certainly a config mistake).
_SCHEDULE_OPTIONS = {
    "constant": (),
    "cosine": ("min_lr",),
    "multistep": ("milestones", "gamma"),
    "warmup_cosine": ("warmup_steps", "min_lr"),
}
_SCHEDULE_DEFAULTS = {"warmup_steps": 0, "milestones": (), "gamma": 0.1, "min_lr": 0.0}


def _schedule_args(name, base_lr, total_steps, warmup_steps, milestones, gamma, min_lr):
    """Validate once for make_schedule and torch_lr_lambda, so both refuse the same things."""
    _choice("schedule", name, SCHEDULES)
    base_lr = _nonneg("base_lr", base_lr)
    given = {"warmup_steps": warmup_steps, "milestones": tuple(milestones or ()), "gamma": gamma,
             "min_lr": min_lr}
    for option, value in given.items():
        if option not in _SCHEDULE_OPTIONS[name] and value != _SCHEDULE_DEFAULTS[option]:
            raise ConfigError(
                f"{option}={value!r} has no effect on schedule {name!r} "
                f"(it uses: {', '.join(_SCHEDULE_OPTIONS[name]) or 'no options'})")
    args = {"base_lr": base_lr}
    if name in ("cosine", "warmup_cosine"):
        args["total_steps"] = _int("total_steps", total_steps, 1)
        min_lr = _nonneg("min_lr", min_lr)
        if min_lr > base_lr:
            # torch allows eta_min > base_lr (a cosine that rises); optax expresses the floor
            # as alpha = min_lr / base_lr, which base_lr = 0 cannot carry. Refused as a typo.
            raise ConfigError(f"min_lr must be in [0, base_lr={base_lr}], got {min_lr}")
        args["min_lr"] = min_lr
        w = _int("warmup_steps", warmup_steps, 0)
        if w >= args["total_steps"]:
            raise ConfigError(
                f"warmup_steps must be < total_steps={args['total_steps']}, got {w}")
        args["warmup_steps"] = w
    if name == "multistep":
        ms = [_int("milestones", m, 0) for m in given["milestones"]]
        g = _nonneg("gamma", gamma)  # optax's piecewise schedule refuses negative scales
        args["milestones"] = sorted(ms)
        args["gamma"] = g
    return args


def _cosine_alpha(base_lr: float, min_lr: float) -> float:
    # optax.cosine_decay_schedule takes the floor as a fraction of the peak.
    return min_lr / base_lr if base_lr > 0 else 0.0


def make_schedule(name: str, base_lr: float, total_steps: int, *, warmup_steps: int = 0,
                  milestones: Sequence[int] = (), gamma: float = 0.1,
                  min_lr: float = 0.0) -> optax.Schedule:
    """Learning rate as a function of the optimizer step count (0 for the first update).

    - ``constant``: ``base_lr`` (torch: no scheduler).
    - ``cosine``: ``CosineAnnealingLR(T_max=total_steps, eta_min=min_lr)``:
      ``min_lr + (base_lr - min_lr) * (1 + cos(pi * t / total_steps)) / 2``.
      For ``t > total_steps`` this holds ``min_lr``, while torch's scheduler climbs back up
      (it is periodic with period ``2 * T_max``); a run never steps past ``total_steps``.
    - ``multistep``: ``MultiStepLR(milestones, gamma)``: ``base_lr * gamma**k`` with ``k``
      the number of milestones ``<= t`` (repeated milestones count repeatedly, as torch's
      ``Counter`` does).
    - ``warmup_cosine``: ``base_lr * t / warmup_steps`` for ``t < warmup_steps`` (0 at the
      first step), then the cosine above over the remaining ``total_steps - warmup_steps``
      steps down to ``min_lr``. torch has no scheduler with this exact form
      (``LinearLR`` refuses ``start_factor=0`` and is evaluated recursively), so the torch
      counterpart is ``LambdaLR(opt, torch_lr_lambda("warmup_cosine", ...))``.

    torch's chainable schedulers update ``lr`` recursively (``lr *= ratio``); this is the
    closed form. They agree to <= 1e-12 relative at every step, except in the last ~1% of a
    long cosine, where ``1 + cos(pi t / T)`` cancels and *any* evaluation (torch's own closed
    and recursive forms included) is only good to a few ulp of ``base_lr`` in absolute terms.
    """
    a = _schedule_args(name, base_lr, total_steps, warmup_steps, milestones, gamma, min_lr)
    base_lr = a["base_lr"]
    if name == "constant":
        return optax.constant_schedule(base_lr)
    if name == "multistep":
        # {milestone: gamma**repeats}: a dict cannot hold torch's repeated milestones.
        counts = collections.Counter(a["milestones"])
        return optax.piecewise_constant_schedule(
            base_lr, {m: a["gamma"] ** k for m, k in counts.items()})
    w, total = a["warmup_steps"], a["total_steps"]
    cosine = optax.cosine_decay_schedule(base_lr, total - w,
                                         alpha=_cosine_alpha(base_lr, a["min_lr"]))
    if w == 0:
        return cosine

    # Own warmup piece instead of optax.linear_schedule(0, base_lr, w): optax evaluates
    # (0 - base_lr) * (1 - t/w) + base_lr, which cancels catastrophically for small t
    # (relative error grows like w * ulp). base_lr * (t / w) is also exactly what torch's
    # LambdaLR computes with torch_lr_lambda (base_lr * lambda(t)).
    def warmup(count):
        # float(w): int32 count / int w is a float32 division in JAX even under x64;
        # int32 / python float takes the default float dtype (float64 with x64).
        return base_lr * (count / float(w))

    # join_schedules hands the cosine piece (t - w), i.e. optax.warmup_cosine_decay_schedule
    # with our warmup piece.
    return optax.join_schedules([warmup, cosine], [w])


def torch_lr_lambda(name: str, base_lr: float, total_steps: int, *, warmup_steps: int = 0,
                    milestones: Sequence[int] = (), gamma: float = 0.1,
                    min_lr: float = 0.0) -> Callable[[int], float]:
    """The multiplier ``f`` with ``base_lr * f(t) == make_schedule(...)(t)``, in pure python.

    For torch_ref: ``LambdaLR(optimizer, torch_lr_lambda(...))`` (with the optimizer's lr set
    to ``base_lr``) yields the same lr as jaxdp at every step, for every schedule. The
    expressions follow optax's evaluation order so the two sides agree to an ulp.
    """
    a = _schedule_args(name, base_lr, total_steps, warmup_steps, milestones, gamma, min_lr)
    if name == "constant":
        return lambda t: 1.0
    if name == "multistep":
        ms, g = a["milestones"], a["gamma"]
        return lambda t: g ** bisect.bisect_right(ms, t)
    w, total = a["warmup_steps"], a["total_steps"]
    alpha = _cosine_alpha(a["base_lr"], a["min_lr"])
    decay = total - w

    def f(t):
        if t < w:
            return t / w
        c = min(float(t - w), float(decay))
        # optax.cosine_decay_schedule: (1 - alpha) * 0.5 * (1 + cos(pi * c / T)) + alpha
        return (1 - alpha) * (0.5 * (1 + math.cos(math.pi * c / decay))) + alpha

    return f


# ----------------------------------------------------------------------------------------
# Optimizers
# ----------------------------------------------------------------------------------------

def make_optimizer(name: str, learning_rate: float | optax.Schedule, *, momentum: float = 0.9,
                   nesterov: bool = False, dampening: float = 0.0, weight_decay: float = 0.0,
                   betas: tuple[float, float] = (0.9, 0.999),
                   eps: float = 1e-8, clip_grad_norm: float | None = None) -> optax.GradientTransformation:
    """The optax chain equal to ``torch.optim.{SGD, Adam, AdamW}`` with the same options.

    ``clip_grad_norm``: first ``torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)`` on the
    gradients (``jaxdp.clip_by_global_norm``: the global norm under every strategy).

    ``learning_rate`` is a float or a schedule (``make_schedule``), evaluated at the update
    count. ``momentum``/``nesterov``/``dampening`` apply to sgd, ``betas``/``eps`` to
    adam/adamw. Refused (ConfigError): unknown names; negative lr, weight_decay, momentum or
    eps; nesterov without momentum (torch refuses it too); dampening != 0 (torch's
    ``buf = mu*buf + (1-dampening)*g`` has no optax transform); betas outside [0, 1);
    nesterov for adam/adamw (torch's Adam has none; optax's nesterov Adam is NAdam).
    amsgrad is not supported, so there is no argument for it.
    """
    _choice("optimizer", name, OPTIMIZERS)
    if clip_grad_norm is not None:
        if not _nonneg("clip_grad_norm", clip_grad_norm) > 0:
            raise ConfigError(f"clip_grad_norm must be > 0, got {clip_grad_norm!r}")
        return optax.chain(clip_by_global_norm(float(clip_grad_norm)),
                           make_optimizer(name, learning_rate, momentum=momentum, nesterov=nesterov,
                                          dampening=dampening, weight_decay=weight_decay, betas=betas, eps=eps))
    if callable(learning_rate):
        lr = learning_rate
    else:
        lr = _nonneg("learning_rate", learning_rate)
    wd = _nonneg("weight_decay", weight_decay)
    if _nonneg("dampening", dampening) != 0.0:
        raise ConfigError(
            f"dampening={dampening!r} is not supported: torch's (1 - dampening) momentum "
            "has no optax equivalent; use dampening=0")

    if name == "sgd":
        mu = _nonneg("momentum", momentum)
        if nesterov and mu == 0.0:
            raise ConfigError("nesterov=True requires momentum > 0 (torch.optim.SGD refuses it too)")
        # optax.trace starts from zeros: buf = g + mu*0 = g on the first step, which is
        # exactly torch's "buf = clone(g)". momentum=None skips the trace, as torch keeps
        # no momentum_buffer when momentum == 0.
        return optax.chain(
            optax.add_decayed_weights(wd),  # torch: d_p = g + wd * p, before the momentum
            optax.sgd(lr, momentum=mu or None, nesterov=bool(nesterov)),
        )

    if nesterov:
        raise ConfigError(f"nesterov=True applies to sgd only; {name} has no nesterov in torch")
    try:
        b1, b2 = (float(b) for b in betas)
    except (TypeError, ValueError):
        raise ConfigError(f"betas must be two numbers in [0, 1), got {betas!r}") from None
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ConfigError(f"betas must be two numbers in [0, 1), got {betas!r}")
    eps = _nonneg("eps", eps)
    if name == "adam":
        # torch.optim.Adam's weight_decay is coupled L2: grad += wd * p before the moments.
        # optax.adam = scale_by_adam (bias-corrected, m_hat / (sqrt(v_hat) + eps), eps
        # outside the sqrt as in torch) then -lr.
        return optax.chain(optax.add_decayed_weights(wd),
                           optax.adam(lr, b1=b1, b2=b2, eps=eps))
    # AdamW: torch does p *= 1 - lr*wd, then p -= lr * adam_update; optax.adamw adds wd*p to
    # the adam update before scaling by -lr: the same p - lr*wd*p - lr*adam_update.
    # weight_decay is always passed: optax's default (1e-4) is not torch's (1e-2).
    return optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd)
