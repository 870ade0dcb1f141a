"""A configuration field and what is generated from a tree of them.

A configuration is a dataclass whose sections are dataclasses too (``jaxdp.config``,
``jaxdp.step_config``), as in flax's ``configs/default.py`` or torchtitan's ``JobConfig``.
Each field is declared once with ``option``: its default, its help text and whether it
changes the numbers a run computes. From those fields come

- the command-line flags (``add_arguments``: ``--name-with-dashes``, the help and default),
- the config-file keys (``jaxdp.config_file``: the field names),
- the resume fingerprint (``fingerprint``: exactly the fields that change the numbers).

Jax-free: the CLI builds its parser before ``--devices`` reaches XLA.
"""

import argparse
import dataclasses
import typing
from typing import Any, Callable, Dict, Optional, Sequence, Tuple


def option(default: Any, help: str, *, numbers: bool, choices: Optional[Sequence[str]] = None,  # noqa: A002
           parse: Optional[Callable] = None, flags: Tuple[str, ...] = (), strategy_option: bool = False,
           **argparse_kwargs) -> Any:
    """A config field. ``numbers``: changing it changes what the run computes, so a resumed
    run must keep it (the fingerprint). ``choices`` are listed in --help (the library checks
    names itself, with one-line errors); ``parse`` turns the flag's text into the value
    (default: from the field's type); ``flags``: further spellings; ``argparse_kwargs`` for
    the rare flag argparse needs told more (``nargs``, ``metavar``); ``strategy_option``: an
    option only some strategies take (``StrategyOptions.STRATEGY_OPTIONS``)."""
    meta = dict(help=help, numbers=numbers, choices=tuple(choices) if choices is not None else None, parse=parse,
                flags=flags, strategy_option=strategy_option, argparse=argparse_kwargs)
    if isinstance(default, (list, dict, set)):
        raise TypeError("a config default must be immutable (use a tuple)")
    return dataclasses.field(default=default, metadata=meta)


def declared(cls) -> Tuple[dataclasses.Field, ...]:
    """The fields of ``cls`` declared with ``option`` (in declaration order)."""
    return tuple(f for f in dataclasses.fields(cls) if "numbers" in f.metadata)


def number_fields(cls) -> Tuple[str, ...]:
    """The fields whose value changes what a run computes: the resume fingerprint's."""
    return tuple(f.name for f in declared(cls) if f.metadata["numbers"])


def fingerprint(cfg) -> Dict[str, Any]:
    """``cfg``'s number-changing fields, as JSON would give them back (tuples as lists)."""
    return {name: _jsonable(getattr(cfg, name)) for name in number_fields(type(cfg))}


def _jsonable(value):
    return [_jsonable(v) for v in value] if isinstance(value, (tuple, list)) else value


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def listing(names) -> str:
    """``{a,b,c}``: the names in --help, as argparse shows choices. (Not ``choices=``: the
    library checks names itself, with one-line errors, in the CLI and the Python API alike.)"""
    return "{" + ",".join(names) + "}"


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
