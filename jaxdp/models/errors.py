"""The error for a model option that does not exist: its own module, so the layers that
raise it (``batchnorm``) and the package that builds models both import it, not each other."""


class ModelError(ValueError):
    """A model option the user chose does not exist."""
