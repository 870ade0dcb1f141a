"""Parity of data x pipeline parallelism: jaxdp on a ``data x stage`` mesh (GPipe,
``jaxdp/parallel/pipeline.py``) against its torch twin (``torch_ref.pipeline``:
``PipelineStage`` + ``ScheduleGPipe(scale_grads=True)`` on a 2-D ``DeviceMesh``, DDP over
its ``dp`` dim around each stage).

One run, as ``parity_tests.model_parallel``'s (whose jaxdp side it reuses): the model is
initialised in torch and converted; both sides cut it into the same stages (jaxdp's
``stage_bounds``), take the same per-data-rank batches, each cut into the same M micro-batches,
for ``steps`` steps; every step's loss, each data rank's loss, every averaged gradient and
every parameter after the update are compared in the canonical layout, float64 bounds (rel
<= 1e-10). Two models (``PPConfig.family``, rows of ``parity_tests.mp_families``): a small ViT,
and the DDP tutorial's ToyMpModel.

Injected bugs (``BUGS``), each a jaxdp-side mistake torch's schedule cannot make, so each is
caught against torch: the micro-batch losses summed without the 1/M scale (torch's
``scale_grads=False`` with a mean loss: loss and grads M times too large), and activations
sent to the wrong stage (s -> s + 2 mod S: with S = 2 each stage feeds itself). The same
bugs are what tests/test_pipeline.py injects against one device: this module is their one home.

Nothing imports jax or torch at module level (``--devices`` must reach XLA first).
"""

import contextlib
from dataclasses import dataclass
from typing import List, Optional

from parity_tests import model_parallel as mp

BUGS = {
    "loss_scale": "micro-batch losses summed without the 1/M scale (torch's scale_grads=False)",
    "stage_order": "activations sent two stages on (s -> s + 2 mod S) instead of to the next stage",
}


@dataclass
class PPConfig(mp.TPConfig):
    model: int = 1               # no model axis: the stages are the model parallelism here
    stage: int = 2
    microbatches: int = 4

    @property
    def torch_config(self):
        from jaxdp.parallel.pipeline import stage_bounds
        from torch_ref.pipeline import pipeline_layer_count

        config = super().torch_config
        return {**config, "pp": self.stage, "microbatches": self.microbatches,
                "bounds": stage_bounds(pipeline_layer_count(self.family, config["model"]), self.stage)}

    @property
    def mesh_axes(self) -> dict:
        return {"data": self.data, "stage": self.stage}


def injected(bug: Optional[str]):
    """A context in which jaxdp's pipeline has ``bug`` (``mock.patch`` puts the right code back)."""
    if bug is None:
        return contextlib.nullcontext()
    if bug not in BUGS:
        raise ValueError(f"unknown pipeline bug {bug!r}; choose one of {', '.join(BUGS)}")
    from unittest import mock

    from jaxdp.parallel import pipeline

    if bug == "loss_scale":
        return mock.patch.object(pipeline.PipelinedClassifier, "loss_scale", lambda self: 1.0)
    return mock.patch.object(pipeline.Pipeline, "forward_pairs",
                             lambda self: [(i, (i + 2) % self.size) for i in range(self.size)])


init_state_dict, make_batches = mp.init_state_dict, mp.make_batches  # the family's row says what differs


def run_jax(cfg: PPConfig, state_dict, batches, bug: Optional[str] = None) -> List[dict]:
    with injected(bug):
        return mp.run_jax(cfg, state_dict, batches, mesh_axes=cfg.mesh_axes,
                          options={"microbatches": cfg.microbatches})


def run_torch(cfg: PPConfig, state_dict, batches) -> List[dict]:
    from torch_ref.pipeline import run_pipeline_steps

    return run_pipeline_steps(cfg.torch_config, state_dict, batches)


def run(cfg: PPConfig, bug: Optional[str] = None, want: Optional[List[dict]] = None):
    """Compare jaxdp on ``data x stage`` with its torch twin (``want``: torch's records, when
    already run for this config). Returns ``compare.Comparison``."""
    from parity_tests import compare

    state_dict, batches = init_state_dict(cfg), make_batches(cfg)
    want = run_torch(cfg, state_dict, batches) if want is None else want
    return compare.compare_runs(run_jax(cfg, state_dict, batches, bug=bug), want, compare.FLOAT64)
