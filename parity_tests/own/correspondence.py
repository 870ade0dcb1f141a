"""Which torch tensor is which Flax variable, for a pair: jaxdp's converter (``jaxdp.interop``:
HF transformers' rules, derived from the torch model's modules and both models' names and
shapes, overridable where they cannot match), its refusals in the harness's words, and the
check that both sides cut their FSDP units alike.

docs/porting-weights.md has the rules; ``ModelPair.correspondence`` is the converter's
``override``. The harness compares a torch buffer or frozen parameter (a value that does not
train) as a value, and keeps a Flax param of that kind out of jaxdp's params
(``parity_tests.own.non_trainable``).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence

from jaxdp.interop import LAYOUTS, Correspondence, Key, Layout  # noqa: F401  (LAYOUTS, Layout: parity_tests.own's names)
from jaxdp.interop import CorrespondenceError as ConverterError
from jaxdp.interop import derive as derive_correspondence
from jaxdp.interop.matching import Unmatched
from parity_tests.own.pair import PairError


class CorrespondenceError(PairError, ConverterError):
    """Torch and Flax variables that do not correspond one to one, as the harness refuses them: a
    ``PairError`` (one line, before anything runs) and the converter's own error."""


def derive(torch_model, flax_variables: Mapping[str, Any], override=None,
           flax_classes: Optional[Mapping[Sequence[str], type]] = None) -> Correspondence:
    """``jaxdp.interop.derive``, its refusal a ``PairError`` that says how a pair maps what is unmatched."""
    try:
        return derive_correspondence(torch_model, flax_variables, override, flax_classes)
    except Unmatched as e:
        raise CorrespondenceError(f"{e.problems} (map them with ModelPair(correspondence={{torch name: "
                                  "'collection/flax/path' | (path, layout) | None}))") from None


def check_round_trip(corr: Correspondence, state_dict: Mapping[str, Any]) -> None:
    """``Correspondence.check_round_trip``, its refusal a ``PairError``."""
    try:
        corr.check_round_trip(state_dict)
    except ConverterError as e:
        raise CorrespondenceError(str(e)) from None


def check_units(corr: Correspondence, flax_units: Sequence[Key], torch_units: Sequence[str]) -> Optional[str]:
    """None if the two sides' FSDP units hold the same parameters (through ``corr``), else one line
    naming a parameter the two cut differently. ``flax_units``: module paths (tuples);
    ``torch_units``: module names."""
    def unit_of_torch(name: str) -> Optional[str]:
        return next((u for u in torch_units if name.startswith(u + ".")), None)

    def unit_of_flax(key: Key) -> Optional[str]:
        path = key[1:]
        return next(("/".join(u) for u in flax_units if path[:len(u)] == tuple(u)), None)

    torch_groups: Dict[Optional[str], set] = {}
    flax_groups: Dict[Optional[str], set] = {}
    for link in corr.links:
        if not link.trains:  # a value that does not train: no FSDP unit shards it on jaxdp's side
            continue
        torch_groups.setdefault(unit_of_torch(link.torch), set()).add(link.torch)
        flax_groups.setdefault(unit_of_flax(link.flax), set()).add(link.torch)
    params = [link for link in corr.links if link.trains]
    differ = [link for link in params
              if torch_groups[unit_of_torch(link.torch)] != flax_groups[unit_of_flax(link.flax)]]
    if not differ:
        return None
    # name a parameter that one side keeps in a unit and the other in the root, if there is one
    link = next((k for k in differ if (unit_of_torch(k.torch) is None) != (unit_of_flax(k.flax) is None)), differ[0])
    t, f = unit_of_torch(link.torch), unit_of_flax(link.flax)
    where = lambda u: f"unit {u}" if u else "the root"  # noqa: E731
    return (f"the FSDP units cut the two models differently: torch keeps {link.torch} in {where(t)} "
            f"({len(torch_groups[t])} params), Flax keeps {link.flax_name} in {where(f)} ({len(flax_groups[f])} "
            f"params); units: torch {list(torch_units) or 'none'}, flax {['/'.join(u) for u in flax_units] or 'none'}")
