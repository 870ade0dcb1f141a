"""jaxdp.inspect: model-state bytes against the ZeRO formulas, compiled memory, HLO collectives."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jaxdp.cli import main  # noqa: E402
from jaxdp.inspect import formula_bytes, inspect_strategy, measure, param_count, parse_collectives  # noqa: E402
from jaxdp.mesh import make_mesh  # noqa: E402
from jaxdp.models import create_model  # noqa: E402
from jaxdp.optim import make_optimizer  # noqa: E402
from jaxdp.strategies import create_strategy  # noqa: E402
from jaxdp.train import init_variables  # noqa: E402

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "hsdp")


def test_resnet18_cifar_has_11_173_962_params():
    assert param_count(create_model("resnet18")) == 11_173_962


def test_model_state_bytes_match_the_zero_formulas():
    """Measured == formula with padding (exactly), and within 1% of the plain formula."""
    model = create_model("resnet18", width=8, blocks=(1, 1, 1, 1))  # Ψ = 78,002, f32
    variables = init_variables(model, 0, (16, 16, 3))
    rng = np.random.default_rng(0)
    images, labels = rng.normal(size=(8, 16, 16, 3)), rng.integers(0, 10, 8)
    for opt, k, scalars in (("adam", 8, 4), ("sgd", 4, 0)):
        tx = make_optimizer(opt, 0.1) if opt == "sgd" else make_optimizer(opt, 1e-3)
        for n in (1, 2, 4, 8) if opt == "adam" else (8,):
            for name in STRATEGIES if opt == "adam" else ("zero3",):
                r = measure(create_strategy(name, model, tx, make_mesh(n)), variables, images[:n], labels[:n],
                            compile=False)
                assert (r["psi"], r["param_bytes"], r["opt_bytes_per_param"]) == (78_002, 4, k)
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


# ResNet-18 at width 32 (Ψ = 2.8M) on 16x16 images, one per device: params, not activations,
# dominate, and the largest unit (a layer4 block) is 0.42Ψ. Compiling both steps: ~30 s of CPU.
@pytest.fixture(scope="module")
def compiled_reports():
    kw = dict(model="resnet18", width=32, optimizer="sgd", image_size=16, batch_per_device=1)
    return {name: inspect_strategy(name, 8, **kw) for name in ("ddp", "zero3")}


def test_zero3_collectives_and_traffic(compiled_reports):
    ddp, z3 = compiled_reports["ddp"], compiled_reports["zero3"]
    pbytes = z3["param_bytes"] * z3["psi"]
    ops = z3["collectives"]["ops"]
    assert ops["all-gather"]["count"] > 0 and ops["reduce-scatter"]["count"] > 0
    # No gradient all-reduce: what remains is the BN-buffer broadcast and the metrics.
    assert ops["all-reduce"]["result_bytes"] < 0.01 * pbytes
    assert ddp["collectives"]["ops"]["all-reduce"]["result_bytes"] >= pbytes
    # Forward gather + backward re-gather = 2Ψ gathered, Ψ reduce-scattered.
    assert ops["all-gather"]["result_bytes"] == pytest.approx(2 * z3["psi_padded"] * 4, rel=1e-3)
    assert ops["reduce-scatter"]["operand_bytes"] == pytest.approx(z3["psi_padded"] * 4, rel=1e-3)
    ratio = z3["collectives"]["ring_bytes"] / ddp["collectives"]["ring_bytes"]
    print(f"ring bytes per device: ddp {ddp['collectives']['ring_bytes']:,.0f}, "
          f"zero3 {z3['collectives']['ring_bytes']:,.0f}, ratio {ratio:.4f}")
    assert ratio == pytest.approx(1.5, rel=0.02)
    for r in (ddp, z3):
        assert r["collectives"]["ring_bytes"] == pytest.approx(r["traffic_formula_bytes"], rel=0.02)


def test_zero3_compiled_memory_saving(compiled_reports):
    ddp, z3 = compiled_reports["ddp"], compiled_reports["zero3"]
    used = {name: r["memory"]["argument"] + r["memory"]["temp"] for name, r in compiled_reports.items()}
    n, psi, p, k = 8, z3["psi"], z3["param_bytes"], z3["opt_bytes_per_param"]
    theory = (p + p + k) * psi * (1 - 1 / n)
    saving = used["ddp"] - used["zero3"]
    print(f"argument+temp per device: ddp {used['ddp']:,} B, zero3 {used['zero3']:,} B; "
          f"saving {saving:,} B = {saving / theory:.3f} of the theory's {theory:,.0f} B")
    assert saving >= 0.9 * theory


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
    assert ops["all-gather"]["operand_bytes"] == pytest.approx(64 + 64)
    assert ops["all-gather"]["ring_bytes"] == pytest.approx(2 * 7 / 8 * 512)
    assert (ops["reduce-scatter"]["operand_bytes"], ops["reduce-scatter"]["ring_bytes"]) == (512, 7 * 64)
    assert ops["collective-permute"]["ring_bytes"] == 64


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
