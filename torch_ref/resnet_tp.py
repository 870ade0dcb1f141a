"""The torch twin of jaxdp's channel-parallel ResNet (``jaxdp/models/resnet/parallel.py``), by hand.

torch's tensor-parallel styles refuse ``Conv2d`` (``ColwiseParallel currently only support
nn.Linear and nn.Embedding``), so each basic block is split explicitly, Megatron's way: tp
rank j holds output channels ``[j*c, (j+1)*c)`` of ``conv1`` and of ``bn1`` (weight, bias,
running mean and var) and the same input channels of ``conv2``. Two autograd functions move
the activations, as Megatron's ``copy_to``/``reduce_from_tensor_model_parallel_region``:

- before ``conv1``, the identity in forward and an all-reduce of the input's gradient in
  backward (each rank's slice contributes part of it);
- after ``conv2``, an all-reduce of the partial output in forward and the identity in
  backward. torch's differentiable ``all_reduce`` would all-reduce the gradient too, which
  with a loss identical on every tp rank overcounts by the tp size (docs/design-notes.md, "Model parallelism on CPU").

The stem, ``bn2``, the shortcut and the head stay whole on every rank. State-dict keys are
unchanged; ``canonical`` gathers a split tensor over the tp group back to its full shape.
"""

from typing import Callable, Mapping, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from torch_ref.models import BasicBlock, resnet

# The split tensors of a block, by state-dict suffix: the torch (OIHW) dim each is cut along.
SPLIT_DIMS = {"conv1.weight": 0, "bn1.weight": 0, "bn1.bias": 0, "bn1.running_mean": 0, "bn1.running_var": 0,
              "conv2.weight": 1}


class _CopyToModelParallel(torch.autograd.Function):
    """Forward: the identity. Backward: the gradient summed over the tp group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromModelParallel(torch.autograd.Function):
    """Forward: the partial outputs summed over the tp group. Backward: the identity."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()  # all_reduce writes in place: never into the caller's tensor
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ChannelParallelBasicBlock(BasicBlock):
    """A ``BasicBlock`` holding this rank's slice of ``conv1``/``bn1`` output channels and of
    ``conv2``'s input channels (a BasicBlock still, so FSDP treats it as a unit)."""

    def __init__(self, block: BasicBlock, rank: int, size: int, group):
        nn.Module.__init__(self)
        planes = block.conv1.out_channels
        cut = slice(rank * planes // size, (rank + 1) * planes // size)
        self.conv1, self.bn1, self.relu = block.conv1, block.bn1, block.relu
        self.conv2, self.bn2, self.downsample, self.stride = block.conv2, block.bn2, block.downsample, block.stride
        with torch.no_grad():
            self.conv1.weight = nn.Parameter(block.conv1.weight[cut].clone())
            self.conv2.weight = nn.Parameter(block.conv2.weight[:, cut].clone())
            for name in ("weight", "bias"):
                setattr(self.bn1, name, nn.Parameter(getattr(block.bn1, name)[cut].clone()))
            for name in ("running_mean", "running_var"):
                setattr(self.bn1, name, getattr(block.bn1, name)[cut].clone())
        self.conv1.out_channels = self.conv2.in_channels = self.bn1.num_features = planes // size
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(_CopyToModelParallel.apply(x, self.group))))
        out = self.bn2(_ReduceFromModelParallel.apply(self.conv2(out), self.group))
        return self.relu(out + identity)


def parallelize_resnet(model: nn.Module, tp_mesh) -> None:
    """Channel parallelism over ``tp_mesh`` for every basic block of a torch_ref ResNet (in place)."""
    size, rank, group = tp_mesh.size(), tp_mesh.get_local_rank(), tp_mesh.get_group()
    for layer in (model.layer1, model.layer2, model.layer3, model.layer4):
        for i, block in enumerate(layer):
            if type(block) is not BasicBlock:
                raise ValueError(f"torch_ref's channel-parallel twin splits basic blocks only, not {type(block).__name__}")
            if block.conv1.out_channels % size:
                raise ValueError(f"{block.conv1.out_channels} channels do not split over tp={size}")
            layer[i] = ChannelParallelBasicBlock(block, rank, size, group)


def split_dim(name: str):
    """The dim ``name`` (a state-dict key) is cut along over tp, or None (whole on every rank)."""
    if not name.startswith("layer"):  # the stem's conv1/bn1 are whole
        return None
    return next((d for suffix, d in SPLIT_DIMS.items() if name.endswith("." + suffix)), None)


def canonical(name: str, t: torch.Tensor, group) -> np.ndarray:
    """``t`` as the unsplit model holds it: a split tensor gathered over the tp group (a collective:
    every tp rank calls this for the same names in the same order)."""
    from torch.distributed.tensor import DTensor

    t = (t.full_tensor() if isinstance(t, DTensor) else t).detach().contiguous()
    d = split_dim(name)
    if d is not None:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t, group=group)
        t = torch.cat(parts, dim=d)
    return t.cpu().numpy().copy()


def build(cfg: Mapping, state_dict: Mapping[str, np.ndarray], mesh) -> Tuple[nn.Module, Callable]:
    """This rank's channel-parallel ResNet from the full ``state_dict``, and its ``canonical(name, t)``."""
    model = resnet(**cfg["model"]).to(getattr(torch, cfg["dtype"]))
    model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in state_dict.items()})
    parallelize_resnet(model, mesh["tp"])
    group = mesh["tp"].get_group()
    return model, lambda name, t: canonical(name, t, group)
