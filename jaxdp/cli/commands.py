"""A ``jaxdp`` subcommand is a ``Command``: jaxdp's own are listed in ``jaxdp.cli.command``
(``BUILT_IN``: train, launch, inspect, plan); other packages add theirs through entry points.

``jaxdp parity``, ``jaxdp bench`` and ``jaxdp export`` run PyTorch beside jaxdp, so they live
with the torch side (``parity_tests``, ``torch_commands``) and need the [torch] extra; jaxdp
itself never imports them. A package registers a ``Command`` under the entry-point group
``jaxdp.commands``::

    [project.entry-points."jaxdp.commands"]
    parity = "parity_tests.command:PARITY"

The module it names must import neither jax nor torch (the parser is built before
``--devices`` reaches XLA). If a module the command ``requires`` is missing, the command is
still listed, and running it says in one line what to install.
"""

import importlib.util
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Callable, Collection, Dict, Tuple

GROUP = "jaxdp.commands"


class CommandError(ValueError):
    """A registered command refused its options: one line on the command line, exit 2."""


@dataclass(frozen=True)
class Command:
    summary: str  # one line, for ``jaxdp --help``
    add_args: Callable  # (argparse.ArgumentParser) -> None
    run: Callable  # (argparse.Namespace) -> exit status
    requires: Tuple[str, ...] = ()  # top-level modules it imports when it runs, e.g. ("torch",)
    extra: str = "torch"  # the jaxdp extra that installs them

    def missing(self) -> Tuple[str, ...]:
        return tuple(name for name in self.requires if not _importable(name))

    def install_hint(self, name: str) -> str:
        return (f"jaxdp {name} needs the [{self.extra}] extra (not installed: {', '.join(self.missing())}): "
                f"pip install 'jaxdp[{self.extra}]'")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or blocked install
        return False


def registered(skip: Collection[str] = ()) -> Dict[str, Command]:
    """The installed packages' commands, by name; those named in ``skip`` (jaxdp's own) are not
    loaded, so an entry point left by an older install cannot shadow or break them."""
    found = sorted((ep for ep in entry_points(group=GROUP) if ep.name not in skip), key=lambda ep: ep.name)
    return {ep.name: ep.load() for ep in found}
