"""The options a strategy is built with, checked in one place.

A strategy receives the config tree's typed options (``jaxdp.config.step.StrategyOptions``:
``jaxdp train`` hands over its parsed config itself), or option keywords
(``create_strategy(..., remat="none")``, ``jaxdp.ZeRO(remat="none")``, a registry row's fixed
options), or both. ``checked`` is the one check of them all, and the strategy keeps what it
returns (``strategy.options``):

- each option's value against its field's declaration (``choices``, ``at_least``): the one place
  ``remat``, ``allreduce``, ``compress``, ``staleness`` and ``accum_steps`` are validated;
- an option set (away from its default, or given as a keyword) that the strategy's name does not
  take (``Facts.takes``) is refused in one line, with the name's reason where it has one
  (``Facts.why_not``); so is an option the typed options set that a keyword fixes (a registry
  name's fixed options).
"""

import dataclasses
from typing import Any, Iterable, Mapping, Optional

from jaxdp.config.fields import declared
from jaxdp.config.flags import flag_name
from jaxdp.config.step import StrategyOptions
from jaxdp.strategies.errors import StrategyError

# Every strategy takes these; the others are the ones its facts list.
COMMON = ("accum_steps", "sync_bn")
FIELDS = {f.name: f for f in declared(StrategyOptions) if f.name != "strategy"}
DEFAULTS = StrategyOptions()  # the library's defaults (a config may declare others; what counts as set is these)


def checked(facts, options: Optional[StrategyOptions], keywords: Mapping[str, Any]) -> StrategyOptions:
    """``options`` (None: the defaults) with ``keywords`` (option fields) applied, once both are
    valid for the strategy ``facts`` describe; StrategyError in one line if not."""
    unknown = sorted(set(keywords) - set(FIELDS))
    if unknown:
        raise TypeError(f"{facts.name}: unexpected keyword {', '.join(unknown)} (not a strategy option)")
    given = set(keywords)
    if options is None:
        options = dataclasses.replace(DEFAULTS, strategy=facts.name)
    else:
        set_before = {name for name in FIELDS if getattr(options, name) != getattr(DEFAULTS, name)}
        fixed = sorted(set_before & given)  # the typed options set what a keyword (a name's fixed option) fixes
        if fixed:
            raise StrategyError(f"{flag_name(fixed[0])} does not apply to strategy {facts.name!r}: it is fixed to "
                                f"{keywords[fixed[0]]!r}")
        given |= set_before
    for name, field in FIELDS.items():
        _check_value(name, keywords[name] if name in keywords else getattr(options, name), field.metadata)
    refuse_untaken(facts, given)
    return dataclasses.replace(options, **keywords) if keywords else options


def refuse_untaken(facts, given: Iterable[str]) -> None:
    """StrategyError for the first of the ``given`` options (fields or keywords such as ``units``)
    that the strategy ``facts`` describe does not take."""
    for name in sorted(set(given) - set(COMMON) - set(facts.takes)):
        spelled = flag_name(name) if name in FIELDS else name
        reason = facts.why_not.get(name)
        raise StrategyError(f"{spelled} does not apply to strategy {facts.name!r}" + (f": {reason}" if reason else ""))


def _check_value(name: str, value, meta) -> None:
    choices, minimum = meta["choices"], meta["at_least"]
    if choices is not None and value is not None and value not in choices:
        raise StrategyError(f"{name} must be one of {', '.join(choices)}{meta['hint']}, got {value!r}")
    if minimum is not None and value is not None and value < minimum:
        raise StrategyError(f"{name} must be >= {minimum}, got {value}")
