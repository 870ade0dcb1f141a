"""Checkpoints, a library service below the ``Trainer`` (``jaxdp.api``) and ``jaxdp train``
(``jaxdp.run``): store.py writes and reads a directory of orbax checkpoints (atomic, verified
against a manifest, sharded, any device count); saving.py puts a strategy's state in it, with the
one JSON record every writer uses. ``Trainer.save``/``Trainer.restore`` and ``jaxdp train`` both go
through saving.py, so either reads what the other wrote."""

from jaxdp.checkpoint.store import (MANIFEST, CheckpointCorrupt, CheckpointError, Checkpointer,  # noqa: F401
                                    CheckpointUnreadable, CheckpointWarning, NoCheckpoint,
                                    PartialSavesRemoved, remove_partial_saves)
