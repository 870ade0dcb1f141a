"""Which of torch's module classes a module is, read without importing torch.

jaxdp stays torch-free (``tests/test_structure.py``), yet the converter's rules depend on a
torch module's class (a ``Linear``'s weight is transposed, a ``Conv2d``'s permuted). A class is
recognised by its name and by its being defined in ``torch.nn``: the module's class or any of
its bases, which is what ``isinstance(module, torch.nn.Linear)`` asks.
"""

from __future__ import annotations

from typing import Any


def is_torch(module: Any, *names: str) -> bool:
    """``isinstance(module, torch.nn.<one of names>)``, without torch."""
    return any(cls.__name__ in names and cls.__module__.startswith("torch.nn.") for cls in type(module).__mro__)
