"""How a ResNet splits over the ``model`` axis: channel parallelism inside each residual block.

The block's first convolution is column-parallel (each device computes 1/M of its output
channels, the HWIO kernel's last dim), so its BatchNorm normalises only that channel slice
(BatchNorm is per channel: the slice's statistics are the whole layer's, restricted); the
second convolution is row-parallel (the matching 1/M of its input channels, HWIO dim -2), its
partial output completed by one ``psum`` over ``model``. Per block: one all-reduce of the
activations in forward, and one in backward (the gradient of the block input that feeds the
column-parallel convolution), exactly as Megatron's MLP. The stem, the shortcut
(``downsample``), the block's last BatchNorm and the head stay whole on every model device.

The same plan fits the bottleneck: ``conv1`` column-parallel, ``conv2`` row-parallel and
summed, ``bn2``/``conv3``/``bn3`` whole.

The torch twin splits the same channels by hand (``torch_ref/resnet_tp.py``).
"""

from jaxdp.parallel.tensor import Column, Row

_BLOCK = "layer*/*"  # every block of every stage; the stem's conv1/bn1 sit at the top level

TP_PLAN = {
    f"params/{_BLOCK}/conv1/kernel": Column(),
    f"params/{_BLOCK}/bn1/scale": Column(),
    f"params/{_BLOCK}/bn1/bias": Column(),
    f"batch_stats/{_BLOCK}/bn1/mean": Column(),
    f"batch_stats/{_BLOCK}/bn1/var": Column(),
    f"params/{_BLOCK}/conv2/kernel": Row(),
}


def summed_values(net, size: int, batch: int, image_size: int) -> tuple:
    """Activation values all-reduced over ``model`` in one step (``jaxdp inspect``'s formula):
    (forward, backward). Forward: each block's row-parallel conv output, B·h·w·planes at its
    stage's resolution; backward: the gradient of each block's input, which feeds the
    column-parallel conv (the first block of a stage sees the previous stage's size). A
    stride-2 3x3 conv with padding 1, the imagenet stem's 7x7/2 and its max pool each take h
    to ceil(h/2)."""
    expansion = getattr(net.block, "expansion", 1)
    side = image_size if net.stem == "cifar" else -(-(-(-image_size // 2)) // 2)
    channels = net.width  # the stem's output
    forward = backward = 0
    for i, blocks in enumerate(net.stage_sizes):
        planes, out_side = net.width * 2**i, side if i == 0 else -(-side // 2)
        forward += blocks * batch * out_side**2 * planes
        backward += batch * (side**2 * channels + (blocks - 1) * out_side**2 * planes * expansion)
        side, channels = out_side, planes * expansion
    return forward, backward
