"""A training run's options from a file: ``jaxdp train --config run.toml`` (or .json, or
.yaml with PyYAML installed), and a run directory's own ``config.json`` for
``jaxdp train --resume RUN_DIR``. Flags on the command line override the file.

Keys are ``TrainConfig``'s field names (``global_batch_size`` or ``global-batch-size``);
an unknown key is an error that names it, as an unknown flag would be. Every value is typed as
its flag is (``typed``): a switch takes true or false only, an integer refuses 4.7, a list has
its length; a string goes through the flag's own parser. A value of another type is one line
naming the file, the key, the value and what is expected, before anything is done with it.
"""

import argparse
import json
import os
import tomllib
import typing
from typing import Any, Dict, Iterable, Optional, Tuple

from jaxdp.config.tree import TrainConfig, TrainError

FIELDS = {f.name: f for f in TrainConfig.__dataclass_fields__.values()}
# What a run directory's config.json says about where it ran, not what it trains.
NOT_INHERITED = ("out", "resume", "overwrite")


def load(path: str, drop: Iterable[str] = (), flag: str = "--config") -> Dict[str, Any]:
    """{TrainConfig field: value} from ``path``, lists as tuples, ``drop`` left out. Errors
    name ``flag`` and the file."""
    raw = _read(path, flag)
    if not isinstance(raw, dict):
        raise TrainError(f"{flag} {path}: expected a table of options (key = value), got {type(raw).__name__}")
    values = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in FIELDS:
            raise TrainError(f"{flag} {path}: unknown option {key!r}; known: {', '.join(sorted(FIELDS))}")
        if name not in drop:
            try:
                values[name] = typed(FIELDS[name], value)
            except _Expected as e:
                raise TrainError(f"{flag} {path}: {key} = {_shown(value)}: expected {e}") from None
    return values


class _Expected(ValueError):
    """What a field takes, said when a file's value is not that."""


def typed(field, value):
    """``value`` from a file as the field's flag would give it, or ``_Expected`` saying what it takes.

    JSON's null (a run's config.json) only where the field's default may be None."""
    base, optional = _base_type(field.type)
    parse = field.metadata["parse"]
    if value is None:
        if optional:
            return None
        raise _Expected(_what(base, field))
    if base is bool:
        if isinstance(value, bool):
            return value
        if value in ("true", "false"):
            return value == "true"
        raise _Expected("true or false")
    if isinstance(value, str) and base is not str:  # the flag's text: its own parser, as on the command line
        from jaxdp.config.flags import comma_ints  # not at import: flags imports nothing of this module

        try:
            value = (parse or (comma_ints if typing.get_origin(base) is tuple else base))(value)
        except (ValueError, argparse.ArgumentTypeError):
            raise _Expected(_what(base, field)) from None
    if typing.get_origin(base) is tuple:
        return _typed_tuple(base, value, field)
    if base is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if base is str and isinstance(value, str):
        return value
    raise _Expected(_what(base, field))


def _typed_tuple(base, value, field) -> Tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise _Expected(_what(base, field))
    length = _length(base)
    if length is not None and len(value) != length:
        raise _Expected(_what(base, field))
    return tuple(value)


def _base_type(hint) -> Tuple[Any, bool]:
    """(X, whether None is allowed) for a field typed X or Optional[X]."""
    if typing.get_origin(hint) is typing.Union:
        args = typing.get_args(hint)
        return next(a for a in args if a is not type(None)), type(None) in args
    return hint, False


def _length(tuple_type) -> Optional[int]:
    args = typing.get_args(tuple_type)
    return None if Ellipsis in args else len(args)


def _what(base, field) -> str:
    if typing.get_origin(base) is tuple:
        length = _length(base)
        count = "integers" if length is None else f"{length} integers"
        return f"a list of {count} (or the flag's text, e.g. \"{','.join(['1'] * (length or 2))}\")"
    names = {int: "an integer", float: "a number", str: "a string"}
    return names.get(base, f"what {field.name}'s flag takes")


def _shown(value) -> str:
    """A value as the file spelled it (TOML and JSON agree on these)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def run_config(run_dir: str) -> Dict[str, Any]:
    """The options a run in ``run_dir`` was started with (its config.json), for resuming it."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):
        what = "does not exist" if not os.path.isdir(run_dir) else "has no config.json (not a jaxdp run directory)"
        raise TrainError(f"--resume {run_dir}: {what}")
    return load(path, drop=NOT_INHERITED, flag="--resume")


def _read(path: str, flag: str):
    if not os.path.isfile(path):
        raise TrainError(f"{flag} {path}: no such file")
    ext = os.path.splitext(path)[1].lower()
    parse = {".toml": _toml, ".json": _json, ".yaml": _yaml, ".yml": _yaml}.get(ext)
    if parse is None:
        raise TrainError(f"{flag} {path}: unknown format {ext or '(no extension)'}; use .toml, .json or .yaml")
    try:
        return parse(path)
    except TrainError:
        raise
    except Exception as e:  # the parser's syntax error: say where, in one line
        raise TrainError(f"{flag} {path}: {type(e).__name__}: {e}".replace("\n", " ")) from None


def _json(path: str):
    with open(path) as f:
        return json.load(f)


def _yaml(path: str):
    try:
        import yaml  # PyYAML: not a jaxdp dependency, only a .yaml config file needs it
    except ImportError:
        raise TrainError(f"--config {path}: YAML needs PyYAML (pip install pyyaml), or use .toml") from None
    with open(path) as f:
        return yaml.safe_load(f)


def _toml(path: str):
    with open(path, "rb") as f:
        return tomllib.load(f)
