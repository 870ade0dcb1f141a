"""jaxdp.analysis (jaxdp inspect): model-state bytes against the ZeRO formulas, compiled memory, HLO collectives."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jaxdp.cli.command import main  # noqa: E402
from jaxdp.analysis import (formula_bytes, fsdp_options, inspect_strategy, measure, padded_count,  # noqa: E402
                           param_count, parse_collectives, replica_groups)
from jaxdp.runtime.mesh import make_mesh  # noqa: E402
from jaxdp.models import create_model  # noqa: E402
from jaxdp.optim import make_optimizer  # noqa: E402
from jaxdp.strategies import create_strategy  # noqa: E402
from jaxdp.loss.task import classifier  # noqa: E402

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "hsdp")


def test_resnet18_cifar_has_11_173_962_params():
    assert param_count(create_model("resnet18")) == 11_173_962


def test_padded_count_pads_only_tensors_no_dimension_of_which_n_divides():
    shapes = {"kernel": np.zeros((3, 3, 16, 24)), "odd": np.zeros((5, 7)), "bias": np.zeros(10)}
    # N = 8: the kernel is cut along 24, unpadded; (5, 7) pads its largest dim 7 -> 8; the bias 10 -> 16.
    assert padded_count(shapes, 8) == 3 * 3 * 16 * 24 + 5 * 8 + 16
    # N = 5: no kernel dim divisible (its largest, 24, pads to 25); (5, 7) is cut along 5; 10 is.
    assert padded_count(shapes, 5) == 3 * 3 * 16 * 25 + 5 * 7 + 10


COUNTS = [(name, 8) for name in STRATEGIES] + [("zero3", 1), ("zero3", 2), ("zero3", 4), ("hsdp", 4)]


def test_model_state_bytes_match_the_zero_formulas():
    """Measured == formula with padding (exactly), and within 1% of the plain formula."""
    model = create_model("resnet18", width=8, blocks=(1, 1, 1, 1))  # Ψ = 78,002, f32
    variables = jax.jit(lambda x: model.init(jax.random.key(0), x, train=False))(np.zeros((1, 16, 16, 3), np.float32))
    rng = np.random.default_rng(0)
    images, labels = rng.normal(size=(8, 16, 16, 3)).astype(np.float32), rng.integers(0, 10, 8).astype(np.int32)
    for opt, k, scalars in (("adam", 8, 4), ("sgd", 4, 0)):
        tx = make_optimizer(opt, 0.1) if opt == "sgd" else make_optimizer(opt, 1e-3)
        # Every strategy at N = 8 (pads 6); zero3 also at N = 1, 2 (no padding) and 4 (pads 2); hsdp at 4.
        for name, n in COUNTS if opt == "adam" else (("zero3", 8),):
            strategy = create_strategy(name, model, classifier(model), tx, make_mesh(n),
                                       **fsdp_options(name, model))
            # The sharded init (strategy.engine.init) at N = 8, the canonical variables placed elsewhere.
            r = measure(strategy, {"image": images[:n], "label": labels[:n]},
                        variables=None if n == 8 else variables, compile=False)
            assert (r["psi"], r["param_bytes"], r["opt_bytes_per_param"]) == (78_002, 4, k)
            # Per-dimension sharding: only the fc bias (10) has no dimension the shard count divides
            # (8: 10 -> 16, 4: -> 12; hsdp shards over S = N/2).
            assert r["psi_padded"] == 78_002 + {8: 6, 4: 2, 2: 0, 1: 0}[r["shards"]], (name, n)
            measured, exact, padded = r["state"]["measured"], r["state"]["formula"], r["state"]["formula_padded"]
            for part in ("params", "grads", "opt"):
                assert measured[part] == padded[part], (name, n, part)
                assert abs(measured[part] / exact[part] - 1) < 0.01, (name, n, part)
            assert measured["opt_scalars"] == scalars  # adam's step count


@pytest.mark.parametrize("name,total", [("ddp", 4 + 4 + 8), ("zero1", 4 + 4 + 8 / 8), ("zero2", 4 + (4 + 8) / 8),
                                        ("zero3", (4 + 4 + 8) / 8)])
def test_the_zero_table(name, total):
    """f32 Adam (K = 8) on N = 8: DDP (4+4+K)Ψ, Z1 4Ψ+4Ψ+KΨ/N, Z2 4Ψ+(4+K)Ψ/N, Z3 (4+4+K)Ψ/N."""
    psi = 11_173_962
    assert sum(formula_bytes(name, psi, psi, 8, 4, 8)["exact"].values()) == pytest.approx(total * psi)


def test_accumulating_unsharded_adds_p_psi_inside_the_step():
    """zero3 with accum_reduce once: the unsharded gradients, 4Ψ (f32) per device beside the table's
    (4+4+K)Ψ/N; the state kept between steps is unchanged."""
    psi = 11_173_962
    each, once = (formula_bytes("zero3", psi, psi, 8, 4, 8, unsharded_grads=u)["exact"] for u in (False, True))
    assert once["unsharded_grads"] == 4 * psi and each["unsharded_grads"] == 0
    assert {k: v for k, v in once.items() if k != "unsharded_grads"} == {k: v for k, v in each.items()
                                                                         if k != "unsharded_grads"}


# ResNet-18 at width 32 (Ψ = 2.8M) on 16x16 images, one per device: params, not activations,
# dominate, and the largest unit (a layer4 block) is 0.42Ψ. Compiling both steps: ~30 s of CPU.
@pytest.fixture(scope="module")
def compiled_reports():
    kw = dict(model="resnet18", width=32, optimizer="sgd", image_size=16, batch_per_device=1)
    return {name: inspect_strategy(name, 8, **kw) for name in ("ddp", "zero3")}


@pytest.mark.slow
def test_zero3_collectives_and_traffic(compiled_reports):
    ddp, z3 = compiled_reports["ddp"], compiled_reports["zero3"]
    pbytes = z3["param_bytes"] * z3["psi"]
    ops = z3["traffic"]["ops"]
    assert ops["all-gather"]["count"] > 0 and ops["reduce-scatter"]["count"] > 0
    # No gradient all-reduce: what remains is the BN-buffer broadcast and the metrics.
    assert ops["all-reduce"]["output_bytes"] < 0.01 * pbytes
    assert ddp["traffic"]["ops"]["all-reduce"]["output_bytes"] >= pbytes
    # The FSDP units are the 8 blocks; the root unit is the stem (conv 3x3x3x32, BN 2x32) and the fc
    # (256x10 kernel, bias 10 padded to 16), gathered once per step and kept through backward.
    assert z3["fsdp_unit_count"] == 8
    assert z3["psi_root_padded"] == 3 * 3 * 3 * 32 + 2 * 32 + 256 * 10 + 16
    # Every unit gathered in forward and re-gathered in backward, the root once: 2Ψ_pad - Ψ_root gathered ...
    assert ops["all-gather"]["output_bytes"] == pytest.approx(
        (2 * z3["psi_padded"] - z3["psi_root_padded"]) * 4, rel=1e-6)
    # ... and Ψ_pad reduce-scattered (less 1.6e-4: XLA merges the reduce-scatters of two equal gradients,
    # the biases of a downsampling block's bn2 and shortcut BN, both the sum of the block's output grad).
    assert ops["reduce-scatter"]["input_bytes"] == pytest.approx(z3["psi_padded"] * 4, rel=1e-3)
    ratio = z3["traffic"]["ring_bytes"] / ddp["traffic"]["ring_bytes"]
    print(f"ring bytes per device: ddp {ddp['traffic']['ring_bytes']:,.0f}, "
          f"zero3 {z3['traffic']['ring_bytes']:,.0f}, ratio {ratio:.4f}")
    assert ratio == pytest.approx(1.5, rel=0.02)
    for r in (ddp, z3):
        assert r["traffic"]["ring_bytes"] == pytest.approx(r["traffic_formula_bytes"], rel=0.02)


def test_zero3_compiled_memory_saving(compiled_reports):
    """ZeRO-3 saves the model state the formulas say, less what it gathers: with FSDP2's prefetch, two
    units' params at once (the one computing, the next one gathered one unit ahead). At width 32 on
    16x16 images the layer4 blocks are 0.42 and 0.33 of Psi: the allowance is theirs."""
    z3 = compiled_reports["zero3"]
    used = {name: r["memory"]["argument_bytes"] + r["memory"]["temp_bytes"] for name, r in compiled_reports.items()}
    n, psi, p, k = 8, z3["psi"], z3["param_bytes"], z3["opt_bytes_per_param"]
    theory = (p + p + k) * psi * (1 - 1 / n)
    width = 32
    block = 9 * width * 8 * width * 8 * 2 + 4 * width * 8  # a layer4 block without downsampling: 2 convs, 2 BNs
    first = 9 * width * 4 * width * 8 + 9 * width * 8 * width * 8 + width * 4 * width * 8 + 6 * width * 8
    prefetched = p * (block + first)
    saving = used["ddp"] - used["zero3"]
    print(f"argument+temp per device: ddp {used['ddp']:,} B, zero3 {used['zero3']:,} B; "
          f"saving {saving:,} B = {saving / theory:.3f} of the theory's {theory:,.0f} B (less {prefetched:,} B prefetched)")
    assert saving >= 0.9 * (theory - prefetched)


@pytest.fixture(scope="module")
def hsdp_report():
    """HSDP 2x4 on a one-block-per-stage ResNet-18 of width 32 (Ψ = 1.2M: params dominate BN buffers)."""
    return inspect_strategy("hsdp", 8, model="resnet18", width=32, blocks=(1, 1, 1, 1), optimizer="sgd",
                            image_size=16, batch_per_device=1, mesh_shape=(2, 4))


def test_hsdp_reduces_across_replicas_and_gathers_within_groups(hsdp_report):
    r = hsdp_report
    ops = r["traffic"]["ops"]
    replicas = [[0, 4], [1, 5], [2, 6], [3, 7]]  # mesh (R, S) = (2, 4): device r*4 + s; a replica group is one s
    shard_groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
    cross = [g for g in ops["all-reduce"]["by_groups"] if g["groups"] == replicas]
    assert len(cross) == 1, ops["all-reduce"]["by_groups"]
    # The gradient chunk each device owns, Ψ_pad/S params, is what crosses the replicas.
    assert cross[0]["output_bytes"] == pytest.approx(r["psi_padded"] / 4 * r["param_bytes"], rel=1e-3)
    others = [g for g in ops["all-reduce"]["by_groups"] if g["groups"] != replicas]
    assert sum(g["output_bytes"] for g in others) < 0.01 * cross[0]["output_bytes"]  # BN buffers, metrics
    for kind in ("all-gather", "reduce-scatter"):
        assert ops[kind]["count"] > 0 and [g["groups"] for g in ops[kind]["by_groups"]] == [shard_groups], kind
    assert r["traffic"]["ring_bytes"] == pytest.approx(r["traffic_formula_bytes"], rel=0.02)


class WideMLP(nn.Module):
    """No BatchNorm and 200k params in 4 tensors: traffic is the parameters', and it compiles in a second."""

    @nn.compact
    def __call__(self, x, train=True):
        return nn.Dense(10)(nn.relu(nn.Dense(256)(x.reshape(x.shape[0], -1))))


@pytest.fixture(scope="module")
def wide_mlp():
    model = WideMLP()
    rng = np.random.default_rng(0)
    return model, {"image": rng.normal(size=(16, 16, 16, 3)).astype(np.float32),
                   "label": rng.integers(0, 10, 16).astype(np.int32)}


@pytest.mark.parametrize("name,options", [
    ("zero1", {"bucket_cap_mb": 0.25}), ("zero2", {"bucket_cap_mb": 0.25}), ("dp", {}), ("async", {"staleness": 2}),
    ("ddp", {"allreduce": "ring"}), ("ddp", {"compress": "powersgd", "powersgd_rank": 2}),
    ("zero1", {"compress": "powersgd", "powersgd_rank": 2}),
], ids=["zero1", "zero2", "dp", "async", "ring", "powersgd", "zero1-powersgd"])
def test_measured_traffic_meets_the_formula(wide_mlp, name, options):
    """Ring bytes per device from the compiled HLO within 2% of each strategy's formula (see jaxdp.analysis.state)."""
    model, batch = wide_mlp
    r = measure(create_strategy(name, model, classifier(model), make_optimizer("adam", 1e-3), make_mesh(8),
                                **options), batch)
    measured = r["traffic"]["ring_bytes"]
    if "compress" in options:  # the step holds both branches; the compressed one runs after start_iter
        (branches,) = r["traffic"]["conditionals"]
        measured -= max(branches) - min(branches)
    print(f"{name} {options}: {measured:,.0f} B measured, {r['traffic_formula_bytes']:,.0f} B formula")
    assert measured == pytest.approx(r["traffic_formula_bytes"], rel=0.02)
    psi, p = r["psi"], r["param_bytes"]
    extra = {"async": 2 * p * psi}.get(name, r["state"]["formula"]["extra"])  # async: the last k = 2 params
    assert r["state"]["measured"]["extra"] == extra


def test_bf16_compression_halves_the_traffic_as_written(wide_mlp):
    """The program all-reduces bf16 (half of DDP's bytes); XLA:CPU's compiled program promotes it to f32."""
    model, batch = wide_mlp
    tx = make_optimizer("sgd", 0.1)
    task, mesh = classifier(model), make_mesh(8)
    ddp = measure(create_strategy("ddp", model, task, tx, mesh), batch)
    bf16 = measure(create_strategy("ddp", model, task, tx, mesh, compress="bf16"), batch)
    assert bf16["traffic_formula_bytes"] == pytest.approx(ddp["traffic_formula_bytes"] / 2)
    assert bf16["ring_bytes_as_written"] == pytest.approx(bf16["traffic_formula_bytes"], rel=0.02)
    assert ddp["ring_bytes_as_written"] == pytest.approx(ddp["traffic_formula_bytes"], rel=0.02)
    # ZeRO-1 composes DDP's all-reduce, hook included: a bf16 gradient all-reduce, then the f32 chunks gathered.
    zero1 = measure(create_strategy("zero1", model, task, tx, mesh, compress="bf16"), batch)
    psi, n = zero1["psi"], 8
    assert zero1["traffic_formula_bytes"] == pytest.approx((n - 1) / n * (2 * 2 * psi + 4 * zero1["psi_padded"]))
    assert zero1["ring_bytes_as_written"] == pytest.approx(zero1["traffic_formula_bytes"], rel=0.02)


def test_replica_group_forms():
    assert replica_groups("all-reduce(x), replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add", 8) == \
        [[0, 4], [1, 5], [2, 6], [3, 7]]
    # iota(8) as [2,4], transposed to [4,2], cut into 4 groups of 2: the columns of the 2x4 mesh.
    assert replica_groups("all-reduce(x), replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add", 8) == \
        [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert replica_groups("all-gather(x), replica_groups=[2,4]<=[8], dimensions={0}", 8) == \
        [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert replica_groups("all-reduce(x), replica_groups={}, to_apply=%add", 4) == [[0, 1, 2, 3]]


CONDITIONAL_HLO = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%small (p: f32[100]) -> f32[100] {
  %p = f32[100]{0} parameter(0)
  %q = f32[10]{0} slice(%p), slice={[0:10]}
  %ar = f32[10]{0} all-reduce(%q), replica_groups={}, to_apply=%add
  ROOT %r = f32[100]{0} pad(%ar, %z), padding=0_90
}

%large (p: f32[100]) -> f32[100] {
  %p = f32[100]{0} parameter(0)
  ROOT %ar = f32[100]{0} all-reduce(%p), replica_groups={}, to_apply=%add
}

ENTRY %main (i: s32[], x: f32[100]) -> f32[100] {
  %i = s32[] parameter(0)
  %x = f32[100]{0} parameter(1)
  %m = f32[4]{0} all-reduce(%x4), replica_groups={}, to_apply=%add
  ROOT %c = f32[100]{0} conditional(%i, %x, %x), branch_computations={%small, %large}
}
"""


def test_conditional_branches_are_alternatives():
    c = parse_collectives(CONDITIONAL_HLO, num_devices=4)
    ring = 2 * 3 / 4
    assert c["conditionals"] == [pytest.approx([ring * 40, ring * 400])]
    assert c["ring_bytes"] == pytest.approx(ring * (16 + 400))  # the unconditional op and the larger branch
    assert c["ops"]["all-reduce"]["count"] == 3  # every op is listed


def test_cli_inspect_refuses_a_batchnorm_of_one_value(capsys):
    # 8x8 images end as 1x1 maps in the last stage: one image per device leaves BN 1 value per channel.
    argv = ["inspect", "--strategy", "ddp", "--devices", "2", "--width", "4", "--blocks", "1,1,1,1",
            "--image-size", "8", "--batch-per-device", "1", "--no-compile"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxdp: error: --image-size 8 with --batch-per-device 1") and "\n" not in err


def test_cli_inspect_refuses_an_option_the_strategy_refuses(capsys):
    # zero3 reduce-scatters: it has no all-reduce for a compression hook to wrap (zero1 has DDP's).
    argv = ["inspect", "--strategy", "zero3", "--devices", "2", "--width", "4", "--blocks", "1,1,1,1",
            "--image-size", "16", "--compress", "bf16", "--no-compile"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxdp: error: ") and "compress" in err and "\n" not in err


def test_cli_inspect_refuses_an_unknown_optimizer_in_one_line(capsys):
    argv = ["inspect", "--strategy", "ddp", "--devices", "2", "--width", "4", "--blocks", "1,1,1,1",
            "--image-size", "16", "--optimizer", "lamb", "--no-compile"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == "jaxdp: error: unknown optimizer 'lamb'; valid choices: sgd, adam, adamw", err


HLO = """HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[16]{0})->f32[16]{0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[64])) -> (s32[], f32[64]) {
  %p = (s32[], f32[64]{0}) parameter(0)
  %x = f32[64]{0} get-tuple-element(%p), index=1
  %i = s32[] get-tuple-element(%p), index=0
  %ar = f32[64]{0} all-reduce(%x), channel_id=3, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  ROOT %t = (s32[], f32[64]{0}) tuple(%i, %ar)
}

%cond (p: (s32[], f32[64])) -> pred[] {
  %p = (s32[], f32[64]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %c = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

ENTRY %main (x: f32[16], y: f32[8]) -> f32[16] {
  %x = f32[16]{0} parameter(0)
  %y = f32[8]{0} parameter(1)
  %all-reduce = (f32[16]{0}, /*index=1*/f32[8]{0}) all-reduce(%x, %y), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %ag = f32[8,16]{1,0} all-gather(%x), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %rs = f32[1,16]{1,0} reduce-scatter(%ag), channel_id=4, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
  %cp = f32[16]{0} collective-permute(%x), channel_id=5, source_target_pairs={{0,1},{1,2}}
  %ags = (f32[16]{0}, f32[128]{0}) all-gather-start(%x), channel_id=6, replica_groups={}, dimensions={0}
  %agd = f32[128]{0} all-gather-done(%ags)
  %init = (s32[], f32[64]{0}) tuple(%i0, %z)
  %w = (s32[], f32[64]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %r = f32[16]{0} copy(%x)
}
"""


def test_parse_collectives_tuples_loops_async():
    ops = parse_collectives(HLO, num_devices=8)["ops"]
    # tuple all-reduce (96 B, 8 devices) once + a 256 B all-reduce over groups of 4 in a 3-trip loop
    assert ops["all-reduce"]["count"] == 4
    assert ops["all-reduce"]["ring_bytes"] == pytest.approx(2 * 7 / 8 * 96 + 3 * 2 * 3 / 4 * 256)
    assert ops["all-gather"]["count"] == 2  # the -done half is not counted again
    # input: what a device contributes (its 64 B chunk); output: the gathered 512 B.
    assert ops["all-gather"]["input_bytes"] == pytest.approx(64 + 64)
    assert ops["all-gather"]["output_bytes"] == pytest.approx(512 + 512)
    assert ops["all-gather"]["ring_bytes"] == pytest.approx(2 * 7 / 8 * 512)
    # reduce-scatter: the full 512 B in, this device's 64 B sum out.
    assert (ops["reduce-scatter"]["input_bytes"], ops["reduce-scatter"]["output_bytes"]) == (512, 64)
    assert ops["reduce-scatter"]["ring_bytes"] == 7 * 64
    assert ops["collective-permute"]["ring_bytes"] == 64
    loop_groups = [g for g in ops["all-reduce"]["by_groups"] if g["groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]]
    assert len(loop_groups) == 1 and loop_groups[0]["count"] == 3  # the [2,4]<=[8] iota form


def test_cli_inspect(capsys):
    argv = ["inspect", "--strategy", "zero2", "--devices", "4", "--width", "4", "--blocks", "1,1,1,1",
            "--image-size", "16", "--optimizer", "adam", "--no-compile"]
    assert main(argv + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["strategy"] == "zero2" and report["devices"] == 4 and report["opt_bytes_per_param"] == 8
    assert report["state"]["measured"]["grads"] == report["state"]["formula_padded"]["grads"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "optimizer state" in table and "Ψ =" in table


def test_inspect_takes_a_vit_and_its_encoder_blocks_are_the_units():
    """--model vit-tiny: ZeRO-3 per-device state equals the padded formula, the units are the
    12 encoder blocks, and the rest (patch embedding, tokens, norm, head) is the root unit."""
    r = inspect_strategy("zero3", 4, model="vit-tiny", compile=False)
    assert r["psi"] == 5_362_762  # vit-tiny at 32x32, patch 4, 10 classes
    assert (r["fsdp_units"], r["fsdp_unit_count"]) == (["EncoderBlock"], 12)
    measured, padded = r["state"]["measured"], r["state"]["formula_padded"]
    assert all(measured[part] == padded[part] for part in ("params", "grads", "opt"))


# ----------------------------------------------------------------------------- per mesh axis

TINY_VIT = dict(depth=2, dim=32, heads=4, mlp_dim=64, patch=8)  # 16x16 images: T = (16/8)^2 + 1 = 5 tokens


def vit_split_params(depth, dim, mlp_dim, **_):
    """Ψ_split by hand: per block qkv (d·3d + 3d), proj's kernel d·d, fc1 (d·h + h), fc2's kernel h·d."""
    return depth * (dim * 3 * dim + 3 * dim + dim * dim + dim * mlp_dim + mlp_dim + mlp_dim * dim)


@pytest.fixture(scope="module")
def tp_ddp_report():
    return inspect_strategy("ddp", 4, model="vit-tiny", vit=TINY_VIT, image_size=16, batch_per_device=2,
                            mesh={"data": 2, "model": 2})


def test_channel_parallel_resnet_model_axis_traffic_meets_its_formula():
    """ResNet TP 2 x DDP 2: one all-reduce per block of its conv2 output (B·h·w·planes at the
    block's resolution) in forward, and one of the block input's gradient in backward."""
    r = inspect_strategy("ddp", 4, model="resnet18", width=4, blocks=(1, 1, 1, 1), image_size=16,
                         batch_per_device=2, mesh={"data": 2, "model": 2})
    m, p, batch = 2, 4, 2
    forward = batch * (16 * 16 * 4 + 8 * 8 * 8 + 4 * 4 * 16 + 2 * 2 * 32)  # layer1..layer4 outputs
    backward = batch * (16 * 16 * 4 + 16 * 16 * 4 + 8 * 8 * 8 + 4 * 4 * 16)  # their inputs
    formula = 2 * (m - 1) / m * (forward + backward) * p
    a = r["axes"]
    assert a["traffic"]["model"]["ring_bytes"] == a["traffic_formula"]["model"] == formula
    assert a["traffic"]["model"]["ops"] == {"all-reduce": formula}


def test_tp_x_ddp_bytes_and_traffic_per_axis_meet_the_formulas(tp_ddp_report):
    """TP 2 x DDP 2: params per device p·(Ψ_rep + Ψ_split/M); the model axis carries the Megatron
    all-reduces, 2 per block of B·T·d values each way; the data axis DDP's all-reduce of Ψ_local."""
    r, a = tp_ddp_report, tp_ddp_report["axes"]
    m, n, p, batch, tokens = 2, 2, 4, 2, 5
    split = vit_split_params(**TINY_VIT)
    assert (a["psi_split"], a["psi_rep"] + a["psi_split"]) == (split, r["psi"])
    local = a["psi_rep"] + split // m
    assert r["psi_local"] == a["psi_local"] == local
    for part in ("params", "grads", "opt"):
        assert r["state"]["measured"][part] == p * local, part  # sgd momentum: K = p
        by_axes = a["state"][part]
        assert set(by_axes) == {"-", "model"}
        assert by_axes["model"]["bytes"] == p * split // m and by_axes["-"]["bytes"] == p * a["psi_rep"]
    assert set(a["traffic"]) == {"data", "model"}, a["traffic"]
    megatron = 4 * TINY_VIT["depth"] * 2 * (m - 1) / m * batch * tokens * TINY_VIT["dim"] * p
    assert a["traffic"]["model"]["ring_bytes"] == a["traffic_formula"]["model"] == megatron
    assert a["traffic"]["model"]["ops"] == {"all-reduce": megatron}
    assert a["traffic"]["data"]["ring_bytes"] == pytest.approx(2 * (n - 1) / n * p * local, rel=0.01)
    assert a["activations"] == r["memory"]["temp_bytes"] > 0


def test_tp_x_zero3_cuts_each_model_slice_over_data():
    """ZeRO-3 beside model=2: each device holds p·Ψ_local/N, the split part cut over data and model."""
    r = inspect_strategy("zero3", 4, model="vit-tiny", vit=TINY_VIT, image_size=16, batch_per_device=2,
                         mesh={"data": 2, "model": 2}, compile=False)
    a, split, p = r["axes"], vit_split_params(**TINY_VIT), 4
    assert r["state"]["measured"]["params"] == p * (a["psi_rep"] + split // 2) // 2
    assert a["state"]["params"]["data+model"]["bytes"] == p * split // 4
    assert a["state"]["params"]["data"]["bytes"] == p * a["psi_rep"] // 2


def test_collectives_are_mapped_to_mesh_axes():
    from jaxdp.analysis.axes import axes_of_groups, axes_of_pairs

    shape, names = (2, 2, 2), ("replica", "data", "model")  # logical ids 0..7, model fastest
    assert axes_of_groups([[0, 1], [2, 3], [4, 5], [6, 7]], shape, names) == "model"
    assert axes_of_groups([[0, 2], [1, 3], [4, 6], [5, 7]], shape, names) == "data"
    assert axes_of_groups([[0, 4], [1, 5], [2, 6], [3, 7]], shape, names) == "replica"
    assert axes_of_groups([[0, 1, 2, 3], [4, 5, 6, 7]], shape, names) == "data+model"
    assert axes_of_groups([list(range(8))], shape, names) == "replica+data+model"
    assert axes_of_groups([[0, 3], [1, 2], [4, 7], [5, 6]], shape, names) == "?"  # no axis makes these
    assert axes_of_pairs([[0, 2], [2, 0], [1, 3], [3, 1]], shape, names) == "data"
    assert axes_of_pairs([[0, 1], [4, 5]], shape, names) == "model"


def test_cli_inspect_mesh_errors_are_one_line(capsys):
    base = ["inspect", "--strategy", "ddp", "--width", "4", "--blocks", "1,1,1,1", "--image-size", "16",
            "--no-compile"]
    for extra, message in ((["--mesh", "data=2,model=2", "--devices", "8"], "holds 4 devices but --devices is 8"),
                           (["--mesh", "data=2,modle=2"], "unknown mesh axis modle"),
                           (["--mesh", "data=2,model=2", "--width", "3"], "a ResNet of width 3 cannot be split over model=2")):
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err.strip()
        assert err.startswith("jaxdp: error: ") and message in err and "\n" not in err, err


def test_pp_x_ddp_bytes_and_stage_traffic_meet_the_gpipe_formulas():
    """PP 2 x DDP 2: each device holds its stage's row of the stacked (S, L) params, L·p bytes;
    the stage axis carries one collective-permute of a micro-batch's boundary buffer per tick
    of the schedule, M + S - 1 ticks, forward and backward. The buffer is the widest boundary,
    the tokens after block 0: T·d values per example (T = 5 tokens, d = 32). M = 4 tells the
    schedule's 2(M+S-1) sends from the useful 2(S-1)·M."""
    from jaxdp.analysis.axes import gpipe_bubble

    r = inspect_strategy("ddp", 4, model="vit-tiny", vit=TINY_VIT, image_size=16, batch_per_device=4,
                         mesh={"data": 2, "stage": 2}, options={"microbatches": 4})
    a, pipe = r["axes"], r["axes"]["pipeline"]
    s, m, p, batch, tokens = 2, 4, 4, 4, 5
    example = tokens * TINY_VIT["dim"] * p
    assert pipe["stage_length"] == a["state"]["params"]["stage"]["params"] // s  # the (S, L) array, L per device
    assert r["state"]["measured"]["params"] == pipe["params_bytes"] == p * pipe["stage_length"]
    assert pipe["activation_bytes_per_example"] == example
    assert pipe["activations_in_flight_bytes"] == batch * example
    assert pipe["stage_traffic_useful_bytes"] == 2 * (s - 1) * batch * example
    sends = 2 * (m + s - 1) * (batch // m) * example  # bubble ticks send padding too
    assert a["traffic"]["stage"]["ops"]["collective-permute"] == pipe["stage_traffic_bytes"] == sends
    assert a["traffic_formula"]["stage"] == sends
    assert pipe["bubble_formula"] == gpipe_bubble(s, m) == (s - 1) / (m + s - 1)
    assert a["traffic"]["data"]["ring_bytes"] == pytest.approx(2 * (2 - 1) / 2 * p * pipe["stage_length"], rel=0.01)
