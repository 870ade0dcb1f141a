"""``jaxdp export --torch RUN_DIR out.pt``: a jaxdp run's newest checkpoint as a torch ``state_dict``.

The checkpoint's stored layout is the canonical one whatever strategy and device count
wrote it (``jaxdp.checkpoint``), so the export reads only the params and the model state
(BatchNorm running stats), as numpy on the host, and converts them with ``jaxdp.interop``
into torch_ref's names and layouts. ``torch_ref.models.create_model`` with the run's options
loads the file with ``load_state_dict`` (strict). The optimizer state is not exported.

Registered as a ``jaxdp`` subcommand with the [torch] extra (``jaxdp.commands``); this module
imports neither jax nor torch until it runs.
"""

import argparse
import os

import numpy as np

from jaxdp.cli.commands import Command, CommandError
from jaxdp.config import files as config_file
from jaxdp.config.tree import TrainConfig, TrainError


def add_export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--torch", action="store_true", required=True,
                   help="write a torch state_dict (torch.save), loadable by torch_ref.models.create_model")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a jaxdp train run directory (config.json, checkpoints/)")
    p.add_argument("out", metavar="OUT", help="the .pt file to write")
    p.add_argument("--step", type=int, default=None, help="the checkpoint's global step (default: the newest)")


def exported_state_dict(run_dir: str, step=None):
    """(numpy state_dict in torch names, the checkpoint's step)."""
    import jax
    import orbax.checkpoint as ocp

    from jaxdp.checkpoint import CheckpointError, Checkpointer
    from jaxdp.interop import state_dict_from_variables
    from jaxdp.models import create_model

    config = os.path.join(run_dir, "config.json")
    if not os.path.isfile(config):
        raise CheckpointError(f"{run_dir} is not a jaxdp run directory (it has no config.json)")
    cfg = TrainConfig(**{**config_file.load(config, drop=config_file.NOT_INHERITED, flag="export"), "out": run_dir})
    model = create_model(cfg.model, width=cfg.width, blocks=cfg.blocks, stem=cfg.stem, dtype=cfg.dtype)
    shapes = dict(jax.eval_shape(lambda: model.init(jax.random.key(0), np.zeros((1, 32, 32, 3), np.float32),
                                                    train=False)))
    target = {"params": shapes.pop("params"), "model_state": shapes}
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"))
    step = ckpt.latest_step() if step is None else step
    if step is None or step not in ckpt.all_steps():
        raise CheckpointError(f"{run_dir} has no checkpoint{'' if step is None else f' of step {step}'} to export")
    ckpt.verify(step)
    # Only the arrays asked for, as host numpy: no mesh, no optimizer state, nothing sharded.
    restore_args = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
    stored = ocp.PyTreeCheckpointer().restore(
        os.path.join(ckpt.step_dir(step), "state"),
        args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True))
    variables = {"params": stored["params"], **stored["model_state"]}
    return state_dict_from_variables(variables, num_batches_tracked=step), step


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    from jaxdp.checkpoint import CheckpointError
    try:
        state_dict, step = exported_state_dict(args.run_dir, args.step)
    except (CheckpointError, TrainError) as e:
        raise CommandError(str(e)) from None
    directory = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(directory, exist_ok=True)
    tmp = args.out + ".tmp"
    torch.save({k: torch.from_numpy(v) for k, v in state_dict.items()}, tmp)
    os.replace(tmp, args.out)  # never a half-written file under the name asked for
    print(f"wrote {args.out}: {len(state_dict)} tensors from {args.run_dir} step {step}")
    return 0


EXPORT = Command("a run's newest checkpoint as a torch state_dict: jaxdp export --torch RUN_DIR out.pt",
                 add_export_args, cmd_export, requires=("torch",))
