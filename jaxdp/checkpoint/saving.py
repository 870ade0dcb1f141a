"""A strategy's state to and from a checkpoint directory, in the one layout every writer uses.

``Trainer.save``/``Trainer.restore`` call these, and ``jaxdp train`` saves and resumes through
them, so a checkpoint written by either is read by the other. The arrays are the stored layout
(``strategy.engine.stored``: canonical shapes, cut over the data axis), so a state saved under one
strategy, mesh and device count restores under any other, each device reading only its part.
Beside them, one JSON record (``META_FORMAT``)::

    {"format": 2,
     "global_step": 12,                                  # the state's step, the checkpoint's number
     "rng": {"impl": "threefry2x32", "data": [0, 5]},    # the root of the losses' rng stream
     "record": {...} or null}                            # the writer's own: jaxdp train's run position

``rng`` is always written (``Strategy.use_rng``'s key, else ``jax.random.key(seed)``), so a
restored run draws the masks the saved run would have. ``record`` is the caller's JSON dict:
``jaxdp train`` keeps there the epoch, the step in it, the data position and the config
fingerprint; ``Trainer.save`` writes what it is given (nothing by default).

The two layouts written before this one (jaxdp 0.2's ``jaxdp train``: the run's keys at the top
and ``"rng": {"init_seed": s}``; its ``Trainer.save``: ``"trainer_rng"``) are read as this one
(``upgrade``): their checkpoints restore and resume unchanged.
"""

from typing import Callable, Optional

import jax
import numpy as np

from jaxdp.checkpoint.store import Checkpointer, CheckpointError

META_FORMAT = 2
DEFAULT_KEEP = 3  # checkpoints kept in a directory (``jaxdp train --keep``)
_OLD_RUN_KEYS = ("epoch", "step_in_epoch", "fingerprint", "data")  # jaxdp 0.2's train wrote them at the top


def save(strategy, path: str, state, record: Optional[dict] = None, keep: int = DEFAULT_KEEP) -> int:
    """Write ``state`` as checkpoint step ``state.step`` in ``path``, the newest ``keep`` kept;
    returns the step. Every process calls it: each writes its own devices' chunks."""
    stored = strategy.engine.stored(state)
    step = int(stored.step)  # one replicated scalar (dp's own state holds one per device)
    meta = {"format": META_FORMAT, "global_step": step, "rng": _key_record(_rng_root(strategy)), "record": record}
    ckpt = Checkpointer(path, max_to_keep=keep)
    try:
        ckpt.save(step, stored, meta)
    finally:
        ckpt.close()
    return step


def restore(strategy, path: str, example_batch, step: Optional[int] = None,
            check: Optional[Callable[[dict], None]] = None, accept_unverified: bool = False):
    """(state, meta): the newest usable checkpoint in ``path`` (or ``step``) as ``strategy``'s state,
    and its record in this module's layout (older layouts upgraded).

    Read into shapes and shardings only (``abstract_state``): nothing whole is built, and a
    corrupt newest checkpoint falls back to the one before (``Checkpointer.restore_latest``); a
    ``step`` asked for is verified the same way, and raised if corrupt or unverified.
    ``check(meta)`` runs before any array is read; what it raises (a checkpoint of another run)
    is raised as is; ``accept_unverified``: a checkpoint without a manifest is restored (with a
    warning) rather than skipped. The strategy's rng stream continues from the saved root. Nothing
    in ``path`` is changed: a writer may be saving there.
    """
    target = strategy.engine.restore_target(example_batch)

    def checked(meta: dict) -> None:  # a record this jaxdp cannot read is refused here too
        meta = upgrade(meta)
        _rng_key(meta["rng"], path)
        if check is not None:
            check(meta)

    ckpt = Checkpointer(path)
    try:
        if step is None:
            stored, meta, step = ckpt.restore_latest(target, check_meta=checked, accept_unverified=accept_unverified)
        else:
            stored, meta = ckpt.restore_step(target, step, check_meta=checked, accept_unverified=accept_unverified)
    finally:
        ckpt.close()
    meta = upgrade(meta, step)
    if meta["rng"] is not None:
        strategy.use_rng(_rng_key(meta["rng"], path))
    return strategy.engine.from_stored(stored), meta


def _rng_key(rng: Optional[dict], path: str):
    """The saved rng root as a key (None: none saved); a record jax cannot make one of is one line."""
    if rng is None:
        return None
    try:
        return jax.random.wrap_key_data(np.asarray(rng["data"], np.uint32), impl=rng["impl"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint in {path}: its rng record {rng!r} is not a key this jax can make "
                              f"({' '.join(str(e).split())[:200]})") from None


def _rng_root(strategy):
    """The key the strategy's rng stream derives from (``Strategy.step_key``)."""
    return jax.random.key(strategy.seed) if strategy.rng_root is None else strategy.rng_root


def upgrade(meta: dict, step: Optional[int] = None) -> dict:
    """A checkpoint's JSON record in this module's layout, whichever jaxdp wrote it.

    ``step``: the checkpoint's number, the global step of records that lack one."""
    version = meta.get("format", 1)
    if version == META_FORMAT:
        return meta
    if version != 1:
        raise CheckpointError(f"this checkpoint's record has format {version!r}, written by a newer jaxdp "
                              f"(this one reads formats 1-{META_FORMAT}): upgrade jaxdp to restore it")
    global_step = meta.get("global_step", step)
    if "epoch" in meta:  # jaxdp train's: the run's position at the top; its rng stream was key(--seed)
        seed = meta.get("rng", {}).get("init_seed")
        return {"format": META_FORMAT, "global_step": global_step,
                "rng": None if seed is None else _key_record(jax.random.key(seed)),
                "record": {k: meta[k] for k in _OLD_RUN_KEYS if k in meta}}
    # Trainer.save's: "trainer_rng" when the Trainer had one; nothing of the caller's
    return {"format": META_FORMAT, "global_step": global_step, "rng": meta.get("trainer_rng"), "record": None}


def _key_record(key) -> dict:
    return {"impl": str(jax.random.key_impl(key)), "data": np.asarray(jax.random.key_data(key)).tolist()}
