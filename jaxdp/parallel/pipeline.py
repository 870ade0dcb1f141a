"""Pipeline stages on the ``stage`` axis: the GPipe schedule.

A model that declares its ordered layers (``model.pipeline_layers()``: a list of ``Layer``,
e.g. patch embedding, blocks 0..d-1, final norm + head; ``jaxdp/models/vit/pipeline.py``)
is cut into S contiguous runs of layers, one per stage. Each stage's device holds only its
own params: every stage's params are flattened into one vector, padded to the largest
stage's length L, and the S vectors stacked into one (S, L) array sharded over ``stage``
(so stages of different sizes fit: the stem on stage 0, the head on the last).

The step (GPipe, as ``torch.distributed.pipelining.ScheduleGPipe``): the device's batch is
cut into M micro-batches; a ``lax.scan`` over M + S - 1 ticks runs, at tick t, micro-batch
t - s on stage s (``lax.switch`` on the stage index picks the stage's layers), and sends
each stage's output to the next stage with one ``ppermute`` over ``stage``. The last stage
computes each micro-batch's loss, scaled by 1/M (torch's ``scale_grads=True``), so the sum is
the whole batch's mean loss. ``jax.grad`` through the scan runs the backward in reverse,
the ppermutes transposed (gradients flow from stage s+1 back to s), and each stage gets the
gradients of its own params only. The data-axis reduction is left to the strategy, so ddp
and zero1/zero2 run unchanged over ``data``.

Why a scan: an unrolled tick loop's compile time grows with M + S (measured: flat at about
0.5 s with the scan; docs/design-notes.md, "Model parallelism on CPU"). Its initial carry is
built with ``jnp.zeros`` and cast to varying, because the carry becomes per-device after the
first tick.

Activations of different shapes (images into stage 0, tokens between blocks, logits out of
the last) travel in one buffer per micro-batch, each example's activation flattened and
zero-padded to the widest boundary, because every stage runs the same program.

Layout. Checkpoints and parity comparisons keep the canonical params tree (``unstack``);
the strategy state holds ``{"stages": (S, L)}`` (``stack``).
"""

import math
from dataclasses import dataclass
from typing import Callable, List, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxdp.loss.task import Classifier, eval_sums, loss_and_accuracy
from jaxdp.runtime.mesh import MODEL_AXIS, STAGE_AXIS, axis_size
from jaxdp.parallel.tensor import Column, TensorParallel, path_name

STACKED = "stages"  # the state's one params leaf: {"stages": (S, L)}


class PipelineError(ValueError):
    """A model, task or batch that cannot run as pipeline stages as asked."""


@dataclass(frozen=True)
class Layer:
    """One step of a model's forward: the params subtrees it owns (paths into the params
    tree) and ``apply(subtrees, x) -> y`` (``subtrees`` in the order of ``paths``)."""

    name: str
    paths: Tuple[Tuple[str, ...], ...]
    apply: Callable


def stage_bounds(layers: int, stages: int) -> List[Tuple[int, int]]:
    """Contiguous runs of layers, as even in count as possible (the first stages take the extra)."""
    if layers < stages:
        raise PipelineError(f"a model of {layers} pipeline layers cannot fill {stages} stages")
    cuts = np.cumsum([0] + [layers // stages + (i < layers % stages) for i in range(stages)])
    return [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:])]


@dataclass(frozen=True)
class _Piece:
    """A params subtree inside a stage's vector: where it starts, its leaves' shapes, its structure."""

    offset: int
    shapes: Tuple[Tuple[int, ...], ...]
    treedef: object

    def take(self, flat):
        leaves, at = [], self.offset
        for shape in self.shapes:
            size = math.prod(shape)
            leaves.append(flat[at:at + size].reshape(shape))
            at += size
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def _subtree(tree, path):
    for key in path:
        if key not in tree:
            raise PipelineError(f"the pipeline plan names params/{'/'.join(path)}, which the model does not have")
        tree = tree[key]
    return tree


class Pipeline:
    """One model's layers cut into ``size`` stages, run on ``microbatches`` micro-batches."""

    def __init__(self, layers: Sequence[Layer], size: int, microbatches: int, axis: str = STAGE_AXIS,
                 batch_axes: Tuple[str, ...] = ()):
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise PipelineError(f"microbatches must be a positive integer, got {microbatches!r}")
        self.layers, self.size, self.microbatches, self.axis = list(layers), size, microbatches, axis
        # What the schedule's carry varies over: the stage, and the batch axes (the strategy
        # splits the batch and casts the params to per-device over them).
        self.varying = (axis,) + tuple(a for a in batch_axes if a != axis)
        self.stages = [self.layers[a:b] for a, b in stage_bounds(len(self.layers), size)]
        # The state's (S, L) array, cut along its first dim over ``stage``: the placement
        # machinery tensor parallelism uses (jaxdp.strategies.placement) places it.
        self.split = TensorParallel({f"params/{STACKED}": Column(dim=0)}, size, axis)
        self.shapes = None  # the canonical params' shapes, once learned

    # -- canonical params tree <-> the stacked (S, L) state ----------------------------------------
    def learn(self, shapes) -> None:
        """Where each canonical leaf sits in its stage's vector (from shapes only)."""
        leaves, self._treedef = jax.tree_util.tree_flatten_with_path(shapes)
        index = {path_name(p): i for i, (p, _) in enumerate(leaves)}
        dtypes = {np.dtype(s.dtype) for _, s in leaves}
        if len(dtypes) > 1:
            raise PipelineError(f"pipeline stages flatten the params into one vector, which needs one dtype; "
                                f"the model has {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()
        self.where = [None] * len(leaves)  # canonical leaf -> (stage, offset, shape)
        self.pieces, lengths = [], []
        for s, stage in enumerate(self.stages):
            at, pieces = 0, []
            for layer in stage:
                owned = []
                for path in layer.paths:
                    sub = _subtree(shapes, path)
                    sub_leaves, treedef = jax.tree_util.tree_flatten_with_path(sub)
                    owned.append(_Piece(at, tuple(tuple(x.shape) for _, x in sub_leaves), treedef))
                    for p, x in sub_leaves:
                        i = index["/".join(path + (path_name(p),)).rstrip("/")]
                        if self.where[i] is not None:
                            raise PipelineError(f"the pipeline plan gives params/{path_name(leaves[i][0])} "
                                                "to two layers")
                        self.where[i] = (s, at, tuple(x.shape))
                        at += math.prod(x.shape)
                pieces.append(tuple(owned))
            self.pieces.append(pieces)
            lengths.append(at)
        missing = [path_name(p) for (p, _), w in zip(leaves, self.where) if w is None]
        if missing:
            raise PipelineError(f"the pipeline plan gives no layer the params {', '.join(missing[:6])}")
        self.length = max(lengths)
        self.shapes = shapes

    def stack(self, params):
        """Canonical params tree -> ``{"stages": (S, L)}``: each stage's leaves in its layers' order."""
        if self.shapes is None:
            self.learn(jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params))
        leaves = jax.tree_util.tree_leaves(params)
        rows = [[] for _ in range(self.size)]
        for i in sorted(range(len(leaves)), key=lambda i: self.where[i][:2]):
            rows[self.where[i][0]].append(jnp.ravel(leaves[i]))
        padded = [jnp.pad(jnp.concatenate(r), (0, self.length - sum(x.size for x in r))) for r in rows]
        return {STACKED: jnp.stack(padded)}

    def unstack(self, stacked):
        """``{"stages": (S, L)}`` -> the canonical params tree (the inverse of ``stack``)."""
        x = stacked[STACKED]
        leaves = [x[s, at:at + math.prod(shape)].reshape(shape) for s, at, shape in self.where]
        return jax.tree_util.tree_unflatten(self._treedef, leaves)

    def stacked_shapes(self):
        return {STACKED: jax.ShapeDtypeStruct((self.size, self.length), self.dtype)}

    # -- the schedule (inside shard_map) -----------------------------------------------------------
    def _stage_fn(self, s: int, boundaries, width: int, dtype):
        """Stage ``s``'s layers: (its params vector, stage 0's input, the received buffer) -> buffer."""
        def run(flat, first_input, received):
            x = first_input if s == 0 else received[:, :math.prod(boundaries[s].shape[1:])].reshape(
                boundaries[s].shape).astype(boundaries[s].dtype)
            for layer, pieces in zip(self.stages[s], self.pieces[s]):
                x = layer.apply(tuple(piece.take(flat) for piece in pieces), x)
            out = x.reshape(x.shape[0], -1).astype(dtype)
            return jnp.pad(out, ((0, 0), (0, width - out.shape[1])))
        return run

    def _boundaries(self, first_input):
        """The activation entering each stage and leaving the last (shapes only)."""
        shapes = [first_input]
        x = first_input
        for s, stage in enumerate(self.stages):
            for layer, pieces in zip(stage, self.pieces[s]):
                subtrees = tuple(jax.tree_util.tree_unflatten(
                    p.treedef, [jax.ShapeDtypeStruct(sh, self.dtype) for sh in p.shapes]) for p in pieces)
                x = jax.eval_shape(layer.apply, subtrees, x)
            shapes.append(x)
        return shapes

    def _schedule(self, stacked, micro, first_input):
        """What ``run`` and ``outputs`` share: this device's stage, the micro-batch picker,
        one tick's forward (``forward(received, t) -> buffer``), the buffer unpacked into the
        last stage's output, and the scan's initial carry."""
        m_count = jax.tree_util.tree_leaves(micro)[0].shape[0]
        flat = stacked[STACKED].reshape(-1)  # this stage's row
        stage = jax.lax.axis_index(self.axis)
        pick = lambda i: jax.tree_util.tree_map(lambda x: x[jnp.clip(i, 0, m_count - 1)], micro)  # noqa: E731
        x0 = jax.eval_shape(lambda: first_input(pick(0)))
        boundaries = self._boundaries(x0)
        out_shape = boundaries[-1]
        width, dtype = self._buffer(boundaries)
        branches = [self._stage_fn(s, boundaries, width, dtype) for s in range(self.size)]

        def forward(received, t):  # stage 0 takes micro-batch t (ticks past M feed it a repeat: unused)
            return jax.lax.switch(stage, branches, flat, first_input(pick(t)), received)

        def unpacked(out):
            return out[..., :math.prod(out_shape.shape[1:])].reshape(out.shape[:-2] + out_shape.shape) \
                .astype(out_shape.dtype)

        start = self.cast(jnp.zeros((x0.shape[0], width), dtype))
        return stage, m_count, pick, forward, unpacked, out_shape, start

    def cast(self, x):
        """The schedule's carry varies per device from the first tick on (docs/design-notes.md, "Model parallelism on CPU")."""
        return jax.lax.pcast(x, self.varying, to="varying")

    def run(self, stacked, micro, first_input, per_microbatch):
        """The GPipe schedule over this device's micro-batches.

        ``micro``: the batch as (M, micro-batch, ...) leaves; ``first_input(mb) -> x`` is what
        stage 0 takes from micro-batch ``mb``; ``per_microbatch(output, mb) -> {name: scalar}``
        runs on the last stage's output. Returns the sums over micro-batches of
        ``per_microbatch``, the same on every stage (summed over ``stage`` from the last one).
        """
        stage, m_count, pick, forward, unpacked, out_shape, start = self._schedule(stacked, micro, first_input)
        s_count = self.size
        sums_shape = jax.eval_shape(lambda: per_microbatch(jnp.zeros(out_shape.shape, out_shape.dtype), pick(0)))

        def tick(carry, t):
            received, sums = carry
            out = forward(received, t)
            m = t - (s_count - 1)  # the micro-batch leaving the last stage now
            done = (stage == s_count - 1) & (m >= 0)
            result = per_microbatch(unpacked(out), pick(m))
            sums = jax.tree_util.tree_map(lambda a, r: a + jnp.where(done, r, jnp.zeros_like(r)), sums, result)
            return (jax.lax.ppermute(out, self.axis, self.forward_pairs()), sums), None

        start = (start, jax.tree_util.tree_map(lambda r: self.cast(jnp.zeros(r.shape, r.dtype)), sums_shape))
        (_, sums), _ = jax.lax.scan(tick, start, jnp.arange(m_count + s_count - 1))
        return jax.lax.psum(sums, self.axis)

    def outputs(self, stacked, micro, first_input):
        """The last stage's output for every micro-batch, (M, micro-batch, ...), on every stage.

        For a loss that is not a sum over micro-batches (the user's own loss, applied to the
        whole device batch's outputs): one all-reduce over ``stage`` of the outputs, which
        only the last stage holds. Its transpose is the identity, so each stage's backward
        starts from the same output gradient.
        """
        stage, m_count, _, forward, unpacked, _, start = self._schedule(stacked, micro, first_input)

        def tick(received, t):
            out = forward(received, t)
            return jax.lax.ppermute(out, self.axis, self.forward_pairs()), out

        _, outs = jax.lax.scan(tick, start, jnp.arange(m_count + self.size - 1))
        last = unpacked(outs[self.size - 1:])  # tick S-1+m: micro-batch m leaves the last stage
        return jax.lax.psum(jnp.where(stage == self.size - 1, last, jnp.zeros_like(last)), self.axis)

    @staticmethod
    def _buffer(boundaries):
        """Values per example and dtype of the buffer every stage sends: the widest boundary's."""
        return (max(math.prod(b.shape[1:]) for b in boundaries[1:]),
                jnp.result_type(*[b.dtype for b in boundaries[1:]]))

    def buffer(self, first_input):
        """``_buffer`` for stage 0's input (a ShapeDtypeStruct of one micro-batch), for the
        accounting (``jaxdp.analysis.axes.pipeline_accounting``)."""
        return self._buffer(self._boundaries(first_input))

    def forward_pairs(self):
        """Where each stage's output goes: stage s -> s + 1 (the last stage's output goes nowhere)."""
        return [(i, i + 1) for i in range(self.size - 1)]

    def microbatched(self, batch, microbatches: int):
        """(B, ...) leaves -> (M, B/M, ...), or one line saying why not."""
        size = jax.tree_util.tree_leaves(batch)[0].shape[0]
        if size % microbatches:
            raise PipelineError(f"per-device batch {size} does not split into {microbatches} pipeline "
                                "micro-batches (--microbatches)")
        return jax.tree_util.tree_map(lambda x: x.reshape(microbatches, size // microbatches, *x.shape[1:]), batch)


def largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def for_mesh(model, mesh, microbatches=None, batch_axes=()):
    """``model``'s pipeline on ``mesh``: None without a ``stage`` axis of size > 1. The model takes
    one (its ``pipeline_layers()``): ``jaxdp.parallel.supports`` checked it."""
    size = axis_size(mesh, STAGE_AXIS)
    if size == 1:
        return None
    if axis_size(mesh, MODEL_AXIS) > 1:
        raise PipelineError("pipeline stages do not combine with a model axis (tensor parallelism) yet: "
                            "use --mesh data=...,stage=...")
    return Pipeline(model.pipeline_layers(), size, size if microbatches is None else microbatches,
                    batch_axes=batch_axes)


# ----------------------------------------------------------------------------- the task on stages

class PipelinedClassifier:
    """A classifier's loss and evaluation (``jaxdp.loss.task.classifier``) run on pipeline stages, on
    the stacked params; the strategy trains it as it trains any task."""

    def __init__(self, pipeline: Pipeline, task):
        if not isinstance(task, Classifier):
            raise PipelineError("pipeline stages run a classifier's loss (jaxdp.classifier(model)); a custom "
                                "loss_fn cannot be cut into stages yet")
        self.pipeline, self.model_inputs, self.init_kwargs = pipeline, task.model_inputs, task.init_kwargs

    def loss_fn(self, params, model_state, batch, rng=None):
        m, scale = self.pipeline.microbatches, self.loss_scale()

        def scaled(logits, mb):  # each micro-batch's mean, scaled by 1/M: their sum is the batch's mean
            loss, accuracy = loss_and_accuracy(logits, mb["label"])
            return {"loss": loss * scale, "accuracy": accuracy * scale}
        sums = self.pipeline.run(params, self.pipeline.microbatched(batch, m), lambda mb: mb["image"], scaled)
        return sums["loss"], (model_state, {"accuracy": sums["accuracy"]})

    def loss_scale(self):
        """Each micro-batch's share of the loss (torch's ``scale_grads=True`` divides by M too)."""
        return 1.0 / self.pipeline.microbatches

    def eval_fn(self, params, model_state, batch):
        size = jax.tree_util.tree_leaves(batch)[0].shape[0]  # evaluation batches need not divide by M
        micro = self.pipeline.microbatched(batch, largest_divisor(size, self.pipeline.microbatches))
        return self.pipeline.run(params, micro, lambda mb: mb["image"], eval_sums)


class StackedInit:
    """``model.init`` whose params come out stacked for the stages (``Pipeline.stack``)."""

    def __init__(self, model, pipeline: Pipeline):
        self.model, self.pipeline = model, pipeline

    def init(self, rng, *args, **kwargs):
        variables = dict(self.model.init(rng, *args, **kwargs))
        variables["params"] = self.pipeline.stack(variables["params"])
        return variables


def relayout(state, tx, fn):
    """``fn`` (``Pipeline.stack`` or ``unstack``) on a train state's params and on every params-shaped
    part of its optimizer state (momentum, Adam's moments; step counts are left alone)."""
    return state.replace(params=fn(state.params), opt_state=optax.tree_utils.tree_map_params(
        tx, fn, state.opt_state, is_leaf=lambda _: True))
