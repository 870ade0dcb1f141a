"""What every jaxdp command line shares: parser settings and renamed flags.

One vocabulary across train, parity, bench, inspect and launch (``--devices``,
``--global-batch-size``, ``--accum-steps``, ...). A flag that had another name keeps it
for one release: the old spelling still works and says what replaced it.
"""

import argparse
import sys

from jaxdp.options import add_arguments, add_field, comma_floats, comma_ints, declared  # noqa: F401 (the flags' parsers)
from jaxdp.config import MESH_HELP
from jaxdp.step_config import StrategyOptions

# No abbreviations (argparse would take --epoch for --epochs, silently), and every
# option's default in its help.
PARSER_OPTIONS = dict(allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter)


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
    (``jaxdp.step_config.StrategyOptions``), from their fields; ``defaults`` holds their defaults."""
    names = [f.name for f in declared(StrategyOptions) if f.name != "strategy"]
    add_arguments(group, StrategyOptions, names, defaults=defaults, sync_bn=sync_bn_help, staleness=staleness_help)


def add_remat_flag(group, default="unit") -> None:
    """``--remat``: what a zero3/hsdp FSDP unit keeps for backward (train, parity, bench, inspect)."""
    add_field(group, StrategyOptions.__dataclass_fields__["remat"], default)


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
