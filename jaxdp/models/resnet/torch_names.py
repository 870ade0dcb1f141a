"""The ResNet's torch names: torchvision's ``state_dict`` keys, their order, and the check
that a state_dict (or a variable tree named the torch way) is a torchvision ResNet.

The Flax tree mirrors torchvision's module tree, so a key is the Flax path joined with dots,
with the leaf renamed (``jaxdp.interop``: ``kernel``/``scale`` <-> ``weight``, ``mean``/``var``
<-> ``running_mean``/``running_var``; the array layouts are there too). Names only.
"""

import re
from typing import List, Tuple

from jaxdp.models.errors import key_mismatch

NBT = "num_batches_tracked"  # torch's BN counter: every BN has one, jaxdp keeps none


def infer(names) -> Tuple[bool, Tuple[int, ...]]:
    """(bottleneck?, blocks per stage) from the keys themselves. A stage with no
    keys at all counts as one block, so its keys are reported missing."""
    bottleneck = any(n.startswith("layer1.0.conv3.") for n in names)
    sizes = []
    for stage in range(1, 5):
        idx = [int(m.group(1)) for n in names if (m := re.match(rf"layer{stage}\.(\d+)\.", n))]
        sizes.append(max(idx) + 1 if idx else 1)
    return bottleneck, tuple(sizes)


def state_dict_keys(bottleneck: bool, blocks) -> List[str]:
    """Every key of a torchvision ResNet's state_dict, in torchvision's order."""
    keys: List[str] = []

    def conv(name):
        keys.append(f"{name}.weight")

    def bn(name):
        keys.extend(f"{name}.{leaf}" for leaf in ("weight", "bias", "running_mean", "running_var", NBT))

    conv("conv1")
    bn("bn1")
    for stage, n in enumerate(blocks, start=1):
        for b in range(n):
            p = f"layer{stage}.{b}"
            for i in range(1, 4 if bottleneck else 3):
                conv(f"{p}.conv{i}")
                bn(f"{p}.bn{i}")
            # Block 0 changes shape (stride 2 from stage 2 on; 4x channels in a
            # bottleneck's stage 1), so only it carries a projection shortcut.
            if b == 0 and (stage > 1 or bottleneck):
                conv(f"{p}.downsample.0")
                bn(f"{p}.downsample.1")
    keys += ["fc.weight", "fc.bias"]
    return keys


def check_keys(names, what: str) -> List[str]:
    """Raise ValueError (one line) naming the missing and unexpected keys; return
    the expected keys in torchvision's order. ``num_batches_tracked`` is optional."""
    names = set(names)
    bottleneck, blocks = infer(names)
    expected = state_dict_keys(bottleneck, blocks)
    missing = [k for k in expected if k not in names and not k.endswith(NBT)]
    unexpected = sorted(names - set(expected))
    if missing or unexpected:
        arch = f"{'Bottleneck' if bottleneck else 'BasicBlock'} ResNet with blocks {blocks}"
        raise key_mismatch(what, f"a torchvision {arch}", missing, unexpected)
    return expected


def torchvision_order(names) -> List[str]:
    """Sort torch names as torchvision's state_dict lists them (unknown names last)."""
    rank = {k: i for i, k in enumerate(state_dict_keys(*infer(names)))}
    return sorted(names, key=lambda k: (rank.get(k, len(rank)), k))
