"""Weight conversion between torch ``state_dict``s and Flax models (Linen or NNX), exact both ways.

- ``derive(torch_model, flax_variables)``: which torch tensor is which Flax variable, by the
  rules HF transformers converts by (``rules``; tied weights, HF's ``Conv1D``, transposes,
  buffers, names), overridable where they cannot match (``matching``), as a ``Correspondence``;
- ``Correspondence.to_flax(state_dict)`` / ``.to_torch(variables)``: the copies (``correspondence``),
  through each tensor's ``Layout`` (``layouts``);
- ``load_torch_weights`` / ``torch_state_dict``: the two in one call, for a Linen model's
  variables or an NNX module (``convert``);
- jaxdp's own ResNet and ViT: correspondences from their key grammars, and the functions
  their users call (``builtin``: ``variables_from_state_dict``, ``state_dict_from_variables``,
  ``tree_to_torch_names``, ...).

docs/porting-weights.md shows it on HF's GPT-2. No torch import anywhere here: a torch model is
read through its own methods, a tensor through ``.detach().cpu().numpy()``.
"""

from jaxdp.interop.builtin import (
    correspondence,
    param_name_map,
    resnet_state_dict_keys,
    state_dict_from_variables,
    tree_from_torch_names,
    tree_to_torch_names,
    variables_from_state_dict,
)
from jaxdp.interop.convert import load_torch_weights, torch_state_dict, trace_linen
from jaxdp.interop.correspondence import Correspondence, CorrespondenceError, Key, Link, flatten
from jaxdp.interop.layouts import LAYOUTS, Layout, as_numpy
from jaxdp.interop.matching import derive
from jaxdp.interop.rules import normalized, spellings

__all__ = [
    "LAYOUTS",
    "Correspondence",
    "CorrespondenceError",
    "Key",
    "Layout",
    "Link",
    "as_numpy",
    "correspondence",
    "derive",
    "flatten",
    "load_torch_weights",
    "normalized",
    "param_name_map",
    "resnet_state_dict_keys",
    "spellings",
    "state_dict_from_variables",
    "torch_state_dict",
    "trace_linen",
    "tree_from_torch_names",
    "tree_to_torch_names",
    "variables_from_state_dict",
]
