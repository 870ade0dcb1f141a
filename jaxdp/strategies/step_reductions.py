"""What the step's whole-model reductions need from a strategy: the global gradient norm, and the
context ``jaxdp.clip_by_global_norm`` and ``jaxdp.global_mean`` read inside the step.

A mixin of ``base.Strategy``: each answer depends on how the strategy cuts the params (ZeRO's
chunks over data, slices over a model or stage axis), which only the strategy knows.
"""

import jax
import jax.numpy as jnp

from jaxdp.loss import reductions
from jaxdp.strategies import conversions
from jaxdp.strategies.device_math import sum_of_squares
from jaxdp.strategies.errors import StrategyError


class StepReductions:
    def with_grad_norm(self, out, grads, chunked: bool):
        """``out`` plus ``grad_norm``, the averaged gradient's global L2 norm, if ``log_grad_norm``.

        ``grads`` are this strategy's averaged gradients in its own layout (``chunked``: ZeRO's
        chunks over data; model slices under tensor parallelism).
        """
        if not self.log_grad_norm:
            return out
        return {**out, "grad_norm": jnp.sqrt(self.global_sum_of_squares(grads, chunked))}

    def global_sum_of_squares(self, tree, chunked: bool):
        """The sum of squares over the whole model of a params-shaped ``tree`` in this strategy's layout
        (``chunked``: ZeRO's chunks over data): ``device_math.sum_of_squares`` under its specs."""
        self._check_whole_tree(tree)
        return sum_of_squares(tree, self.placement.specs(tree, "params", chunked, self.shapes))

    def _check_whole_tree(self, tree) -> None:
        # shapes is None only when a step is lowered on a state this strategy did not build
        # (lower_step on another run's state): its tree is the state's own, whole.
        if self.shapes is not None and jax.tree_util.tree_structure(tree) != jax.tree_util.tree_structure(self.shapes):
            raise StrategyError("jaxdp.clip_by_global_norm needs the whole gradient tree: put it in the top-level "
                                "optax.chain, not inside masked or multi_transform")

    def step_context(self) -> reductions.StepContext:
        """What ``jaxdp.clip_by_global_norm`` and ``jaxdp.global_mean`` need to know inside the step:
        the optimizer sees chunks exactly when its state is sharded (ZeRO-1/2/3, HSDP), slices beside
        a model or stage axis; with whole gradients (ddp, dp, async) the plain local sum is the global one."""
        return reductions.StepContext(
            batch_axes=self.batch_axes, num_devices=self.num_devices, accum_steps=self.options.accum_steps,
            sum_of_squares=((lambda tree: self.global_sum_of_squares(tree, self.sharded_opt_state))
                            if self._optimizer_sees_parts else None))

    @property
    def _optimizer_sees_parts(self) -> bool:
        """The optimizer holds a part of each tensor: ZeRO's chunks, or slices over a model or stage axis."""
        return self.sharded_opt_state or self.model_split is not None

    def refuse_unshardable_tx(self) -> None:
        """Refuse, in one line, an optimizer that reduces over whole tensors when the optimizer sees
        only a part of each (ZeRO's chunks, tensor or pipeline slices): ``reductions.check_shardable``."""
        if not self._optimizer_sees_parts or self.__dict__.get("_tx_checked"):
            return
        conversions.need_shapes(self)
        layout_name = self.facts.name if self.sharded_opt_state else f"{self.facts.name} with a model or stage axis"

        def placeholder(tree):  # stands for the sharded reduction, without tracing one
            self._check_whole_tree(tree)
            return jnp.ones((), jnp.float32)
        probe = reductions.StepContext(self.batch_axes, self.num_devices, self.options.accum_steps, placeholder)
        try:
            reductions.check_shardable(self.tx, self.shapes, layout_name, probe)
        except reductions.UnshardableTransformError as e:
            raise StrategyError(str(e)) from None
        self._tx_checked = True
