"""Where a forward first differs: when the losses part at step 0, both models run the first
micro-batch once more, in float64, from the shared initial weights, and every module's
output is compared in the order torch finishes them (a module after its submodules). The
first module whose output differs is where the two ports disagree; if every module's output
agrees, the losses themselves differ.

A torch module and a Flax module correspond when their paths do (``a.b.0.c`` and
``a/b_0/c``, ``correspondence.spellings``) or when a linked tensor says so. Outputs are
compared as they are, or channels-first against channels-last (a convolution's NCHW
against NHWC); others are skipped.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from parity_tests.compare import errors
from parity_tests.own import nnx_pair
from jaxdp.interop import normalized, spellings
from parity_tests.own.outputs import arrays

BOUND = 1e-10  # float64's


@dataclass
class Finding:
    module: Optional[str]     # torch's name ("" is the whole model), None if every output agrees
    flax: Optional[str]
    rel_err: float
    compared: int             # modules compared up to and including it

    def message(self) -> str:
        if self.module is None:
            return (f"every one of the {self.compared} corresponding modules' outputs agrees in float64 at step 0: "
                    "the losses differ (the loss functions, or code outside the modules)")
        name = self.module or "the whole model"
        before = self.compared - 1
        return (f"the first module whose output differs (float64, step 0's first micro-batch, the shared initial "
                f"weights): torch {name} <-> flax {self.flax or '/'} (rel err {self.rel_err:.1e}; "
                f"{before} module{'s' if before != 1 else ''} finished before it agree{'s' if before == 1 else ''})")


def first_difference(setup, run) -> Finding:
    """The first torch module (in the order torch finishes them) whose output differs from its Flax twin's."""
    torch_out = _torch_outputs(setup, run)
    flax_out = _flax_outputs(setup, run)
    by_path = {spelt: path for path in flax_out for spelt in reversed(spellings(path))}
    for link in setup.corr.links:  # a user's mapping of a module's tensors maps the module
        torch_module = link.torch.rsplit(".", 1)[0] if "." in link.torch else ""
        by_path.setdefault(normalized([torch_module]), tuple(link.flax[1:-1]))
    compared = 0
    for name, t in torch_out:
        path = by_path.get(normalized([name]))
        if path is None or path not in flax_out:
            continue
        layouts = _comparable(flax_out[path], t)
        if not layouts:
            continue
        compared += 1
        rel = min(errors(f, t)[1] for f in layouts)
        if rel > BOUND:
            return Finding(name, "/".join(path), rel, compared)
    return Finding(None, None, 0.0, compared)


def _micro_batch(setup, run) -> Dict[str, np.ndarray]:
    rows = run.batch_per_device // run.accum_steps
    return {k: np.asarray(v[:rows]).astype(np.float64) if np.issubdtype(np.asarray(v).dtype, np.floating)
            else np.asarray(v[:rows]) for k, v in setup.batches[0].items()}


def _torch_outputs(setup, run) -> List[Tuple[str, np.ndarray]]:
    import torch

    model = copy.deepcopy(setup.pair.torch_model).double().train()
    model.load_state_dict({k: torch.as_tensor(np.asarray(v)).double() if np.issubdtype(np.asarray(v).dtype, np.floating)
                           else torch.as_tensor(np.asarray(v)) for k, v in setup.state_dict.items()}, strict=False)
    outputs: List[Tuple[str, np.ndarray]] = []
    seen = set()

    def hook(name):
        def record(module, args, out):
            t = _first_tensor(out)
            if t is not None and name not in seen:
                seen.add(name)
                outputs.append((name, t.detach().cpu().double().numpy()))
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()]
    batch = {k: torch.from_numpy(v) if v.dtype == np.float64 else torch.from_numpy(v).long()
             for k, v in _micro_batch(setup, run).items()}
    args, kwargs = setup.pair.arguments("torch", batch)
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return outputs


def _flax_outputs(setup, run) -> Dict[Tuple[str, ...], np.ndarray]:
    import jax

    from parity_tests.own.jax_pair import flax_model_at

    with jax.enable_x64(True):
        model = flax_model_at(setup.pair.flax_model, "float64")
        variables = setup.corr.to_flax(setup.state_dict, np.float64)
        if nnx_pair.is_nnx(model):
            module = nnx_pair.with_weights(model, variables)
            return {path: np.asarray(_first_tensor(v), np.float64)
                    for path, v in nnx_pair.outputs(setup.pair, module, _micro_batch(setup, run)).items()
                    if _first_tensor(v) is not None}
        state = [c for c in variables if c != "params"]
        args, kwargs = setup.pair.arguments("flax", _micro_batch(setup, run))
        _, captured = model.apply(variables, *args, capture_intermediates=True, mutable=["intermediates", *state],
                                  **kwargs)
        captured = jax.device_get(captured["intermediates"])
    out: Dict[Tuple[str, ...], np.ndarray] = {}
    _collect(captured, (), out)
    return out


def _collect(tree, path: Tuple[str, ...], out) -> None:
    for key, value in tree.items():
        if key == "__call__":
            t = _first_tensor(value)
            if t is not None:
                out[path] = np.asarray(t, np.float64)
        elif isinstance(value, dict):
            _collect(value, path + (key,), out)


def _first_tensor(x) -> Any:
    """A module's output: its first floating array, whatever holds it (a tuple, HF's ModelOutput, ...)."""
    return next((t for t in arrays(x) if _floating(t)), None)


def _floating(t) -> bool:
    if hasattr(t, "is_floating_point"):  # a torch tensor
        return t.is_floating_point()
    return np.issubdtype(t.dtype, np.floating)


def _comparable(flax_value: np.ndarray, torch_value: np.ndarray) -> List[np.ndarray]:
    """The Flax output in each layout that has torch's shape: as it is, channels last moved first
    (both, when the shape cannot tell: NHWC and NCHW of 8 x 8 x 8; the closer one counts)."""
    layouts = [flax_value] if flax_value.shape == torch_value.shape else []
    if torch_value.ndim >= 3 and np.moveaxis(flax_value, -1, 1).shape == torch_value.shape:
        layouts.append(np.moveaxis(flax_value, -1, 1))  # channels last -> channels first
    return layouts
