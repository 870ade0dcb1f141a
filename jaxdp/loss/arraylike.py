"""What jaxdp takes for an array where a user's value may be anything (a loss's output, a batch, a
model's output): a value with a shape and a dtype. Imports nothing, so torch's side reads it too."""


def is_array(x) -> bool:
    """``x`` has a shape and a dtype: a jax or numpy array, a tracer, or an abstract ``jax.ShapeDtypeStruct``."""
    return hasattr(x, "shape") and hasattr(x, "dtype")
