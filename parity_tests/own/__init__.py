"""Parity for a pair of models of your own: a Flax port against its PyTorch original, step by
step, under every strategy with a torch twin (docs/parity.md, "Your own models").

    from parity_tests.own import ModelPair, PairRun, run_pair
    result = run_pair("mypackage.pairs:make_pair", PairRun(strategy="zero3", devices=2, dtype="float64"))

- ``pair``: ``ModelPair`` (what the user gives) and the factory every torch rank builds it from;
- ``correspondence``: which torch tensor is which Flax variable: ``jaxdp.interop``'s converter
  (HF's rules, overridable; tied weights; HF's Conv1D), its refusals in the harness's words;
- ``outputs``: a model's outputs walked keeping their types; ``non_trainable``: the tensors that
  do not train in torch, compared as values;
- ``config``: ``PairRun``, a run described with ``jaxdp parity``'s options;
- ``setup``, ``jax_pair``, ``torch_rank``, ``sides``: one init for both, the batches, the refusals;
  K steps on each side (jaxdp's strategy; torch_ref's ``Runner`` on the launcher's ranks);
- ``budget``: float32/bf16 bounds from the pair's own measured error budget;
- ``runner``: ``run_pair`` and ``check_pair``; ``localize``: the first module whose output differs;
- ``bugs``: porting mistakes injected into a pair, which the harness must catch and name;
- ``toy_pairs``: small pairs for the tests (a BatchNorm MLP, a dropout variant);
  ``ported_pairs``: one written as real ports are (tied weights, HF's Conv1D, keyword inputs,
  structured outputs, a buffer that is a Flax param, a checkpoint's weights);
- ``matrix``: the broad check (every strategy, N = 1..3, every dtype), a slow script.

Jax- and torch-free at import (``jaxdp parity --devices N`` must set XLA's flags first).
"""

from parity_tests.own.config import PairRun
from parity_tests.own.pair import ModelPair, PairError


def __getattr__(name):
    """The run's functions and the correspondence's types, imported when first asked for."""
    if name in ("run_pair", "check_pair", "PairResult", "PairCheck"):
        from parity_tests.own import runner

        return getattr(runner, name)
    if name in ("Layout", "LAYOUTS", "CorrespondenceError"):
        from parity_tests.own import correspondence

        return getattr(correspondence, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ModelPair", "PairError", "PairRun", "run_pair", "check_pair", "PairResult", "PairCheck", "Layout",
           "LAYOUTS", "CorrespondenceError"]
