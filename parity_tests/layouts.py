"""``jaxdp parity --mesh``: which parity runs on which mesh layout.

- ``data=N`` (alone): the ordinary parity run on N devices (``runner.run_parity``);
- ``data=N,model=M``: data x tensor parallelism against its torch twin
  (``parity_tests.model_parallel``): a ViT (torch's ``parallelize_module``) or a ResNet
  (channel-parallel by hand), ddp or zero3 on the data axis, float64;
- ``data=N,stage=S``: data x pipeline parallelism against torch's ``ScheduleGPipe`` twin
  (``parity_tests.pipeline_parallel``): a ViT, ddp on the data axis, ``--microbatches`` M, float64;
- ``replica``: HSDP's axis, reached with ``--strategy hsdp --mesh-shape R,S``.

Jax- and torch-free at import.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from jaxdp import names, registry
from parity_tests import pairs
from parity_tests.config import ParityConfig, ParityError

LAYOUTS = ("data=N; data=N,model=M with a ViT or ResNet (ddp, zero3; float64); data=N,stage=S with a ViT "
           "(ddp; float64)")


def layout_of(sizes: dict, microbatches: Optional[int] = None) -> str:
    """"data", "data x model" or "data x stage" (a pipeline): the runner a mesh needs."""
    if sizes.get("stage", 1) > 1:
        if sizes.get("model", 1) > 1:
            raise ParityError("pipeline stages do not combine with a model axis yet; parity's meshes are " + LAYOUTS)
        return "data x stage"
    if microbatches is not None:
        raise ParityError("--microbatches are pipeline micro-batches: give --mesh a stage axis")
    if sizes.get("replica", 1) > 1:
        raise ParityError("parity's meshes are " + LAYOUTS + "; HSDP's replica axis: --strategy hsdp "
                          "--mesh-shape R,S")
    return "data x model" if sizes.get("model", 1) > 1 else "data"


def _float64_sgd_or_adamw(cfg: ParityConfig, what: str) -> None:
    if cfg.dtype != "float64" or cfg.optimizer not in ("sgd", "adamw"):
        raise ParityError(f"{what} parity runs in float64 with sgd (momentum 0.9) or adamw")


def _optimizer(cfg: ParityConfig) -> dict:
    """The optimizer of a mesh parity: the named one at the given lr, with torch.optim's default weight decay
    (AdamW's 1e-2)."""
    return dict(optimizer=cfg.optimizer, lr=cfg.lr, weight_decay=names.optimizer(cfg.optimizer).torch_weight_decay)


def _vit(cfg: ParityConfig, what: str) -> dict:
    """The named ViT with the sizes given on the command line, or one line saying it is not a ViT."""
    if cfg.model not in names.VIT.models:
        raise ParityError(f"{what}, not {cfg.model}; parity's meshes are {LAYOUTS}")
    return {**names.VIT.models[cfg.model], "num_classes": 10, "image_size": cfg.image_size,
            **{k: getattr(cfg, k) for k in cfg.VIT_OPTIONS if getattr(cfg, k) is not None}}


def _beside_a_split(twin_fits) -> list:
    """The paired strategies (``pairs.PAIRS``) whose jaxdp engine runs beside a model or stage axis
    (``model_parallel``) and whose torch twin's name passes ``twin_fits``."""
    rows = [registry.row(n) for n in pairs.PAIRS]
    return [r.name for r in rows if r.engine_class().model_parallel and twin_fits(r.torch_twin)]


def tp_config(cfg: ParityConfig, sizes: dict):
    """``model_parallel.TPConfig`` for this run: the named ViT or ResNet with the given sizes, or one line
    saying why not."""
    from parity_tests import model_parallel as mp

    from torch_ref.strategies import twin

    runs = _beside_a_split(lambda t: twin(t).on_mesh is not None)  # the twin has a form on a 2-D mesh's dp dim
    if cfg.strategy not in runs:
        raise ParityError(f"tensor-parallel parity runs {' or '.join(runs)} on the data axis, not {cfg.strategy}")
    _float64_sgd_or_adamw(cfg, "tensor-parallel")
    common = dict(strategy=cfg.strategy, data=sizes.get("data", 1), model=sizes["model"], steps=cfg.steps,
                  batch_per_rank=cfg.batch_per_device, seed=cfg.seed, **_optimizer(cfg))
    if cfg.model in names.RESNET.models:  # channel-parallel against the hand-written twin
        resnet = dict(name=cfg.model, num_classes=10, width=cfg.width, blocks=tuple(cfg.blocks or (1, 1, 1, 1)))
        return mp.TPConfig(family="resnet", resnet=resnet, **common)
    return mp.TPConfig(vit=_vit(cfg, "parity on a model axis runs a ViT or a ResNet"), **common)


def pp_config(cfg: ParityConfig, sizes: dict):
    """``pipeline_parallel.PPConfig`` for this run, one line if it cannot be."""
    from parity_tests import pipeline_parallel as pp

    from torch_ref.pipeline import DATA_PARALLEL

    runs = _beside_a_split(lambda t: t == DATA_PARALLEL)  # the twin whose average torch's pipeline writes out
    if cfg.strategy not in runs:
        raise ParityError(f"pipeline parity runs {' or '.join(runs)} on the data axis (torch's twin averages the "
                          f"stages' grads over dp), not {cfg.strategy}")
    _float64_sgd_or_adamw(cfg, "pipeline")
    return pp.PPConfig(data=sizes.get("data", 1), stage=sizes["stage"], microbatches=cfg.microbatches or sizes["stage"],
                       steps=cfg.steps, batch_per_rank=cfg.batch_per_device, seed=cfg.seed, **_optimizer(cfg),
                       vit=_vit(cfg, "parity on a stage axis runs a ViT (or the toy, in its tests)"))


def run_tensor_parallel(cfg: ParityConfig, sizes: dict, out: str, bug: Optional[str]) -> int:
    """Data x model parity against torch; prints one line, writes ``out``/report.json; the exit status."""
    from parity_tests import model_parallel as mp

    _check_bug(bug, mp.BUGS, "a model axis")
    tp = tp_config(cfg, sizes)
    what = f"tensor-parallel parity ({cfg.strategy} data={tp.data} x model={tp.model}"
    return _report(what, cfg, sizes, tp.steps, out, bug, mp.run(tp, bug=bug))


def run_pipeline(cfg: ParityConfig, sizes: dict, out: str, bug: Optional[str]) -> int:
    """Data x stage parity against torch's GPipe twin; prints one line, writes ``out``/report.json."""
    from parity_tests import pipeline_parallel as pp

    _check_bug(bug, pp.BUGS, "a stage axis")
    run = pp_config(cfg, sizes)
    what = f"pipeline parity (ddp data={run.data} x stage={run.stage}, {run.microbatches} micro-batches"
    return _report(what, cfg, sizes, run.steps, out, bug, pp.run(run, bug=bug))


def _check_bug(bug: Optional[str], bugs: dict, where: str) -> None:
    if bug is not None and bug not in bugs:
        raise ParityError(f"on {where} the injectable bugs are {', '.join(bugs)}, not {bug}")


def _report(what: str, cfg: ParityConfig, sizes: dict, steps: int, out: str, bug: Optional[str], comparison) -> int:
    message = "parity OK" if comparison.passed else comparison.divergence.message()
    print(f"{what}, {cfg.model_summary()}, {steps} steps): {message}")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "report.json")
    with open(path, "w") as f:
        json.dump({"config": cfg.to_json(), "mesh": sizes, "injected_bug": bug, "passed": comparison.passed,
                   "message": message, "comparison": comparison.to_json()}, f, indent=1, default=str)
    print(f"wrote {path}")
    if bug is not None:
        return 3 if comparison.passed else 1  # a bug the harness missed: 3, as run_parity's
    return 0 if comparison.passed else 1


RUNNERS = {"data x model": run_tensor_parallel, "data x stage": run_pipeline}
