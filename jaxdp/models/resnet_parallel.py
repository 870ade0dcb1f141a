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
