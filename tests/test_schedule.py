"""The compiled step's schedule (``jaxdp.analysis.schedule``): what overlaps with what.

On CPU, what is true and asserted: XLA:CPU runs every collective as one synchronous
instruction (no ``-start``/``-done`` halves), and combines DDP's buckets into one
all-reduce after the last backward convolution, so DDP cannot overlap there; ZeRO-3 issues
unit i+1's all-gather before unit i's last forward convolution (forward prefetch), which
it can because that gather does not depend on unit i's output. The overlap itself
(asynchronous halves with compute between them) is a GPU check: it runs on a host with
two or more CUDA GPUs and is skipped elsewhere. docs/schedule.md has the evidence.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import tiny_resnet

from jaxdp.analysis import schedule as sched
from jaxdp.runtime.mesh import make_mesh
from jaxdp.models import fsdp_units
from jaxdp.optim import make_optimizer
from jaxdp.strategies import create_strategy
from jaxdp.loss.task import classifier

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


def test_ddp_on_cpu_reduces_after_the_whole_backward_synchronously():
    ops = sched.entry_ops(compiled_hlo("ddp", bucket_cap_mb=0.001))  # a bucket per few tensors, as written
    reduces = [o for o in ops if o.kind == "all-reduce" and o.phase == "other"]
    backward = [o.position for o in ops if o.kind == "conv" and o.phase == "backward"]
    assert backward and reduces and all(o.stage is None for o in ops)  # no async halves on CPU
    assert min(o.position for o in reduces) > max(backward)  # the buckets, combined, after the backward
    assert sched.async_overlap(ops) == []
    # The backward runs from the last unit to the first: what would let a GPU reduce early.
    last_conv = [max(positions(ops, "conv", "backward", u)) for u in UNITS]
    assert last_conv == sorted(last_conv, reverse=True)


def test_zero3_prefetches_the_next_units_params_in_forward():
    hlo = compiled_hlo("zero3")
    ops, operands = sched.entry_graph(hlo)
    for unit, following in zip(UNITS, UNITS[1:]):
        gather = min(positions(ops, "all-gather", "forward", following))
        convs = [o for o in ops if o.kind == "conv" and o.phase == "forward" and o.scope.startswith(unit)]
        assert gather < max(o.position for o in convs), (unit, following)  # issued before unit's compute ends
        first = next(o for o in ops if o.position == gather)
        assert not any(sched.depends_on(operands, first.name, c.name) for c in convs)
    text = sched.format_schedule(ops, "cpu")
    assert "all-gather x9              forward   layer2/0" in text and "async collectives: none" in text


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
        ("all-reduce", "start", "other", ""), ("conv", None, "backward", "l1"), ("all-reduce", "done", "other", ""),
        ("all-gather", "start", "forward", "l2"), ("all-gather", "done", "forward", "l2")]
    assert sched.async_overlap(ops) == [("all-reduce", "all-reduce-start", 1), ("all-gather", "ag-start", 0)]
    assert sched.depends_on(operands, "ag-done", "p") and not sched.depends_on(operands, "conv", "all-reduce-start")
    assert "2 start/done pairs, 1 with compute" in sched.format_schedule(ops)


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
