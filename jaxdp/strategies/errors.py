"""The errors the strategy modules raise: an option or batch shape that cannot work, and FSDP units that cannot."""


class StrategyError(ValueError):
    """A strategy option or batch shape that cannot work."""


class UnitError(ValueError):
    """The FSDP unit specification matches nothing, or is malformed."""
