"""The error for a model option that does not exist, and the key listing of a state_dict
that does not match: their own module, so the layers that raise them (``batchnorm``, the
``torch_names`` grammars) and the package that builds models all import it, not each other.
(``ModelError`` itself is the model table's, ``jaxdp.names``: torch_ref raises it too.)"""

from jaxdp.names import ModelError  # noqa: F401  (re-exported: the models' error)


def key_listing(keys, limit: int = 12) -> str:
    """The first ``limit`` keys, and how many more: an error names what is wrong without a wall of keys."""
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def key_mismatch(what: str, model: str, missing, unexpected) -> ValueError:
    """The one-line error for a state_dict (``what``) whose keys are not ``model``'s."""
    parts = []
    if missing:
        parts.append(f"missing keys: {key_listing(missing)}")
    if unexpected:
        parts.append(f"unexpected keys: {key_listing(unexpected)}")
    if unexpected and all(k.startswith("module.") for k in unexpected):
        parts.append("(a DDP/DataParallel state_dict? take model.module.state_dict())")
    return ValueError(f"{what} does not match {model}: {'; '.join(parts)}")
