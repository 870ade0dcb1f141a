"""``jaxdp parity --mesh``: which parity runs on which mesh layout.

- ``data=N`` (alone): the ordinary parity run on N devices (``runner.run_parity``);
- ``data=N,model=M``: data x tensor parallelism against torch's ``parallelize_module`` twin
  (``parity_tests.model_parallel``): a ViT, ddp or zero3 on the data axis, float64;
- ``stage=S > 1``: the strategy is built on the mesh first, so its own one-line refusal is
  what the user sees while pipelining is not there; once a strategy accepts stages, add its
  torch twin as a runner here (``RUNNERS``) and this says so until then;
- ``replica``: HSDP's axis, reached with ``--strategy hsdp --mesh-shape R,S``.

Jax- and torch-free at import.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from parity_tests.config import ParityConfig, ParityError

LAYOUTS = "data=N, or data=N,model=M with a ViT (ddp, zero3; float64)"


def layout_of(sizes: dict) -> str:
    """"data", "data x model" or "stage" (a pipeline): the runner a mesh needs."""
    if sizes.get("stage", 1) > 1:
        return "stage"
    if sizes.get("replica", 1) > 1:
        raise ParityError("parity's meshes are " + LAYOUTS + "; HSDP's replica axis: --strategy hsdp "
                          "--mesh-shape R,S")
    return "data x model" if sizes.get("model", 1) > 1 else "data"


def tp_config(cfg: ParityConfig, sizes: dict):
    """``model_parallel.TPConfig`` for this run: the named ViT with the given sizes, one line if it cannot be."""
    from parity_tests import model_parallel as mp

    from jaxdp.models import family

    if family(cfg.model) != "vit":
        raise ParityError(f"parity on a model axis runs a ViT (torch's parallelize_module twin), not {cfg.model}; "
                          f"parity's meshes are {LAYOUTS}")
    if cfg.strategy not in ("ddp", "zero3"):
        raise ParityError(f"tensor-parallel parity runs ddp or zero3 on the data axis, not {cfg.strategy}")
    if cfg.dtype != "float64" or cfg.optimizer not in ("sgd", "adamw"):
        raise ParityError("tensor-parallel parity runs in float64 with sgd (momentum 0.9) or adamw")
    from jaxdp.models.vit import CONFIGS

    vit = {**CONFIGS[cfg.model], "num_classes": 10, "image_size": cfg.image_size,
           **{k: getattr(cfg, k) for k in cfg.VIT_OPTIONS if getattr(cfg, k) is not None}}
    return mp.TPConfig(strategy=cfg.strategy, data=sizes.get("data", 1), model=sizes["model"], steps=cfg.steps,
                       batch_per_rank=cfg.batch_per_device, optimizer=cfg.optimizer, lr=cfg.lr, seed=cfg.seed, vit=vit)


def refuse_stages(cfg: ParityConfig, sizes: dict) -> None:
    """The strategy's own refusal of a stage axis (StrategyError); if it accepts, that parity has no twin yet."""
    from jaxdp.mesh import make_mesh
    from jaxdp.models import create_model
    from jaxdp.optim import make_optimizer
    from jaxdp.strategies import create_strategy
    from jaxdp.task import classifier

    net = create_model(cfg.model, **cfg.model_options())
    create_strategy(cfg.strategy, net, classifier(net), make_optimizer("sgd", cfg.lr), make_mesh(**sizes))
    raise ParityError(f"{cfg.strategy} runs on stage={sizes['stage']}, but parity has no pipeline twin yet "
                      f"(add one to parity_tests.layouts); parity's meshes are {LAYOUTS}")


def run_tensor_parallel(cfg: ParityConfig, sizes: dict, out: str, bug: Optional[str]) -> int:
    """Data x model parity against torch; prints one line, writes ``out``/report.json; the exit status."""
    from parity_tests import model_parallel as mp

    if bug is not None and bug not in mp.BUGS:
        raise ParityError(f"on a model axis the injectable bug is {', '.join(mp.BUGS)}, not {bug}")
    tp = tp_config(cfg, sizes)
    comparison = mp.run(tp, bug=bug)
    what = f"{cfg.strategy} data={tp.data} x model={tp.model}, {cfg.model_summary()}, {tp.steps} steps"
    message = "parity OK" if comparison.passed else comparison.divergence.message()
    print(f"tensor-parallel parity ({what}): {message}")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "report.json")
    with open(path, "w") as f:
        json.dump({"config": cfg.to_json(), "mesh": sizes, "injected_bug": bug, "passed": comparison.passed,
                   "message": message, "comparison": comparison.to_json()}, f, indent=1, default=str)
    print(f"wrote {path}")
    if bug is not None:
        return 3 if comparison.passed else 1  # a bug the harness missed: 3, as run_parity's
    return 0 if comparison.passed else 1
