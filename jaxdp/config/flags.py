"""Command-line flags: generated from a configuration's fields (``add_arguments``), and
what every jaxdp command line shares.

One vocabulary across train, parity, bench, inspect and launch (``--devices``,
``--global-batch-size``, ``--accum-steps``, ...): a field declared once
(``jaxdp.config.fields.option``) is the same flag wherever a command takes it. A flag that had
another name keeps it for one release: the old spelling still works and says what replaced it.
"""

import argparse
import dataclasses
import sys
import typing
from typing import Any, Callable, Optional, Sequence, Tuple

from jaxdp.config.choices import listing
from jaxdp.config.fields import declared
from jaxdp.config.step import ModelOptions, StrategyOptions

# No abbreviations (argparse would take --epoch for --epochs, silently), and every
# option's default in its help.
PARSER_OPTIONS = dict(allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


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


def add_arguments(group, cls, names: Optional[Sequence[str]] = None, *, defaults=None, **help_overrides) -> None:
    """One flag per ``option`` field of ``cls`` (or of ``names``, in that order): its
    spelling, type, help and default come from the field. ``defaults``: an instance whose
    values are the defaults (a command that changes some); ``help_overrides``: a command's
    own wording for a field, by name."""
    by_name = {f.name: f for f in declared(cls)}
    for name in names if names is not None else by_name:
        f = by_name[name]
        default = getattr(defaults, name) if defaults is not None else f.default
        add_field(group, f, default, help_overrides.get(name))


def add_field(group, f: dataclasses.Field, default: Any, help: Optional[str] = None) -> None:  # noqa: A002
    meta, flag = f.metadata, flag_name(f.name)
    text = help if help is not None else meta["help"]
    if f.type is bool and not meta["argparse"]:  # an on/off switch: --name turns it on, --no-name off
        if default:
            group.add_argument(f"--no-{flag[2:]}", dest=f.name, action="store_false", help=text)
        else:
            group.add_argument(flag, *meta["flags"], dest=f.name, action="store_true", help=text)
        return
    kwargs = dict(dest=f.name, default=default, help=text)
    parse = meta["parse"] or _parser_for(f)
    if parse is not str:
        kwargs["type"] = parse
    if meta["choices"] is not None:
        kwargs["metavar"] = listing(meta["choices"])
    kwargs.update(meta["argparse"])
    group.add_argument(flag, *meta["flags"], **kwargs)


def _parser_for(f: dataclasses.Field) -> Callable:
    """The flag's type from the field's: int, float, str, or a comma-separated tuple of ints."""
    hint = f.type
    if typing.get_origin(hint) is typing.Union:  # Optional[X]: X
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is tuple:
        if set(typing.get_args(hint)) - {int, Ellipsis}:
            raise TypeError(f"{f.name}: give option(parse=...) for a {hint}")
        return comma_ints
    if hint in (int, float, str):
        return hint
    raise TypeError(f"{f.name}: give option(parse=...) for a {hint}")


def step_range(text: str) -> Tuple[int, int]:
    """``--profile-steps A:B``."""
    try:
        start, stop = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B (steps A to B-1), got {text!r}") from None
    return start, stop


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
    (``jaxdp.config.step.StrategyOptions``), from their fields; ``defaults`` holds their defaults."""
    names = [f.name for f in declared(StrategyOptions) if f.name != "strategy"]
    add_arguments(group, StrategyOptions, names, defaults=defaults, sync_bn=sync_bn_help, staleness=staleness_help)


MESH_HELP = ("named mesh axis sizes, e.g. data=2,model=2 (axes replica, data, stage, model; their product is the "
             "device count)")


def add_mesh_flag(group, default=None, *, what: str = "") -> None:
    """``--mesh data=2,stage=2,model=2``, the same flag in train, inspect, bench and parity (checked
    by ``jaxdp.runtime.mesh.mesh_sizes``); ``what`` says what the command does with it."""
    group.add_argument("--mesh", default=default, help=MESH_HELP + (f": {what}" if what else ""))


VIT_SIZES = ModelOptions.VIT_OPTIONS


def add_vit_flags(group) -> None:
    """``--depth --dim --heads --mlp-dim --patch``: a ViT's sizes (None keeps the named model's)."""
    for size in VIT_SIZES:
        group.add_argument(flag_name(size), type=int, default=None,
                           help=f"ViT: {size} (default: the named model's)")
