"""``run_pair``: a user's own pair of models, compared step by step as the built-in pairs are.

    result = run_pair("examples.parity_own_model:make_pair", PairRun(strategy="zero3", devices=2))
    result.passed, result.message(), result.comparison.steps[0].entries   # per step, per tensor

One run: the plan (``parity_tests.plan``: the torch twin, its ranks, the backend), the pair set
up once in this process (``setup``: one init for both, the batches, the refusals), torch's
ranks (``torch_rank``) and jaxdp's strategy (``jax_pair``) for K steps, then
``compare.compare_runs``: float64 within 1e-10; float32 and bfloat16 within the pair's own
measured budget (``budget``: each side at N = 1 in float64 and in the low dtype); with ``out``,
``report.json`` and ``parity.png`` (``report``).
When the losses part at step 0, ``localize`` names the first module whose output differs.

Nothing here imports jax or torch at module level.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

from parity_tests.own.config import PairRun
from parity_tests.own.pair import factory
from parity_tests.own.sides import planned, sides
from parity_tests.runner import ParityResult


@dataclass
class PairResult(ParityResult):
    """``ParityResult`` (per step, per tensor: ``comparison``; the verdict: ``passed``) of a pair,
    with the measured budget its float32/bf16 bounds came from, and where a forward first differs."""

    budget: Optional[dict] = None
    finding: Any = None  # localize.Finding, when the losses part at step 0

    def message(self) -> str:
        text = super().message()
        return f"{text}; {self.finding.message()}" if self.finding is not None and not self.passed else text

    def to_json(self) -> dict:
        return {**super().to_json(), "pair": self.plan.cfg.pair, "budget": self.budget,
                "first_difference": dataclasses.asdict(self.finding) if self.finding is not None else None}


def plan_pair(pair, run: Optional[PairRun] = None, bug: Optional[str] = None, **options):
    """What ``run_pair`` refuses before it builds a model, each in one line (``ParityError``): a
    factory the ranks cannot reach, an option that does not apply to a pair, a strategy with no
    twin, an unknown bug. Returns (the factory, the run, the plan)."""
    from parity_tests.own import bugs

    fac = factory(pair)
    run = dataclasses.replace(run or PairRun(), pair=fac.label, **options)
    p = planned(run)
    if bug is not None:
        bugs.named(bug)
    return fac, run, p


def run_pair(pair, run: Optional[PairRun] = None, *, bug: Optional[str] = None, out: Optional[str] = None,
             **options) -> PairResult:
    """Compare ``pair`` (a factory, ``"module:function"`` or the function) under ``run`` (a
    ``PairRun``; ``options`` override its fields). ``bug``: a ``parity_tests.own.bugs.BUGS`` name
    injected into the pair. ``out``: a directory for ``report.json`` and ``parity.png``.
    ``ParityError`` (one line) for what cannot run, before anything does."""
    from parity_tests import compare, report
    from parity_tests.jax_side import configure_precision
    from parity_tests.own import budget as budgets
    from parity_tests.own import bugs, localize
    from parity_tests.own.setup import prepare

    fac, run, p = plan_pair(pair, run, bug, **options)
    configure_precision(p.cuda)
    t0 = time.perf_counter()
    s = prepare(fac, run, bug)
    if bug is not None:
        p.notes.append(f"INJECTED BUG in the pair: {bugs.named(bug).what}")
    t_inputs = time.perf_counter()
    measured = None if run.dtype == "float64" else budgets.measure(fac, run)
    t1 = time.perf_counter()
    records = sides(p, fac, bug, s)
    skip = ("loss_per_rank",) if p.world != run.devices else ()
    if measured is not None and not measured["float64"].passed:  # no budget: the math differs
        comparison = measured["float64"]
        p.notes.append(f"the float64 runs of the budget ({run.strategy} at N = 1) already differ (the comparison "
                       "below): a semantic difference, not rounding")
    else:
        comparison = compare.compare_runs(records["jax"], records["torch"],
                                          budgets.FLOAT64 if measured is None else budgets.bounds(measured), skip)
    result = PairResult(p, comparison, records["jax"], records["torch"],
                        {"inputs": t_inputs - t0, "budget": t1 - t_inputs, **records["seconds"]}, bug,
                        None if measured is None else budgets.summary(measured))
    d = comparison.divergence
    if d is not None and d.step == 0 and d.category in ("loss", "loss_per_rank") and comparison.bounds is budgets.FLOAT64:
        result.finding = localize.first_difference(s, run)  # a float64 difference: where the forwards part
    if out is not None:
        report.write(result, out)
    return result


@dataclass
class PairCheck:
    """``check_pair``'s results, one per (strategy, devices, dtype), and the verdict over all."""

    results: List[PairResult]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)


def check_pair(pair, strategies: Sequence[str] = ("ddp", "zero3"), devices: Sequence[int] = (2,),
               dtypes: Sequence[str] = ("float64",), *, out: Optional[str] = None,
               log: Optional[Callable[[PairResult], None]] = None, **options) -> PairCheck:
    """``run_pair`` over every strategy x dtype x device count (``options``: ``PairRun``'s fields);
    with ``out``, each run's report in ``out/<strategy>-n<N>-<dtype>/``; ``log`` sees each result."""
    results = []
    for strategy in strategies:
        for dtype in dtypes:
            for n in devices:
                where = os.path.join(out, f"{strategy}-n{n}-{dtype}") if out else None
                results.append(run_pair(pair, strategy=strategy, devices=n, dtype=dtype, out=where, **options))
                if log is not None:
                    log(results[-1])
    return PairCheck(results)
