"""The estimated step time reads each collective's own window (``jaxdp.analysis.estimate``), on
scheduled HLO written by hand (the answer worked out below, in microseconds) and on a checked-in
XLA:GPU schedule (``fixtures/gpu_zero3_tiny.hlo``). No compile: text in, numbers out."""

import types
from pathlib import Path

import pytest

from jaxdp.analysis import plot
from jaxdp.analysis.estimate import COLLECTIVE_LANE, COMPUTE_LANE, estimate, timeline
from jaxdp.analysis.hlo_text import read_module
from jaxdp.analysis.kernel_flops import instruction_flops
from jaxdp.analysis.measured import against_measurement, measurements
from jaxdp.analysis.plot import lanes
from jaxdp.analysis.schedule import collective_list
from jaxdp.cli.command import main
from jaxdp.runtime.target import GPUS

HERE = Path(__file__).parent
US = 1e-6
# Round figures: 1 MB of HBM traffic takes 1 us, 1 MB over NVLink 10 us, over the network 100 us,
# 1e8 FLOPs 1 us.
GPU = types.SimpleNamespace(memory_bandwidth=1e12, nvlink_bandwidth=1e11, network_bandwidth=1e10,
                            peak_flops={"float32": 1e14, "tf32": 1e14, "bfloat16": 2e14})

# p, x, y: 1 MB each (250,000 f32). Gathers over {0,1} of 1 MB shards: 1 MB on the wire, 10 us each.
# The all-reduce's group spans the two hosts of hosts=[0, 0, 1, 1]: 2 (G-1)/G x 1 MB = 1.5 MB, 150 us.
WINDOWS = """HloModule m, is_scheduled=true

%fused_add (a: f32[250000]) -> f32[250000] {
  %a = f32[250000]{0} parameter(0)
  ROOT %s = f32[250000]{0} add(%a, %a)
}

ENTRY %main (p: f32[250000], x: f32[500,500], y: f32[500,500]) -> f32[500,500] {
  %p = f32[250000]{0} parameter(0)
  %x = f32[500,500]{1,0} parameter(1)
  %y = f32[500,500]{1,0} parameter(2)
  %ag-a = ((f32[250000]{0}), f32[500000]{0}) all-gather-start(%p), replica_groups={{0,1},{2,3}}, dimensions={0}
  %k1 = f32[250000]{0} fusion(%p), kind=kLoop, calls=%fused_add
  %ag-a-done = f32[500000]{0} all-gather-done(%ag-a)
  %ag-b = ((f32[250000]{0}), f32[500000]{0}) all-gather-start(%k1), replica_groups={{0,1},{2,3}}, dimensions={0}
  %ag-c = ((f32[250000]{0}), f32[500000]{0}) all-gather-start(%p), replica_groups={{0,1},{2,3}}, dimensions={0}
  %k2 = f32[500,500]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ag-b-done = f32[500000]{0} all-gather-done(%ag-b)
  %ag-c-done = f32[500000]{0} all-gather-done(%ag-c)
  ROOT %ar = f32[500,500]{1,0} all-reduce(%k2), replica_groups={{0,1,2,3}}, to_apply=%fused_add
}"""
HOSTS = [0, 0, 1, 1]


def windows():
    collectives = collective_list(WINDOWS, HOSTS)
    return collectives, estimate(GPU, "float32", 0.0, WINDOWS, collectives)


def test_a_collective_hides_only_behind_the_kernels_in_its_own_window():
    """By hand: k1 (2 MB moved: 2 us) is all ag-a's window holds, so 8 of its 10 us are exposed. ag-b and
    ag-c start together at 10 us; the stream they share runs ag-b 10-20, ag-c 20-30, while k2 (a 500^3
    matmul, 2.5e8 FLOPs = 2.5 us, under its 3 MB = 3 us) runs 10-13: the compute stream waits 7 us at
    ag-b's done and 10 more at ag-c's. The synchronous all-reduce crosses hosts: 150 us, all exposed.
    Before, every asynchronous collective with a kernel in its window counted as hidden (0 us here)."""
    collectives, r = windows()
    assert {c["name"]: round(c["exposed_s"] / US, 6) for c in collectives} == {
        "ag-a": 8, "ag-b": 7, "ag-c": 10, "ar": 150}
    assert r["kernels_s"] == pytest.approx(5 * US)
    assert r["communication_s"] == pytest.approx(180 * US)
    assert r["exposed_communication_s"] == pytest.approx(175 * US)
    assert r["estimated_step_s"] == pytest.approx(180 * US)


def test_the_timeline_holds_each_window_and_transfer():
    collectives, _ = windows()
    played = timeline(WINDOWS, GPU, collectives)
    compute = [(x.name, round(x.start / US, 6), round(x.end / US, 6)) for x in played.intervals
               if x.lane == COMPUTE_LANE]
    assert compute == [("k1", 0, 2), ("k2", 10, 13)]
    lane = {x.name: tuple(round(v / US, 6) for v in (x.start, x.end, x.busy_from, x.busy_to, x.exposed))
            for x in played.intervals if x.lane == COLLECTIVE_LANE}
    assert lane == {"ag-a": (0, 10, 0, 10, 8), "ag-b": (10, 20, 10, 20, 7), "ag-c": (10, 30, 20, 30, 10),
                    "ar": (30, 180, 30, 180, 150)}


def test_a_while_loop_plays_its_body_once_per_trip():
    """Three trips of (a 2 us kernel, then a synchronous 5 us gather of 1 MB over 2): 21 us, 15 of them exposed."""
    hlo = """%body (s: f32[250000]) -> f32[250000] {
  %s = f32[250000]{0} parameter(0)
  %k = f32[250000]{0} fusion(%s), kind=kLoop, calls=%fused
  ROOT %g = f32[250000]{0} all-gather(%k), replica_groups={{0,1}}, dimensions={0}
}

ENTRY %main (p: f32[250000]) -> f32[250000] {
  %p = f32[250000]{0} parameter(0)
  ROOT %w = f32[250000]{0} while(%p), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
}"""
    collectives = collective_list(hlo, [0, 0])
    r = estimate(GPU, "float32", 0.0, hlo, collectives)
    assert collectives[0]["runs"] == 3 and collectives[0]["exposed_s"] == pytest.approx(3 * 5 * US)
    assert (r["estimated_step_s"], r["kernels_s"]) == (pytest.approx(21 * US), pytest.approx(6 * US))


def test_a_real_gpu_schedule_adds_up():
    """XLA:GPU's ZeRO-3 schedule for 2 H100s: every collective carries its exposed time, they add up to
    the report's, the step is the kernels plus them, and the first gather (synchronous) is exposed whole."""
    text = (HERE / "fixtures" / "gpu_zero3_tiny.hlo").read_text()
    collectives = collective_list(text, [0, 0])
    r = estimate(GPUS["h100"], "float32", 1e9, text, collectives)
    assert all(c["exposed_s"] >= 0 for c in collectives)
    assert r["exposed_communication_s"] == pytest.approx(sum(c["exposed_s"] for c in collectives))
    assert r["estimated_step_s"] == pytest.approx(r["kernels_s"] + r["exposed_communication_s"])
    first = collectives[0]
    assert first["kind"] == "all-gather" and not first["async"]
    assert first["exposed_s"] == pytest.approx(first["ring_bytes"] / GPUS["h100"].nvlink_bandwidth)
    assert 0 < r["exposed_communication_s"] < r["communication_s"]


@pytest.mark.parametrize("target, shapes, flops", [
    # forward: y = result, kernel = operand 1 (o01i: 8 output features)
    ("convForward", ("f32[4,16,16,3]", "f32[8,3,3,3]", "f32[4,16,16,8]"), 2 * 4 * 16 * 16 * 8 * 3 * 3 * 3),
    # input gradient: y = operand 0, kernel = operand 1
    ("convBackwardInput", ("f32[4,16,16,8]", "f32[8,3,3,3]", "f32[4,16,16,3]"), 2 * 4 * 16 * 16 * 8 * 3 * 3 * 3),
    # weight gradient: y = operand 1, kernel = the result
    ("convBackwardFilter", ("f32[4,16,16,3]", "f32[4,16,16,8]", "f32[8,3,3,3]"), 2 * 4 * 16 * 16 * 8 * 3 * 3 * 3),
])
def test_each_cudnn_convolution_counts_the_forwards_multiply_adds(target, shapes, flops):
    a, b, out = shapes
    hlo = f"""ENTRY %main (a: {a}, b: {b}) -> {out} {{
  %a = {a}{{3,2,1,0}} parameter(0)
  %b = {b}{{3,2,1,0}} parameter(1)
  ROOT %c = ({out}{{3,2,1,0}}, u8[0]{{0}}) custom-call(%a, %b), window={{size=3x3 pad=1_1x1_1}}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn${target}"
}}"""
    module = read_module(hlo)
    (*_, conv) = module.instructions(module.entry)
    assert instruction_flops(module, module.entry, conv) == (flops, "float32")


def test_measured_figures_are_data_read_by_one_function():
    rows = measurements()
    assert {(r["strategy"], r["batch_per_device"]) for r in rows} >= {("ddp", 512), ("ddp", 1024), ("zero3", 512)}
    ddp = next(r for r in rows if (r["strategy"], r["batch_per_device"]) == ("ddp", 512))
    assert ddp["step_s"] == pytest.approx(7.6e-3, rel=0.01)  # 67.3k images/s
    report = {k: ddp[k] for k in ("target", "devices", "strategy", "model", "width", "dtype", "batch_per_device")}
    assert against_measurement(dict(report, estimated_step_s=3.8e-3))["estimate_over_measured"] == \
        pytest.approx(0.5, rel=0.01)
    assert against_measurement(dict(report, batch_per_device=64, estimated_step_s=1e-3)) is None


def test_the_picture_draws_the_estimates_intervals(tmp_path):
    """``plot.lanes``: the kernels, each window (ag-b and ag-c are in flight together: two rows), the
    stream's transfers one after another, and the compute stream's waits, as worked out above."""
    collectives, _ = windows()
    played = timeline(WINDOWS, GPU, collectives)
    bars = lanes(played)

    def lane(name):
        return [(b.name, b.row, round(b.start / US, 6), round(b.end / US, 6)) for b in bars if b.lane == name]

    assert lane(plot.COMPUTE) == [("k1", 0, 0, 2), ("k2", 0, 10, 13)]
    assert lane(plot.WINDOWS) == [("ag-a", 0, 0, 10), ("ag-b", 0, 10, 20), ("ag-c", 1, 10, 30), ("ar", 0, 30, 180)]
    assert lane(plot.STREAM) == [("ag-a", 0, 0, 10), ("ag-b", 0, 10, 20), ("ag-c", 0, 20, 30), ("ar", 0, 30, 180)]
    assert lane(plot.EXPOSED) == [("ag-a", 0, 2, 10), ("ag-b", 0, 13, 20), ("ag-c", 0, 20, 30), ("ar", 0, 30, 180)]
    assert {b.kind for b in bars if b.lane == plot.WINDOWS} == {"all-gather", "all-reduce"}
    pytest.importorskip("matplotlib")
    path = tmp_path / "schedule.png"
    plot.draw_schedule(played, str(path), "by hand")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, says", [
    (["--plot", "s.png"], "--plot draws the estimate of a GPU target's step: add --target"),
    (["--trainer", "pkg.mod:make"], "--trainer compiles your Trainer's step for a GPU target: add --target"),
    (["--target", "h100", "--trainer", "pkg.mod"], "--trainer takes MODULE:FUNCTION"),
])
def test_plot_and_trainer_without_what_they_need_are_one_line(args, says, capsys):
    assert main(["inspect", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1


def test_a_collective_wrapped_in_an_async_start_is_timed_as_itself():
    """XLA:GPU may wrap a collective in ``async-start``/``async-done``: the wrapped one is what
    ``collective_list`` lists, so it carries the exposed time (1 MB over {0,1}: 5 us, 2 us hidden)."""
    hlo = """%wrapped (a: f32[250000]) -> f32[125000] {
  %a = f32[250000]{0} parameter(0)
  ROOT %rs = f32[125000]{0} reduce-scatter(%a), replica_groups={{0,1}}, dimensions={0}, to_apply=%add
}

ENTRY %main (p: f32[250000]) -> f32[125000] {
  %p = f32[250000]{0} parameter(0)
  %start = ((f32[250000]{0}), f32[125000]{0}) async-start(%p), calls=%wrapped
  %k = f32[250000]{0} fusion(%p), kind=kLoop, calls=%fused
  ROOT %done = f32[125000]{0} async-done(%start)
}"""
    collectives = collective_list(hlo, [0, 0])
    r = estimate(GPU, "float32", 0.0, hlo, collectives)
    assert [c["name"] for c in collectives] == ["rs"]
    assert collectives[0]["exposed_s"] == pytest.approx(3 * US) and r["estimated_step_s"] == pytest.approx(5 * US)
