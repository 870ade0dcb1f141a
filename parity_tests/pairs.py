"""The pairs: each jaxdp strategy and its PyTorch twin.

``pair_for`` builds each row from the strategy's registry row (``jaxdp.registry``: its torch twin)
and facts (``jaxdp.strategies.facts``); a registered strategy with a torch twin is paired (if it
has options of its own, their fields in ``jaxdp.config.step.StrategyOptions`` say how they pair:
``PAIR_OPTIONS`` and ``JAX_ONLY_OPTIONS`` are read from them).

==========================  ==============================================  ======  =================================
jaxdp                       torch_ref (PyTorch)                             ranks   notes
==========================  ==============================================  ======  =================================
ddp                         DistributedDataParallel, broadcast_buffers      N       BN: per-rank stats, rank 0's
                                                                                    running stats
ddp --accum-steps K         DDP, ``no_sync()`` on K-1 micro-steps           N       loss/K per micro-step
ddp --sync-bn               CUDA: DDP + SyncBatchNorm (N ranks);            N / 1   SyncBatchNorm raises on CPU
                            CPU: ONE process on the full global batch               tensors; full-batch BN is the
                                                                                    same math (global statistics)
ddp --allreduce ring        DDP (gloo/nccl all-reduce)                      N       ring of ppermutes vs library
ddp --compress bf16|fp16    DDP + ``bf16/fp16_compress_hook``               N       bounds at the wire's precision
ddp --compress powersgd     DDP + ``powerSGD_hook`` (error feedback, warm   N       same initial Q fed to both sides
                            start, start_iter 2)
zero1                       DDP + ``ZeroRedundancyOptimizer``               N       the ddp rows' all-reduce options
                                                                                    too: one AllReduce on both sides
zero2                       FSDP2 ``fully_shard(reshard_after_forward=      N       per block + root
                            False)``
zero3                       FSDP2 ``fully_shard(reshard_after_forward=      N
                            True)``
zero3|hsdp --remat none     the same twin (FSDP2 keeps activations too)     N       --remat unit recomputes each
                                                                                    unit: the same numbers
hsdp --mesh-shape R,S       FSDP2 on a 2-D DeviceMesh (replicate, shard)    R*S
dp                          ``nn.DataParallel`` with >= N GPUs; else DDP    1 / N   DataParallel's math is DDP's:
                            on N ranks                                              per-chunk BN, chunk 0's running
                                                                                    stats, averaged gradients
async --staleness 0         DDP                                             N       k > 0 has no torch twin (refused)
==========================  ==============================================  ======  =================================

Jax- and torch-free at import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Tuple, Union

from jaxdp import registry
from jaxdp.config.step import StrategyOptions, options_where
from parity_tests.config import ParityConfig

# The strategy options a pair may set: the same names on both sides, as their fields in
# ``StrategyOptions`` say (``parity=``). A pair takes those its jaxdp strategy (``options_of``) and its
# twin (``Twin.options``) both take; any other must stay at its default. ``powersgd_start_iter``
# rides with ``--compress powersgd``. The jax-only ones (how jaxdp sums, async's bound, what ZeRO-3
# keeps for backward) have no torch knob: any value a pair accepts runs against the same twin.
JAX_ONLY_OPTIONS = options_where(parity="jax-only")
PAIR_OPTIONS = tuple(n for n in StrategyOptions.STRATEGY_OPTIONS if n not in options_where(parity=None))


@dataclass(frozen=True)
class Pair:
    """One row of the strategy -> torch twin table, built by ``pair_for`` from the strategy's facts.

    ``twin``: the torch twin in words. ``torch``: torch_ref strategy name, or a function
    ``(cfg, cuda_gpus) -> name`` when the twin depends on the hardware. ``options``: the
    ``PAIR_OPTIONS`` this pair accepts; others must stay at their defaults. ``check``: refuses
    configurations with no twin (returns an error). ``jax_takes``: every option the jaxdp strategy
    takes (``options_of``), so that a plan need not ask again.
    """

    twin: str
    torch: Any
    options: Tuple[str, ...] = ()
    check: Optional[Callable[["ParityConfig"], Optional[str]]] = None
    note: str = ""
    jax_takes: Tuple[str, ...] = ()



def __getattr__(name):
    """``PAIRS``: the registered strategies that have a torch twin, read from the jax-free registry
    when asked. ``pair_for`` reads a pair's facts when a run needs them."""
    if name == "PAIRS":
        return tuple(n for n in registry.names() if registry.row(n).torch_twin)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


FALLBACK_NOTE = ("without N GPUs {twin} cannot split the batch, so the twin is {fallback}, whose math is "
                 "{twin}'s: per-chunk BN statistics, chunk/rank 0's running stats, gradients averaged over chunks")


def pair_for(strategy: Union[str, "registry.Row"]) -> Pair:
    """A strategy's pair, from its registry row (or its name, looked up here): its twin from the row
    and its facts (``jaxdp.strategies.facts``); the options both its jaxdp constructor
    (``options_of``) and its torch_ref twin (``Twin.options``) take."""
    from jaxdp.strategies import facts, options_of
    from torch_ref.strategies import twin

    row = registry.row(strategy) if isinstance(strategy, str) else strategy
    f, jax_takes, torch_takes = facts(row.name), tuple(options_of(row.name)), twin(row.torch_twin).options
    options = tuple(n for n in PAIR_OPTIONS if n in jax_takes and (n in JAX_ONLY_OPTIONS or n in torch_takes))
    if row.twin_without_gpus:  # nn.DataParallel splits the batch over GPUs: without them, DDP
        fallback = row.twin_without_gpus
        return Pair(f"{f.twin} (>= N GPUs), else {fallback} on N ranks: the same math", _gpu_twin(row), options,
                    note=FALLBACK_NOTE.format(twin=f.twin, fallback=fallback), jax_takes=jax_takes)
    check = _twin_check(row.name, f.twin_when, f.twin) if f.twin_when else None
    return Pair(f.twin, row.torch_twin, options, check, jax_takes=jax_takes)


def twin_row(name: str) -> Optional["registry.Row"]:
    """``name``'s registry row if it is a registered strategy with a torch twin, else None."""
    try:
        row = registry.row(name)
    except registry.UnknownStrategy:
        return None
    return row if row.torch_twin else None


def _twin_check(name: str, twin_when: Mapping[str, Any], twin: str):
    """Refuses the options under which ``name`` has no twin (its ``facts.twin_when``)."""
    def check(cfg: ParityConfig) -> Optional[str]:
        for option in PAIR_OPTIONS:
            if option in twin_when and getattr(cfg, option) != twin_when[option]:
                return f"{name} with {option} {getattr(cfg, option)} has no PyTorch twin; its twin: {twin}"
        return None
    return check


def _gpu_twin(row: "registry.Row") -> Callable[[ParityConfig, int], str]:
    """The twin that needs a GPU per device, else ``row.twin_without_gpus``."""
    def twin(cfg: ParityConfig, cuda_gpus: int) -> str:
        return row.torch_twin if cuda_gpus >= max(cfg.devices, 2) else row.twin_without_gpus
    return twin
