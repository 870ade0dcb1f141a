"""The compiled step's schedule (``jaxdp.analysis.schedule``): what overlaps with what.

On CPU, what is true and asserted: XLA:CPU runs every collective as one synchronous
instruction (no ``-start``/``-done`` halves); ZeRO-3 issues unit i+1's all-gather before unit
i's last forward convolution (forward prefetch), which it can because that gather does not
depend on unit i's output. The overlap itself (asynchronous halves with compute between them)
is read from XLA:GPU's schedule: a checked-in GPU compile (``fixtures/gpu_zero3_tiny.hlo``, trimmed)
and small hand-written texts here; test_gpu_target.py compiles the real thing in CI.
"""

import json
import os
import subprocess
import sys

from pathlib import Path

import numpy as np
import pytest
from helpers import tiny_resnet

from jaxdp.analysis import schedule as sched
from jaxdp.runtime.mesh import make_mesh
from jaxdp.models import fsdp_units
from jaxdp.optim import make_optimizer
from jaxdp.strategies import create_strategy
from jaxdp.loss.task import classifier

HERE = Path(__file__).parent
UNITS = ["layer1/0", "layer2/0", "layer3/0", "layer4/0"]  # the tiny ResNet-18's FSDP units, in forward order


def compiled_hlo(name, **options):
    model = tiny_resnet(dtype="float32")
    if name == "zero3":
        options["units"] = fsdp_units(model)
    s = create_strategy(name, model, classifier(model), make_optimizer("sgd", 0.1, momentum=0.9), make_mesh(2),
                        **options)
    rng = np.random.default_rng(0)
    batch = {"image": rng.normal(size=(4, 8, 8, 3)).astype(np.float32), "label": np.arange(4, dtype=np.int32)}
    state = s.engine.init_state(s.init_fn(__import__("jax").random.key(0), batch))
    return s.engine.lower_step(state, s.engine.shard_batch(batch)).compile().as_text()


def positions(ops, kind, phase, unit):
    return [o.position for o in ops if o.kind == kind and o.phase == phase and o.scope.startswith(unit)]


def test_ddp_on_cpu_reduces_its_buckets_one_by_one_synchronously():
    ops = sched.entry_ops(compiled_hlo("ddp", bucket_cap_mb=0.001))  # a bucket per few tensors, as written
    reduces = [o for o in ops if o.kind == "all-reduce" and o.phase == "other"]
    backward = [o.position for o in ops if o.kind == "matmul" and o.phase == "backward"]
    assert backward and reduces and all(o.stage is None for o in ops)  # no async halves on CPU
    assert len(reduces) >= 4  # one per bucket: ties.in_order keeps XLA from merging them
    assert sched.async_overlap(ops) == []
    # The backward runs from the last unit to the first: what lets a GPU reduce early.
    last_conv = [max(positions(ops, "matmul", "backward", u)) for u in UNITS]
    assert last_conv == sorted(last_conv, reverse=True)


def test_zero3_prefetches_the_next_units_params_in_forward():
    hlo = compiled_hlo("zero3")
    ops, operands = sched.entry_graph(hlo)
    for unit, following in zip(UNITS, UNITS[1:]):
        gather = min(positions(ops, "all-gather", "forward", following))
        convs = [o for o in ops if o.kind == "matmul" and o.phase == "forward" and o.scope.startswith(unit)]
        assert gather < max(o.position for o in convs), (unit, following)  # issued before unit's compute ends
        first = next(o for o in ops if o.position == gather)
        assert not any(sched.depends_on(operands, first.name, c.name) for c in convs)
    text = sched.format_schedule(ops, "cpu")
    assert "all-gather x" in text and "forward   layer2/0" in text and "async collectives: none" in text


def test_async_pairs_are_read_as_overlap():
    """A GPU-style schedule, written out: the reduction's halves with a convolution between."""
    hlo = """ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %all-reduce-start = f32[8]{0} all-reduce-start(%p), metadata={op_name="jit(f)/shard_map/psum"}
  %conv = f32[8]{0} convolution(%p, %p), metadata={op_name="jit(f)/transpose(jvp(Net))/l1/conv_general_dilated"}
  %all-reduce-done = f32[8]{0} all-reduce-done(%all-reduce-start)
  %ag-start = f32[16]{0} all-gather-start(%all-reduce-done), metadata={op_name="jit(f)/jvp(Net)/l2/all_gather"}
  ROOT %ag-done = f32[16]{0} all-gather-done(%ag-start)
}"""
    ops, operands = sched.entry_graph(hlo)
    assert [(o.kind, o.stage, o.phase, o.scope) for o in ops] == [
        ("all-reduce", "start", "other", ""), ("matmul", None, "backward", "l1"), ("all-reduce", "done", "other", ""),
        ("all-gather", "start", "forward", "l2"), ("all-gather", "done", "forward", "l2")]
    assert sched.async_overlap(ops) == [("all-reduce", "all-reduce-start", 1, 1, False),
                                        ("all-gather", "ag-start", 0, 0, False)]
    assert sched.depends_on(operands, "ag-done", "p") and not sched.depends_on(operands, "conv", "all-reduce-start")
    assert "2 start/done pairs, 1 with nothing between" in sched.format_schedule(ops)
    assert "1 with a matmul between them" in sched.format_schedule(ops)


def test_a_done_is_paired_with_its_own_start_not_the_next_of_its_kind():
    """Two gathers in flight, finished in the other order: each done names its start as its operand."""
    hlo = """ENTRY %main (p: f32[8]) -> f32[16] {
  %p = f32[8]{0} parameter(0)
  %ag-a = ((f32[8]{0}), f32[16]{0}) all-gather-start(%p), replica_groups={{0,1}}
  %ag-b = ((f32[8]{0}), f32[16]{0}) all-gather-start(%p), replica_groups={{0,1}}
  %gemm = f32[8]{0} custom-call(%p, %p), custom_call_target="__cublas$gemm"
  %ag-b-done = f32[16]{0} all-gather-done(%ag-b)
  %fusion.1 = f32[8]{0} fusion(%p), kind=kLoop, calls=%fused_add
  %ag-a-done = f32[16]{0} all-gather-done(%ag-a)
  ROOT %t = (f32[16]{0}, f32[16]{0}) tuple(%ag-a-done, %ag-b-done)
}"""
    pairs = {p.start: p for p in sched.async_overlap(sched.entry_ops(hlo))}
    assert (pairs["ag-a"].kernels, pairs["ag-a"].matmuls) == (2, 1)  # the gemm and the fusion (ag-b is no kernel)
    assert (pairs["ag-b"].kernels, pairs["ag-b"].matmuls) == (1, 1)  # the next done is its own, not ag-a's


def test_gpu_kernels_are_told_apart_by_what_they_run():
    """cuDNN convolutions and cuBLAS(Lt) GEMMs (custom calls), Triton GEMM fusions (by backend config),
    fusions whose computation holds a dot (a weight gradient JAX wrote as ``transpose``) are matmuls;
    other fusions and copies are kernels; bitcasts and tuples are not kernels; a pair XLA made
    synchronous (``is_sync``) overlaps nothing, whatever sits between its halves in the text."""
    hlo = """%fused_dot (a: f32[8,8], b: f32[8,8]) -> f32[8,8] {
  %a = f32[8,8]{1,0} parameter(0)
  %b = f32[8,8]{1,0} parameter(1)
  ROOT %d = f32[8,8]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (p: f32[8,8]) -> f32[8,8] {
  %p = f32[8,8]{1,0} parameter(0)
  %rs = ((f32[8,8]{1,0}), f32[4,8]{1,0}) reduce-scatter-start(%p), replica_groups={{0,1}}, dimensions={0}, backend_config={"collective_backend_config":{"is_sync":true}}
  %conv = (f32[8,8]{1,0}, u8[0]{0}) custom-call(%p, %p), custom_call_target="__cudnn$convBackwardFilter", metadata={op_name="jit(f)/transpose(jvp(Net))/b1/conv/conv_general_dilated"}
  %lt = f32[8,8]{1,0} custom-call(%p, %p), custom_call_target="__cublas$lt$matmul"
  %triton = f32[8,8]{1,0} fusion(%p, %p), kind=kCustom, calls=%gemm_fusion, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %wgrad = f32[8,8]{1,0} fusion(%p, %p), kind=kOutput, calls=%fused_dot, metadata={op_name="jit(f)/transpose(jvp(Net))/b1/fc/transpose"}
  %relu = f32[8,8]{1,0} fusion(%p), kind=kLoop, calls=%fused_max
  %copy = f32[8,8]{0,1} copy(%p)
  %bc = f32[64]{0} bitcast(%p)
  %rs-done = f32[4,8]{1,0} reduce-scatter-done(%rs)
  ROOT %out = f32[8,8]{1,0} add(%relu, %wgrad)
}"""
    ops = sched.entry_ops(hlo)
    kinds = {o.name: o.kind for o in ops}
    assert [kinds[n] for n in ("conv", "lt", "triton", "wgrad")] == ["matmul"] * 4
    assert [kinds[n] for n in ("relu", "copy", "out")] == ["kernel"] * 3 and "bc" not in kinds
    assert next(o for o in ops if o.name == "conv").phase == "backward"
    (pair,) = sched.async_overlap(ops)
    assert pair == ("reduce-scatter", "rs", 6, 4, True) and sched.overlapped([pair], matmul=False) == []


def test_a_real_gpu_schedule_is_read():
    """XLA:GPU's schedule of jaxdp's ZeRO-3 step (a ResNet-18 of one block per stage, 2 H100s; trimmed to
    the entry computation and the fusions that hold a dot): per unit, a forward gather one unit ahead,
    a backward re-gather and a reduce-scatter, each asynchronous and overlapping a convolution."""
    text = (HERE / "fixtures" / "gpu_zero3_tiny.hlo").read_text()
    ops = sched.entry_ops(text)
    pairs = sched.async_overlap(ops)
    gathers = [p for p in pairs if p.kind == "all-gather"]
    scatters = [p for p in pairs if p.kind == "reduce-scatter"]
    assert len(gathers) == 1 + 2 * 4 and len(scatters) == 4 + 1  # the root's, then per unit; per unit, then the root's
    assert gathers[0].sync and sched.overlapped(gathers[1:]) == gathers[1:]
    assert sched.overlapped(scatters[:-1]) == scatters[:-1]
    assert sum(o.kind == "matmul" for o in ops) > 20 and sched.bytes_accessed(text) > 0
    listed = sched.collective_list(text, [0, 0])
    assert [c["kind"] for c in listed if c["kind"] != "all-reduce"] == [p.kind for p in pairs if p.kind != "all-reduce"]
    assert all(c["async"] == (not p.sync) for c, p in zip(listed, pairs))
    assert not any(c["across_hosts"] for c in listed) and all(c["across_hosts"] for c in sched.collective_list(text, [0, 1]))


def _cuda_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


@pytest.mark.gpu
def test_gpu_overlaps_reductions_with_backward_compute(tmp_path):
    """In a subprocess (this process's JAX is pinned to the CPU): DDP's bucket all-reduces
    run asynchronously, at least one with backward compute between its halves, and the first
    issued before the first unit's last backward convolution."""
    if _cuda_gpus() < 2:
        pytest.skip(f"needs >= 2 CUDA GPUs (torch sees {_cuda_gpus()})")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    proc = subprocess.run([sys.executable, "-m", "jaxdp.cli", "inspect", "--strategy", "ddp", "--devices", "2",
                           "--width", "16", "--batch-per-device", "8", "--schedule", "--json"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    ops = [sched.Op(**op) for op in report["schedule"]]
    assert report["backend"] == "gpu"
    pairs = sched.async_overlap(ops)
    assert any(between for *_, between in pairs), sched.format_schedule(ops, "gpu")
    first_reduce = min(o.position for o in ops if o.kind == "all-reduce")
    assert first_reduce < max(positions(ops, "conv", "backward", "layer1")), sched.format_schedule(ops, "gpu")


def test_inspect_prints_the_schedule_it_measured(capsys):
    from jaxdp.cli.inspect_command import print_schedule

    op = sched.Op(3, "all-gather.1", "all-gather", None, "forward", "layer1/0/conv1", 2048.0)
    print_schedule({"backend": "cpu", "schedule": [op.__dict__]})
    print_schedule({})
    out = capsys.readouterr().out
    assert "in execution order; cpu" in out and "all-gather                 forward   layer1/0" in out
    assert "no schedule: --no-compile" in out
