"""A training run's options from a file: ``jaxdp train --config run.toml`` (or .json, or
.yaml with PyYAML installed), and a run directory's own ``config.json`` for
``jaxdp train --resume RUN_DIR``. Flags on the command line override the file.

Keys are ``TrainConfig``'s field names (``global_batch_size`` or ``global-batch-size``);
an unknown key is an error that names it, as an unknown flag would be.
"""

import json
import os
import tomllib
from typing import Any, Dict, Iterable

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
            values[name] = tuple(value) if isinstance(value, list) else value
    return values


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
