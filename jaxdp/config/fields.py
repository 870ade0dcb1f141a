"""A configuration field and what is generated from a tree of them.

A configuration is a dataclass whose sections are dataclasses too (``jaxdp.config.tree``,
``jaxdp.config.step``), as in flax's ``configs/default.py`` or torchtitan's ``JobConfig``.
Each field is declared once with ``option``: its default, its help text and whether it
changes the numbers a run computes. From those fields come

- the command-line flags (``jaxdp.config.flags.add_arguments``: ``--name-with-dashes``, help, default),
- the config-file keys (``jaxdp.config.files``: the field names),
- the resume fingerprint (``fingerprint`` here: exactly the fields that change the numbers).

Jax-free: the CLI builds its parser before ``--devices`` reaches XLA.
"""

import dataclasses
from typing import Any, Callable, Dict, Optional, Sequence, Tuple


def option(default: Any, help: str, *, numbers: bool, choices: Optional[Sequence[str]] = None,  # noqa: A002
           parse: Optional[Callable] = None, flags: Tuple[str, ...] = (), strategy_option: bool = False,
           at_least: Optional[int] = None, hint: str = "", parity: Optional[str] = None, inspect: bool = False,
           **argparse_kwargs) -> Any:
    """A config field. ``numbers``: changing it changes what the run computes, so a resumed
    run must keep it (the fingerprint). ``choices`` are listed in --help (the library checks
    names itself, with one-line errors); ``parse`` turns the flag's text into the value
    (default: from the field's type); ``flags``: further spellings; ``argparse_kwargs`` for
    the rare flag argparse needs told more (``nargs``, ``metavar``); ``strategy_option``: an
    option only some strategies take (``StrategyOptions.STRATEGY_OPTIONS``); ``at_least``: the
    smallest value a config may give it (None passes), ``hint`` what the refusal adds.

    A strategy option says too how ``jaxdp parity`` pairs it (``parity``: ``"paired"``, both sides
    take it; ``"jax-only"``, a jaxdp knob the torch twin has no counterpart for, run against the
    same twin; None, not a pair option) and whether ``jaxdp inspect`` takes it (``inspect``):
    ``parity_tests.pairs`` and ``jaxdp.cli.inspect_command`` read their lists from these."""
    if parity not in (None, "paired", "jax-only"):
        raise ValueError(f"parity is 'paired', 'jax-only' or None, got {parity!r}")
    meta = dict(help=help, numbers=numbers, choices=tuple(choices) if choices is not None else None, parse=parse,
                flags=flags, strategy_option=strategy_option, at_least=at_least, hint=hint, parity=parity,
                inspect=inspect, argparse=argparse_kwargs)
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
