"""torchvision's ResNets, recorded: state_dict names and shapes, and float64 logits for fixed
weights and input, so that torch_ref's ResNets are checked against torchvision on every run.

Why recorded: torchvision from PyPI does not import beside the CPU build of torch 2.13.0
that this project pins ("operator torchvision::nms does not exist"), and the pair that does
(torch 2.14.1 + torchvision 0.29.1) is a 5.5 GB CUDA build. The test compares against this
record always, and against a live torchvision where one imports.

Regenerate (any torch/torchvision pair that imports together)::

    python -m venv /tmp/tv && /tmp/tv/bin/pip install torch==2.14.1 torchvision==0.29.1 numpy
    PYTHONPATH=. /tmp/tv/bin/python tests/torchvision_reference.py

The weights come from numpy (``fixed_state_dict``), not from torch's RNG, so both sides of
the comparison can build them, whatever torch version runs; float64 makes the logits agree
to rounding (~1e-15) across kernels and versions.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Dict, Mapping, Sequence, Tuple

import numpy as np

RECORD = Path(__file__).parent / "data" / "torchvision_resnets.json"
MODELS = ("resnet18", "resnet34", "resnet50")
NUM_CLASSES = 10
INPUT_SHAPE = (2, 3, 64, 64)


def fixed_state_dict(shapes: Mapping[str, Sequence[int]]) -> Dict[str, np.ndarray]:
    """Deterministic float64 weights for ``{name: shape}``, each from a generator seeded by its
    name: convs and linears He-scaled (activations stay O(1) through 50 layers), BN weights
    and biases near 1 and 0, running stats a positive variance and a small mean."""
    out = {}
    for name, shape in shapes.items():
        if name.endswith("num_batches_tracked"):
            continue
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        if name.endswith("running_var"):
            out[name] = rng.uniform(0.5, 1.5, shape)
        elif name.endswith(("running_mean", "bias")):
            out[name] = 0.1 * rng.standard_normal(shape)
        elif len(shape) == 1:  # BN weight
            out[name] = rng.uniform(0.5, 1.5, shape)
        else:
            fan_in = int(np.prod(shape[1:]))
            out[name] = rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)
    return out


def fixed_input() -> np.ndarray:
    return np.random.default_rng(0).standard_normal(INPUT_SHAPE)


def logits(model, shapes: Mapping[str, Sequence[int]]) -> np.ndarray:
    """``model`` (a torch ResNet) with the fixed weights, in float64 eval mode, on the fixed input."""
    import torch

    model = model.double().eval()
    sd = {k: torch.from_numpy(v) for k, v in fixed_state_dict(shapes).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all(k.endswith("num_batches_tracked") for k in missing), (missing, unexpected)
    with torch.no_grad():
        return model(torch.from_numpy(fixed_input())).numpy()


def shapes_of(model) -> Dict[str, Tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def load() -> dict:
    return json.loads(RECORD.read_text())


def main() -> None:
    import torch
    import torchvision

    record = {"torch": torch.__version__, "torchvision": torchvision.__version__,
              "num_classes": NUM_CLASSES, "input_shape": list(INPUT_SHAPE), "models": {}}
    for name in MODELS:
        tv = getattr(torchvision.models, name)(num_classes=NUM_CLASSES)
        shapes = shapes_of(tv)
        record["models"][name] = {
            "state_dict": [[k, list(s)] for k, s in shapes.items()],
            "logits": logits(tv, shapes).tolist(),
        }
    RECORD.parent.mkdir(exist_ok=True)
    RECORD.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {RECORD} (torch {torch.__version__}, torchvision {torchvision.__version__})")


if __name__ == "__main__":
    main()
