"""ResNet-18/34/50 in plain PyTorch, with torchvision's architecture and state_dict keys,
and ``create_model``, the factory for every model here (the ViTs live in ``vit.py``).

This is the reference side of the parity tests. It follows
``torchvision.models.resnet`` layer for layer (so a torchvision ``state_dict``
loads with ``strict=True``), with two options torchvision lacks: ``width`` (the
first stage's channels, 64 in torchvision) and ``blocks`` (blocks per stage) for
tiny test variants, and ``stem="cifar"`` (3x3/1 convolution, no max-pool) for
32x32 inputs. torchvision itself is not a dependency.

The names, each family's options and their one-line errors (``create_model``'s) are those of
``jaxdp.models.create_model``: both read the model table, ``jaxdp.names``, which imports no JAX,
so torch processes (torchrun ranks, benchmarks) do not have to.
"""

from typing import Optional, Sequence

import torch
from torch import nn

from jaxdp import names
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


# The model table's rows (jaxdp.names) as torch builds them.
BLOCKS = {"basic": BasicBlock, "bottleneck": Bottleneck}
ARCHITECTURES = {name: (BLOCKS[size["block"]], size["stages"]) for name, size in names.RESNET.models.items()}
VIT_ARCHITECTURES = vit.CONFIGS
MODELS = names.MODELS
FAMILIES = {name: f.name for f in names.FAMILIES for name in f.models}
STEMS = names.STEMS


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
    block, layers = names.resnet_size(name, width, blocks, stem)
    return ResNet(BLOCKS[block], layers, num_classes=num_classes, width=width, stem=stem)


# The module classes torch_ref.strategies fully_shards as FSDP units, every family's.
FSDP_UNITS = (BasicBlock, Bottleneck) + vit.FSDP_UNITS


def create_model(name: str = "resnet18", *, num_classes: int = 10, width: int = 64,
                 blocks: Optional[Sequence[int]] = None, stem: str = "cifar",
                 depth: Optional[int] = None, dim: Optional[int] = None,
                 heads: Optional[int] = None, mlp_dim: Optional[int] = None,
                 patch: Optional[int] = None, image_size: Optional[int] = None) -> nn.Module:
    """Any model in MODELS (float32), with ``jaxdp.models.create_model``'s options and
    errors (``jaxdp.names.ModelError``, a ValueError): ``width``/``blocks``/``stem`` for a ResNet,
    ``depth``/``dim``/``heads``/``mlp_dim``/``patch``/``image_size`` for a ViT."""
    given = dict(width=width, blocks=blocks, stem=stem, depth=depth, dim=dim, heads=heads,
                 mlp_dim=mlp_dim, patch=patch, image_size=image_size)
    return _BUILDERS[names.check_options(name, given).name](name, given, num_classes)


def _create_resnet(name, given, num_classes) -> ResNet:
    return resnet(name, num_classes=num_classes, width=given["width"], blocks=given["blocks"], stem=given["stem"])


def _create_vit(name, given, num_classes) -> nn.Module:
    return vit.VisionTransformer(num_classes=num_classes, **names.vit_size(name, given))


_BUILDERS = {names.RESNET.name: _create_resnet, names.VIT.name: _create_vit}  # each family of jaxdp.names


__all__ = ["ARCHITECTURES", "FAMILIES", "FSDP_UNITS", "MODELS", "STEMS", "VIT_ARCHITECTURES",
           "BasicBlock", "Bottleneck", "ResNet", "create_model", "resnet"]
