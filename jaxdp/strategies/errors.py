"""The one error every strategy module raises: an option or batch shape that cannot work."""


class StrategyError(ValueError):
    """A strategy option or batch shape that cannot work."""
