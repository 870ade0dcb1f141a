"""The model a user's loss receives on pipeline stages: ``apply`` runs the stages.

``jaxdp.classifier`` runs its loss per micro-batch on the last stage (``PipelinedClassifier``,
as torch's schedules do). A user's own loss is any function of the model's outputs (a
weighted mean, a sequence loss), so it gets a model whose ``apply(variables, x)`` runs the
GPipe schedule (``Pipeline.outputs``) over this device's batch and returns the outputs of
every row, the same on every stage; the loss then runs once on them. The batch keys are
the user's: ``x`` is whatever the loss passes to ``apply``.
"""

from jaxdp.loss.model_task import ModelTask
from jaxdp.parallel.pipeline import Pipeline, PipelineError, PipelinedClassifier, largest_divisor
from jaxdp.loss.task import Classifier

NEEDS_MODEL = ("pipeline stages run a model jaxdp cuts into stages, which this loss_fn cannot receive: write it "
               "as loss_fn(model, params, model_state, batch, rng) and apply that model (docs/strategies.md)")


class StagedModel:
    """``model`` cut into stages: ``apply({"params": stacked}, x)`` is ``model.apply`` on this
    device's rows, run stage by stage. ``exact``: the batch must split into the pipeline's
    micro-batches (training); otherwise (evaluation) it runs in as many as divide it."""

    def __init__(self, pipeline: Pipeline, model, exact: bool = True):
        self.pipeline, self.model, self.exact = pipeline, model, exact

    def apply(self, variables, *inputs, mutable=False, rngs=None, **_ignored):
        """The layers take one input and no keyword arguments (``pipeline_layers()``'s ``apply``)."""
        if len(inputs) != 1:
            raise PipelineError(f"on pipeline stages {type(self.model).__name__}.apply takes one input (its first "
                                f"layer's), got {len(inputs)}")
        if mutable or rngs:
            raise PipelineError("pipeline stages apply the model without mutable collections or rngs "
                                "(no BatchNorm statistics, no dropout)")
        x = inputs[0]
        size, m = x.shape[0], self.pipeline.microbatches
        micro = self.pipeline.microbatched(x, m if self.exact else largest_divisor(x.shape[0], m))
        out = self.pipeline.outputs(variables["params"], micro, lambda mb: mb)
        return out.reshape((size,) + out.shape[2:])

    def __getattr__(self, name):  # the user's loss may read the model's fields (vocab, dtype, ...)
        if name in ("pipeline", "model", "exact"):
            raise AttributeError(name)
        return getattr(self.model, name)


def bind(pipeline: Pipeline, task):
    """The (training, evaluation) tasks that run ``task`` on ``pipeline``'s stages."""
    if isinstance(task, Classifier):
        staged = PipelinedClassifier(pipeline, task)
        return staged, staged
    if not isinstance(task, ModelTask):
        raise PipelineError(NEEDS_MODEL)
    return (task.with_model(StagedModel(pipeline, task.model)),
            task.with_model(StagedModel(pipeline, task.model, exact=False)))
