"""ResNet-18/34/50 in plain PyTorch, with torchvision's architecture and state_dict keys,
and ``create_model``, the factory for every model here (the ViTs live in ``vit.py``).

This is the reference side of the parity tests. It follows
``torchvision.models.resnet`` layer for layer (so a torchvision ``state_dict``
loads with ``strict=True``), with two options torchvision lacks: ``width`` (the
first stage's channels, 64 in torchvision) and ``blocks`` (blocks per stage) for
tiny test variants, and ``stem="cifar"`` (3x3/1 convolution, no max-pool) for
32x32 inputs. torchvision itself is not a dependency.

The choices and their error messages (``create_model``'s) are those of
``jaxdp.models.create_model``.
They are spelled out again here rather than imported, so that torch processes
(torchrun ranks, benchmarks) do not have to import JAX; ``tests/test_interop.py``
checks that the two lists agree.
"""

from typing import Optional, Sequence

import torch
from torch import nn

from torch_ref import vit


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, 3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: Optional[nn.Module] = None):
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """torchvision's ResNet v1.5 bottleneck: the stride sits on the 3x3 convolution
    (v1 of the paper put it on the first 1x1)."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: Optional[nn.Module] = None):
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


ARCHITECTURES = {
    "resnet18": (BasicBlock, (2, 2, 2, 2)),
    "resnet34": (BasicBlock, (3, 4, 6, 3)),
    "resnet50": (Bottleneck, (3, 4, 6, 3)),
}
VIT_ARCHITECTURES = vit.CONFIGS
MODELS = tuple(ARCHITECTURES) + tuple(VIT_ARCHITECTURES)
FAMILIES = {**{n: "resnet" for n in ARCHITECTURES}, **{n: "vit" for n in VIT_ARCHITECTURES}}
STEMS = ("cifar", "imagenet")


class ResNet(nn.Module):
    def __init__(self, block, layers: Sequence[int], num_classes: int = 10,
                 width: int = 64, stem: str = "cifar"):
        super().__init__()
        self.inplanes = width
        if stem == "imagenet":
            self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        else:
            self.conv1 = conv3x3(3, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        # At 32x32 a 3x3/2 max-pool would throw away three quarters of the image
        # before the first block; Identity keeps the module (and the key order) the same.
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1) if stem == "imagenet" else nn.Identity()
        self.layer1 = self._make_layer(block, width, layers[0])
        self.layer2 = self._make_layer(block, width * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(block, width * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(block, width * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * block.expansion, num_classes)

        # torchvision's init. nn.Linear keeps its own default, U(+-1/sqrt(fan_in)).
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, block, planes: int, num_blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * block.expansion, stride),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, num_blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


def resnet(name: str = "resnet18", num_classes: int = 10, width: int = 64,
           blocks: Optional[Sequence[int]] = None, stem: str = "cifar") -> ResNet:
    """Build a torchvision-layout ResNet (float32; call ``.double()`` for parity runs).

    ``resnet("resnet18", num_classes=1000, stem="imagenet")`` is
    ``torchvision.models.resnet18()`` exactly, state_dict keys included.
    """
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(ARCHITECTURES)}")
    if stem not in STEMS:
        raise ValueError(f"unknown stem {stem!r}; choose one of {', '.join(STEMS)}")
    if width < 1:
        raise ValueError(f"width must be positive, got {width}")
    block, layers = ARCHITECTURES[name]
    if blocks is not None:
        if len(blocks) != 4 or min(blocks) < 1:
            raise ValueError(f"blocks must be four positive counts, got {tuple(blocks)}")
        layers = tuple(blocks)
    return ResNet(block, layers, num_classes=num_classes, width=width, stem=stem)


# Each family's own options with their defaults; the other family's are refused unless
# left at their defaults (as in jaxdp.models, whose messages these are).
_RESNET_OPTIONS = {"width": 64, "blocks": None, "stem": "cifar"}
_VIT_OPTIONS = ("depth", "dim", "heads", "mlp_dim", "patch", "image_size")

# The module classes torch_ref.strategies fully_shards as FSDP units, every family's.
FSDP_UNITS = (BasicBlock, Bottleneck) + vit.FSDP_UNITS


def _positive(option: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{option} must be a positive integer, got {value!r}")
    return value


def create_model(name: str = "resnet18", *, num_classes: int = 10, width: int = 64,
                 blocks: Optional[Sequence[int]] = None, stem: str = "cifar",
                 depth: Optional[int] = None, dim: Optional[int] = None,
                 heads: Optional[int] = None, mlp_dim: Optional[int] = None,
                 patch: Optional[int] = None, image_size: Optional[int] = None) -> nn.Module:
    """Any model in MODELS (float32), with ``jaxdp.models.create_model``'s options and
    errors (ValueError here): ``width``/``blocks``/``stem`` for a ResNet,
    ``depth``/``dim``/``heads``/``mlp_dim``/``patch``/``image_size`` for a ViT."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    given = dict(width=width, blocks=blocks, stem=stem, depth=depth, dim=dim, heads=heads,
                 mlp_dim=mlp_dim, patch=patch, image_size=image_size)
    if FAMILIES[name] == "resnet":
        for option in _VIT_OPTIONS:
            if given[option] is not None:
                raise ValueError(f"{option}={given[option]!r} does not apply to {name}; "
                                 f"ResNet options: width, blocks, stem")
        return resnet(name, num_classes=num_classes, width=width, blocks=blocks, stem=stem)
    for option, default in _RESNET_OPTIONS.items():
        if given[option] != default:
            raise ValueError(f"{option}={given[option]!r} does not apply to {name}; "
                             f"ViT options: {', '.join(_VIT_OPTIONS)}")
    config = {**VIT_ARCHITECTURES[name], "image_size": 32}
    config.update({k: _positive(k, given[k]) for k in _VIT_OPTIONS if given[k] is not None})
    if config["dim"] % config["heads"]:
        raise ValueError(f"dim {config['dim']} must be divisible by heads {config['heads']}")
    if config["image_size"] % config["patch"]:
        raise ValueError(f"image_size {config['image_size']} must be divisible by patch {config['patch']}")
    return vit.VisionTransformer(num_classes=num_classes, **config)


__all__ = ["ARCHITECTURES", "FAMILIES", "FSDP_UNITS", "MODELS", "STEMS", "VIT_ARCHITECTURES",
           "BasicBlock", "Bottleneck", "ResNet", "create_model", "resnet"]
