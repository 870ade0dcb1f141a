"""A model's outputs as it returns them, walked without changing their type: tuples, lists,
namedtuples, dicts and their subclasses (Hugging Face's ``ModelOutput``), dataclasses (frozen
too: ``flax.struct.dataclass``). So ``outputs[0]``, ``outputs.logits`` and ``outputs["logits"]``
work in a pair's loss whatever the harness did to the arrays inside (bfloat16's cast to
float32), on both sides.

Framework-free: an array is anything with a shape and a ``dtype`` (``jaxdp.loss.arraylike``, which imports nothing).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Iterator

from jaxdp.loss.arraylike import is_array


def map_arrays(x: Any, fn: Callable[[Any], Any]) -> Any:
    """``x`` with ``fn`` applied to every array in it, every container keeping its type."""
    if is_array(x):
        return fn(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        # a dataclass, HF's ModelOutput (an OrderedDict too) included: rebuilt through its own __init__
        return dataclasses.replace(x, **{f.name: map_arrays(getattr(x, f.name), fn)
                                         for f in dataclasses.fields(x) if f.init})
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple takes its fields one by one
        return type(x)(*(map_arrays(v, fn) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(map_arrays(v, fn) for v in x)
    if isinstance(x, Mapping):
        out = copy.copy(x)  # keeps a dict subclass's type and attributes; the values replaced below
        for key, value in x.items():
            out[key] = map_arrays(value, fn)
        return out
    return x


def arrays(x: Any) -> Iterator[Any]:
    """Every array in ``x``, in the order the model returned them (a dict's in its order)."""
    if is_array(x):
        yield x
    elif isinstance(x, Mapping):
        for value in x.values():
            yield from arrays(value)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            yield from arrays(getattr(x, f.name))
    elif isinstance(x, (tuple, list)):
        for value in x:
            yield from arrays(value)

