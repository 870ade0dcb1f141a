"""What every jaxdp command line shares: parser settings and renamed flags.

One vocabulary across train, parity, bench, inspect and launch (``--devices``,
``--global-batch-size``, ``--accum-steps``, ...). A flag that had another name keeps it
for one release: the old spelling still works and says what replaced it.
"""

import argparse
import sys

# No abbreviations (argparse would take --epoch for --epochs, silently), and every
# option's default in its help.
PARSER_OPTIONS = dict(allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def comma_ints(text: str):
    """``--blocks 1,1,1,1``: a tuple of integers, or argparse's one-line error."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def comma_floats(text: str):
    """``--betas 0.9,0.999``: a tuple of numbers, or argparse's one-line error."""
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def deprecated_alias(parser, old: str, new: str, **kwargs) -> None:
    """Accept ``old`` as ``new`` (same ``dest`` and ``type``, given in ``kwargs``), hidden
    from --help, with a one-line notice on stderr when used."""

    class Alias(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            print(f"jaxdp: {old} is deprecated and will be removed in the next release; use {new}",
                  file=sys.stderr)
            setattr(namespace, self.dest, values)

    parser.add_argument(old, action=Alias, help=argparse.SUPPRESS, **kwargs)


def add_strategy_flags(group, defaults, *, sync_bn_help: str, staleness_help: str) -> None:
    """The strategy options ``jaxdp train`` and ``jaxdp parity`` both take
    (``jaxdp.step_config.StrategyOptions``), defined once; ``defaults`` holds their defaults."""
    from jaxdp import choices

    d, g = defaults, group
    g.add_argument("--accum-steps", type=int, default=d.accum_steps, help="micro-batches per update (torch no_sync)")
    g.add_argument("--sync-bn", action="store_true", help=sync_bn_help)
    g.add_argument("--bucket-cap-mb", type=float, default=d.bucket_cap_mb,
                   help="ddp gradient bucket size in MiB (inf: one bucket; default: torch's, a 1 MiB first bucket, then 25)")
    g.add_argument("--allreduce", default=d.allreduce, metavar=choices.listing(choices.ALLREDUCES),
                   help="ddp, zero1: psum, or ring (reduce-scatter + all-gather written out)")
    g.add_argument("--compress", default=d.compress, metavar=choices.listing(choices.COMPRESSIONS),
                   help="ddp/zero1 gradient compression (default: none)")
    g.add_argument("--powersgd-rank", type=int, default=d.powersgd_rank, help="powersgd: rank of P and Q")
    g.add_argument("--powersgd-start-iter", type=int, default=d.powersgd_start_iter,
                   help="powersgd: plain all-reduce for the first N steps (torch's start_powerSGD_iter; >= 2)")
    g.add_argument("--staleness", type=int, default=d.staleness, help=staleness_help)
    g.add_argument("--mesh-shape", type=comma_ints, default=d.mesh_shape, help="hsdp: replicas,shards")
    add_remat_flag(g, d.remat)


def add_remat_flag(group, default="unit") -> None:
    """``--remat``: what a zero3/hsdp FSDP unit keeps for backward (train, parity, bench, inspect)."""
    from jaxdp import choices

    group.add_argument("--remat", default=default, metavar=choices.listing(choices.REMATS),
                       help="zero3, hsdp: unit = keep each unit's input and recompute it in backward (least "
                            "memory); none = keep its activations, gather its params again (FSDP2's default)")


MESH_HELP = ("named mesh axis sizes, e.g. data=2,model=2 (axes replica, data, stage, model; their product is the "
             "device count)")


def add_mesh_flag(group, default=None, *, what: str = "") -> None:
    """``--mesh data=2,stage=2,model=2``, the same flag in train, inspect, bench and parity (checked
    by ``jaxdp.mesh.mesh_sizes``); ``what`` says what the command does with it."""
    group.add_argument("--mesh", default=default, help=MESH_HELP + (f": {what}" if what else ""))


VIT_SIZES = ("depth", "dim", "heads", "mlp_dim", "patch")


def add_vit_flags(group) -> None:
    """``--depth --dim --heads --mlp-dim --patch``: a ViT's sizes (None keeps the named model's)."""
    for size in VIT_SIZES:
        group.add_argument(f"--{size.replace('_', '-')}", type=int, default=None,
                           help=f"ViT: {size} (default: the named model's)")
