"""One training step at a time, with everything a parity check compares.

Inside an initialised process group (``torch_ref.launcher.run_steps`` makes one)::

    runner = build(config, init_state_dict)      # every rank, same arguments
    out = runner.step(images_nhwc, labels)       # every rank, its own rows (collect=False:
                                                 # losses only, no gathers)
    # rank 0: {"loss", "loss_per_rank", "accuracy", "lr", "grads", "params",
    #          "buffers", "optimizer_state"}; other ranks: None

A model of the caller's own: ``build(config, sd, model=module, task=..., units=...)``, the task
saying what a batch is, what the loss is and which buffers are compared (``ClassifierTask``
is the built-in models'; ``parity_tests.own.torch_rank.PairTask`` a user's pair's; a task
with no accuracy leaves it out of the record).

``config`` keys (``DEFAULTS`` lists them with their defaults; unknown keys are refused): a
``jaxdp.config.step.StepConfig`` as a dict (the names ``jaxdp train`` and ``jaxdp parity``
use), plus torch_ref's own PowerSGD seeding and ``nn.DataParallel``'s GPU count:

- ``strategy``: dp | ddp | zero1 | zero2 | zero3 | hsdp
- model: ``model``, ``num_classes`` and its family's options (``torch_ref.models.create_model``):
  ``width``, ``blocks``, ``stem`` for a ResNet; ``depth``, ``dim``, ``heads``, ``mlp_dim``,
  ``patch``, ``image_size`` for a ViT (None: the named size); ``dtype``: float32 |
  float64 (``model.double()``) | bfloat16 (fp32 params, bf16 compute: FSDP2
  ``MixedPrecisionPolicy`` for zero2/zero3/hsdp, ``torch.autocast`` otherwise)
- optimizer: ``optimizer`` (sgd | adam | adamw), ``lr``, ``momentum``, ``nesterov``,
  ``weight_decay``, ``betas``, ``eps``, ``clip_grad_norm`` (``clip_grad_norm_`` before each
  ``optimizer.step()``); schedule: ``schedule``, ``total_steps``,
  ``warmup_steps``, ``milestones`` (in updates), ``gamma`` (``LambdaLR`` over
  ``jaxdp.optim.torch_lr_lambda``)
- ``accum_steps`` (micro-batches per update; DDP ``no_sync`` / FSDP2
  ``set_requires_gradient_sync(False)`` on all but the last), ``sync_bn`` (CUDA only)
- ddp/zero1: ``bucket_cap_mb``, ``compress`` (alias ``comm_hook``: None | bf16 | fp16 |
  powersgd), ``powersgd_rank``, ``powersgd_start_iter`` (default 1000, as torch and jaxdp;
  >= 2), ``powersgd_q`` ({param name:
  initial Q}, shapes from ``strategies.powersgd_shapes``), ``powersgd_seed``
- hsdp: ``mesh_shape`` (replicas, shards); dp: ``devices`` (GPUs for nn.DataParallel)
- ``allreduce``, ``staleness``: jaxdp's own; no torch strategy takes them (defaults only)
- speed, for ``jaxdp bench`` only (parity keeps the defaults, its deterministic settings):
  ``tuned`` (on CUDA: the model and its inputs in ``channels_last``, and
  ``cudnn.benchmark``, which times cuDNN's kernels and keeps the fastest; nothing on a
  CPU) and ``compile`` (a ``torch.compile`` backend for the wrapped model: "inductor", or
  "aot_eager" / "eager" to test the path cheaply; None: eager)

What is returned, all numpy, by torch name:

- ``grads``: the averaged gradient, before any clipping: ``.grad`` after DDP's
  all-reduce; for FSDP2 the reduce-scattered shards gathered with ``full_tensor()``. With
  accumulation it is the sum over micro-batches of grad(loss / K), averaged over ranks.
- ``params``: full params after the step; ``buffers``: rank 0's BN running mean/var.
- ``optimizer_state``: {name: {"momentum_buffer"} or {"exp_avg", "exp_avg_sq", "step"}},
  consolidated (ZeroRedundancyOptimizer) or gathered (FSDP2 DTensors).
- ``comm_state`` (PowerSGD only): {name: {"error": every rank's error feedback, stacked
  (world, *param shape), "q": the warm-start Q (m, r), compressed params only}}, read from
  the hook's per-bucket state (``torch_ref.powersgd.Hook.named_state``).
- ``loss``: mean over ranks of each rank's loss (itself the mean over its micro-batches);
  ``loss_per_rank``; ``accuracy`` over the global batch; ``lr`` used by this step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Optional

import numpy as np
import torch
import torch.nn.functional as F

from jaxdp.config.step import ModelOptions, StepConfig
from torch_ref import dist as tdist
from torch_ref import strategies
from torch_ref.models import create_model
from torch_ref.strategies import StrategyError

# torch_ref's own keys: PowerSGD's shared initial Q and seed, nn.DataParallel's GPU count.
_TORCH_OWN = {"powersgd_q": None, "powersgd_seed": 0, "devices": None}
# The bench's speed settings (see the module docstring); no strategy option.
_SPEED = {"tuned": False, "compile": None}
DEFAULTS: Dict[str, Any] = {**dataclasses.asdict(StepConfig()), **_TORCH_OWN, **_SPEED}
ALIASES = {"comm_hook": "compress"}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.float32}

_MODEL_KEYS = ModelOptions.RESNET_OPTIONS + ModelOptions.VIT_OPTIONS + ("image_size",)

# config key -> the wrap() option it feeds, for the strategies that take it (no torch strategy
# takes jaxdp's allreduce or staleness: only their defaults pass).
_STRATEGY_KEYS = StepConfig.STRATEGY_OPTIONS + tuple(_TORCH_OWN)


def resolve_config(config: Mapping[str, Any]) -> Dict[str, Any]:
    """``config`` over ``DEFAULTS``; unknown keys and options the strategy ignores are errors."""
    cfg = dict(DEFAULTS)
    for key, value in config.items():
        key = ALIASES.get(key, key)
        if key not in DEFAULTS:
            raise StrategyError(f"unknown config key {key!r}; known: {', '.join(sorted(DEFAULTS))}")
        cfg[key] = value
    if cfg["dtype"] not in DTYPES:
        raise StrategyError(f"dtype must be one of {', '.join(DTYPES)}, got {cfg['dtype']!r}")
    if int(cfg["accum_steps"]) < 1:
        raise StrategyError(f"accum_steps must be >= 1, got {cfg['accum_steps']}")
    return cfg


def strategy_options(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    """The strategy's own options; a non-default value for one it does not take is an error."""
    accepted = strategies.twin(cfg["strategy"]).options
    options = {}
    for key in _STRATEGY_KEYS:
        if key in accepted:
            options[key] = cfg[key]
        elif cfg[key] != DEFAULTS[key]:
            raise StrategyError(f"option {key!r} (--{key.replace('_', '-')}) does not apply to strategy {cfg['strategy']!r}")
    return options


def load_init_state(model: torch.nn.Module, state_dict: Mapping[str, Any]) -> None:
    """Copy a {torch name: array} state_dict into ``model`` (cast to its dtype).
    ``num_batches_tracked`` may be absent; any other missing or extra key is an error."""
    sd = {k: torch.as_tensor(np.asarray(v)) for k, v in state_dict.items()}
    result = model.load_state_dict(sd, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("num_batches_tracked")]
    if missing or result.unexpected_keys:
        raise StrategyError(f"init_state_dict does not match the model: missing {missing}, "
                            f"unexpected {list(result.unexpected_keys)}")


def to_torch_batch(images_nhwc: np.ndarray, labels: np.ndarray, device: torch.device,
                   dtype: torch.dtype, memory_format: torch.memory_format = torch.contiguous_format):
    """NHWC numpy (the shared pipeline's layout) -> NCHW tensor (contiguous, or
    ``channels_last``), int64 labels."""
    x = torch.from_numpy(np.ascontiguousarray(images_nhwc)).permute(0, 3, 1, 2)
    x = x.to(device=device, dtype=dtype).contiguous(memory_format=memory_format)
    y = torch.from_numpy(np.asarray(labels)).to(device=device, dtype=torch.int64)
    return x, y


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy().copy()


class ClassifierTask:
    """What a step computes on a batch, for the built-in image classifiers: batches
    ``(images NHWC numpy, labels)`` (``to_torch_batch``), torch's mean cross-entropy, accuracy,
    and BatchNorm's running stats as the compared buffers. ``Runner`` asks a task for these
    and nothing else, so a model pair of a user's own brings its own (``parity_tests.own``)."""

    def to_device(self, batch, device: torch.device, dtype: torch.dtype, memory_format: torch.memory_format):
        images_nhwc, labels = batch
        return to_torch_batch(images_nhwc, labels, device, dtype, memory_format)

    def rows(self, batch) -> int:
        return batch[0].shape[0]

    def split(self, batch, k: int):
        """``k`` micro-batches of consecutive rows (``torch.chunk``)."""
        x, y = batch
        return list(zip(x.chunk(k), y.chunk(k)))

    def loss(self, model, micro):
        """(the micro-batch's loss, its correct count or None)."""
        x, y = micro
        logits = model(x)
        return F.cross_entropy(logits, y), (logits.detach().argmax(-1) == y).sum()

    def compared_buffer(self, name: str) -> bool:
        return name.endswith(("running_mean", "running_var"))


CLASSIFIER = ClassifierTask()


class Runner:
    """A wrapped model, its optimizer and scheduler, stepped one global batch at a time.
    ``task``: what a batch is and what the loss is (``ClassifierTask``)."""

    def __init__(self, cfg: Dict[str, Any], parallel: strategies.Parallel, optimizer, scheduler, task=CLASSIFIER):
        self.config = cfg
        self.parallel = parallel
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.task = task
        self.dtype = DTYPES[cfg["dtype"]]
        self.memory_format = memory_format(cfg, parallel.device)
        self.steps = 0

    def forward_backward(self, *batch):
        """Forward/backward over ``accum_steps`` micro-batches, gradient sync on the last
        only. ``batch``: the task's, on the device (a classifier's ``x, y``). Returns (this rank's
        mean micro-batch loss, correct count or None, the lr the coming update uses). Leaves
        the averaged gradients in ``.grad``."""
        batch = batch[0] if len(batch) == 1 else batch
        k = self.config["accum_steps"]
        rows = self.task.rows(batch)
        if rows % k:
            raise StrategyError(f"per-rank batch {rows} is not divisible by {k} accumulation steps")
        par = self.parallel
        par.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=par.device)
        correct = None
        for i, micro in enumerate(self.task.split(batch, k)):
            with par.micro_step(sync=(i == k - 1)):
                loss, hits = self.task.loss(par.model, micro)
                (loss / k).backward()
            loss_sum += loss.detach().double()
            if hits is not None:
                correct = hits if correct is None else correct + hits
        lr = float(self.optimizer.param_groups[0]["lr"])
        return loss_sum / k, correct, lr

    def update(self) -> None:
        """The optimizer step with the averaged grads (first clipped to ``clip_grad_norm`` if
        set: on FSDP2's DTensor grads ``clip_grad_norm_`` takes the global norm), then one
        scheduler step."""
        if self.config["clip_grad_norm"] is not None:
            torch.nn.utils.clip_grad_norm_(self.parallel.module.parameters(), self.config["clip_grad_norm"])
        self.optimizer.step()
        self.scheduler.step()
        self.steps += 1

    def step(self, *host_batch, collect: bool = True) -> Optional[dict]:
        """One update on this rank's batch (the task's host batch: a classifier's
        ``images_nhwc, labels``); the comparison record on rank 0, None elsewhere.
        ``collect=False`` returns only the losses, accuracy and lr (no gathers)."""
        par = self.parallel
        batch = self.task.to_device(host_batch[0] if len(host_batch) == 1 else host_batch, par.device, self.dtype,
                                    self.memory_format)
        loss, correct, lr = self.forward_backward(batch)
        # Copied before the update: clip_grad_norm_ scales DDP's .grad in place.
        grads = {n: _numpy(g) for n, g in strategies.full_grads(par).items()} if collect else None
        self.update()
        per_rank = tdist.all_gather_floats([float(loss), float(correct or 0), self.task.rows(batch)])
        if collect:
            params = strategies.full_params(par)
            opt_state = strategies.full_optimizer_state(par, self.optimizer)
            comm_state = gathered_comm_state(par.comm_state)
        if tdist.rank() != 0:
            return None
        out = {
            "step": self.steps,
            "loss": float(per_rank[:, 0].mean()),
            "loss_per_rank": per_rank[:, 0].tolist(),
            "lr": lr,
        }
        if correct is not None:
            out["accuracy"] = float(per_rank[:, 1].sum() / per_rank[:, 2].sum())
        if collect:
            out["grads"] = grads
            out["params"] = {n: _numpy(p) for n, p in params.items()}
            out["buffers"] = {n: _numpy(b) for n, b in par.module.named_buffers() if self.task.compared_buffer(n)}
            out["optimizer_state"] = {n: {k: _numpy(v) for k, v in s.items()}
                                      for n, s in opt_state.items()}
            if comm_state is not None:
                out["comm_state"] = comm_state
        return out


def gathered_comm_state(hook) -> Optional[Dict[str, Dict[str, np.ndarray]]]:
    """A PowerSGD hook's state by param name, every rank's error stacked (one all-gather of
    all errors, flattened). None for no hook or a stateless one. Collective."""
    if not hasattr(hook, "named_state"):
        return None
    named = hook.named_state()
    flat = torch.cat([s["error"].reshape(-1) for s in named.values()])
    every = tdist.all_gather_tensor(flat)
    out, offset = {}, 0
    for name, s in named.items():
        numel = s["error"].numel()
        out[name] = {"error": _numpy(every[:, offset:offset + numel].reshape(-1, *s["error"].shape))}
        offset += numel
        if "q" in s:
            out[name]["q"] = _numpy(s["q"])
    return out


def memory_format(cfg: Mapping[str, Any], device: torch.device) -> torch.memory_format:
    """``channels_last`` for a tuned run on CUDA (cuDNN's fast NHWC kernels), else NCHW."""
    return torch.channels_last if cfg["tuned"] and device.type == "cuda" else torch.contiguous_format


def build(config: Mapping[str, Any], init_state_dict: Optional[Mapping[str, Any]] = None, *,
          model: Optional[torch.nn.Module] = None, task=CLASSIFIER, units=None) -> Runner:
    """A Runner for ``config`` (see the module docstring), starting from ``init_state_dict``
    ({torch name: numpy array}; None: torch's init under ``torch.manual_seed(seed)``).
    Call on every rank with the same arguments, inside an initialised process group.

    ``model``, ``task``, ``units``: a model of the caller's own (a CPU ``nn.Module``; the config's
    model keys are then not read), what its batches and loss are (``ClassifierTask``'s methods),
    and its FSDP2 units (``strategies.fsdp_blocks``; None: the model family's)."""
    cfg = resolve_config(config)
    options = strategy_options(cfg)
    device = tdist.device()
    torch.manual_seed(cfg["seed"])
    if model is None:
        try:
            model = create_model(cfg["model"], num_classes=cfg["num_classes"],
                                 **{k: cfg[k] for k in _MODEL_KEYS})
        except ValueError as e:  # unknown model or stem, bad width or blocks: say which
            raise StrategyError(str(e)) from None
    model = model.to(device=device, dtype=DTYPES[cfg["dtype"]], memory_format=memory_format(cfg, device))
    if init_state_dict is not None:
        load_init_state(model, init_state_dict)
    if cfg["tuned"] and device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # the bench's tuned torch only: parity never sets tuned
    parallel = strategies.wrap(cfg["strategy"], model, device=device, sync_bn=cfg["sync_bn"],
                               mixed_precision=cfg["dtype"] == "bfloat16", units=units,
                               **options)
    if cfg["compile"]:
        # The wrapped model (DDP's optimizer splits the graph at its buckets); optimizer eager.
        parallel.model = torch.compile(parallel.model, backend=cfg["compile"])
    optimizer = strategies.make_optimizer(
        parallel, cfg["optimizer"], cfg["lr"], momentum=cfg["momentum"], nesterov=cfg["nesterov"],
        weight_decay=cfg["weight_decay"], betas=cfg["betas"], eps=cfg["eps"])
    scheduler = strategies.make_scheduler(optimizer, cfg["schedule"], cfg["lr"], cfg["total_steps"],
                                          warmup_steps=cfg["warmup_steps"], milestones=cfg["milestones"],
                                          gamma=cfg["gamma"])
    return Runner(cfg, parallel, optimizer, scheduler, task)
