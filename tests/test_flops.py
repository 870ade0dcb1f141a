"""jaxdp.run.flops: the model FLOPs that MFU divides, against hand formulas (ResNet: the conv
and dense MACs layer by layer; ViT: the standard transformer count, MaxText's
``calculate_tflops_training_per_device`` with non-causal attention) and the 3.33 GFLOP per
trained image every ResNet-18 CIFAR MFU quotes. Abstract traces only: no compile."""

import pytest

from jaxdp.run.flops import mfu, model_flops_per_image


def resnet_cifar_flops(width: int, blocks=(2, 2, 2, 2), image: int = 32, classes: int = 10) -> float:
    """Training FLOPs per image of a torchvision BasicBlock ResNet with the CIFAR stem
    (3x3 conv, no max-pool): 2 x MACs x 3."""
    macs = image * image * 9 * 3 * width  # stem
    channels, size = width, image
    for stage, count in enumerate(blocks):
        planes = width * 2 ** stage
        if stage:
            size //= 2
        for b in range(count):
            macs += size * size * 9 * (channels * planes + planes * planes)  # conv1, conv2
            if b == 0 and (stage or channels != planes):
                macs += size * size * channels * planes  # the 1x1 downsample
            channels = planes
    macs += channels * classes  # fc
    return 6.0 * macs


def vit_flops(depth, dim, heads, mlp_dim, patch, image=32, classes=10) -> float:
    """6 x (matmul params) x tokens + attention's two (T x T x dim) products per layer, x 3."""
    patches = (image // patch) ** 2
    tokens = patches + 1  # the class token
    per_token = depth * (4 * dim * dim + 2 * dim * mlp_dim)  # qkv, out-projection, the MLP's two
    attention = depth * 2 * tokens * tokens * dim  # q k^T and (softmax) v, over all heads
    embed = patches * patch * patch * 3 * dim
    return 6.0 * (tokens * per_token + embed + dim * classes) + 3 * 2 * attention


def test_resnet18_is_3_33_gflop_per_trained_image():
    count = model_flops_per_image("resnet18", width=64)
    assert count == pytest.approx(3.33e9, rel=0.02)
    assert count == pytest.approx(resnet_cifar_flops(64), rel=1e-9)


def test_a_tiny_resnet_and_bf16_compute_count_the_same_macs():
    assert model_flops_per_image("resnet18", width=4, blocks=(1, 2, 1, 1)) == pytest.approx(
        resnet_cifar_flops(4, (1, 2, 1, 1)), rel=1e-9)
    assert model_flops_per_image("resnet18", width=8, dtype="bfloat16") == pytest.approx(
        resnet_cifar_flops(8), rel=1e-9)


def test_vit_matches_the_transformer_formula():
    size = dict(depth=2, dim=32, heads=4, mlp_dim=64, patch=8)
    assert model_flops_per_image("vit-tiny", **size) == pytest.approx(vit_flops(**size), rel=1e-9)


def test_mfu_is_model_flops_per_second_over_every_devices_peak():
    assert mfu(1000.0, 3.33e9, 2, 1e12) == pytest.approx(1000 * 3.33e9 / 2e12)
    assert mfu(None, 3.33e9, 1, 1e12) is None and mfu(1000.0, 3.33e9, 1, None) is None


def test_one_peak_table_for_train_and_bench():
    from jaxdp.run.perf import peak_flops

    assert peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756e12
    assert peak_flops("NVIDIA GH200 480GB", "bfloat16") == 989e12
    assert peak_flops("NVIDIA L40S", "bfloat16") == 362e12 and peak_flops("NVIDIA L4", "bfloat16") == 121e12
    assert peak_flops("NVIDIA H100", "float32") is None and peak_flops("cpu", "bfloat16") is None
    import torch_commands.bench.runner as runner

    assert runner.peak_flops is peak_flops and not hasattr(runner, "PEAK_TFLOPS")
