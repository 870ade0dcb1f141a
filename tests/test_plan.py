"""jaxdp plan: the planner's numbers against the real step's, its batch search, and a model too big to build."""

import contextlib
import json
import os
import subprocess
import sys

import pytest

from jaxdp.analysis import inspect_strategy
from jaxdp.analysis.plan import largest_batch, meshes, plan, recommend
from jaxdp.cli.plan_command import memory_size
from jaxdp.cli.command import main

TINY = dict(width=4, blocks=(1, 1, 1, 1), image_size=16, optimizer="adam")


@pytest.fixture(scope="module")
def tiny_plan():
    # 8 images per device; the capacity leaves room for a few dozen more.
    return plan("resnet18", 4, 3 * 2**20, 32, strategies=("zero3",), **TINY)


def test_plan_equals_the_real_step_and_state(tiny_plan):
    """The abstract compile's memory is the real step's (``jaxdp inspect``: a built state, a real batch),
    and the state formula is the measured state (zero3: sharded params, gathered per unit in the step)."""
    row, = tiny_plan["rows"]
    real = inspect_strategy("zero3", 4, model="resnet18", batch_per_device=8, **TINY)
    assert row["strategy"] == "zero3" and row["memory"] == {**real["memory"], "total_bytes": row["memory"]["total_bytes"]}
    measured = real["state"]["measured"]
    state = measured["params"] + measured["opt"] + measured["extra"]
    assert row["state_bytes"] == pytest.approx(state, rel=0.05)
    assert row["traffic_bytes"] == real["traffic_formula_bytes"] > 0


def test_plan_largest_batch_is_checked(tiny_plan):
    row, = tiny_plan["rows"]
    assert row["fits"] and row["verified"] and row["max_batch_per_device"] > 16
    # The checked batch fits, and the fitted line puts one more image over the capacity.
    assert row["max_batch_bytes"] <= 3 * 2**20 < row["fixed_bytes"] + row["bytes_per_image"] * (
        row["max_batch_per_device"] + 1)


def test_the_least_traffic_that_fits_is_recommended():
    rows = [{"strategy": "ddp", "fits": False, "traffic_bytes": 2.0},
            {"strategy": "zero1", "fits": True, "traffic_bytes": 3.0},
            {"strategy": "zero2", "fits": True, "traffic_bytes": 2.0},
            {"strategy": "zero3", "fits": True, "traffic_bytes": 2.0}]
    assert recommend(rows) == 2  # zero2 over zero3: the same traffic, listed first
    assert recommend([{**row, "fits": False} for row in rows]) is None


def test_largest_batch_from_two_compiles_and_a_check():
    linear = {}
    result = largest_batch(lambda b: linear.setdefault(b, 1000 + 10 * b), 4, 1505)
    assert result["max_batch_per_device"] == 50 and result["verified"] and sorted(linear) == [4, 8, 50]
    # Growing faster than the line: the line says 45, which does not fit (1652); the line through
    # (8, 1086) and (45, 1652) says 35, which does (1472; the true largest is 36).
    curved = {}
    result = largest_batch(lambda b: curved.setdefault(b, 1000 + 10 * b + b * b // 10), 4, 1505)
    assert result["max_batch_per_device"] == 35 and result["verified"] and list(curved) == [4, 8, 45, 35]
    # Flat at first (XLA reusing buffers): doubled until it grows, then the line.
    flat = {}
    result = largest_batch(lambda b: flat.setdefault(b, max(1200, 1000 + 10 * b)), 4, 1505)
    assert result["max_batch_per_device"] == 50 and list(flat) == [4, 8, 16, 32, 56, 50]  # 56: 1560, over
    # Nothing fits: the state alone is too big.
    assert largest_batch(lambda b: 2000 + b, 4, 1505)["max_batch_per_device"] == 0


def test_hsdp_is_planned_on_every_two_axis_mesh():
    assert meshes("hsdp", 8) == [(2, 4), (4, 2)] and meshes("hsdp", 2) == [] and meshes("zero3", 8) == [None]


def test_memory_sizes():
    assert memory_size("80GiB") == 80 * 2**30 and memory_size("16GB") == 16e9 and memory_size("1024") == 1024
    assert memory_size("0.5 MiB") == 2**19


@pytest.mark.parametrize("argv,message", [
    (["--global-batch-size", "6"], "must split evenly over --devices 4"),
    (["--strategies", "dp"], "cannot plan dp"),
    (["--device-memory", "80 gigs"], "expected a size such as 80GiB"),
])
def test_cli_plan_refuses_in_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) if "gigs" in argv[-1] else contextlib.nullcontext():
        assert main(["plan", "--devices", "4", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_plan_needs_its_devices_simulated(capsys):
    """In a process whose XLA already has 8 devices (this one), 16 cannot be planned."""
    assert main(["plan", "--devices", "16", "--global-batch-size", "16"]) == 2
    assert "jax sees 8 devices, the plan needs 16" in capsys.readouterr().err


# The child's own peak: /proc's VmHWM belongs to the process's memory map, new at exec.
# (getrusage's ru_maxrss is not: Linux carries the parent's high-water mark across a
# vfork+exec, so an xdist worker that had grown to 2.4 GB made the child "peak" at 2.4 GB.)
_PLAN_AND_PEAK = ("import re, sys; from jaxdp.cli.command import main; status = main(sys.argv[1:]); "
                  "print(int(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read())[1]) * 1024, "
                  "file=sys.stderr); sys.exit(status)")


def test_plan_a_model_this_machine_could_never_hold_at_64_devices():
    """ResNet-18 (one block per stage) at width 1536: 2.8 G params, 34 GB of params and Adam state. Planned for 64 devices
    in a fresh process (simulating them) without allocating it: its peak resident memory stays small."""
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count"))
    argv = ["plan", "--devices", "64", "--device-memory", "40GiB", "--global-batch-size", "128", "--width", "1536",
            "--blocks", "1,1,1,1", "--optimizer", "adam", "--strategies", "ddp,zero3", "--no-verify", "--json"]
    done = subprocess.run([sys.executable, "-c", _PLAN_AND_PEAK, *argv], capture_output=True, text=True,
                          env=dict(os.environ, XLA_FLAGS=flags), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result, peak = json.loads(done.stdout), int(done.stderr.split()[-1])
    psi = result["psi"]
    ddp, zero3 = result["rows"]
    assert psi > 2.5e9 and ddp["state_bytes"] == 12 * psi  # f32 params + Adam's two moments, whole
    assert zero3["state_bytes"] == pytest.approx(12 * psi / 64, rel=0.01)
    assert not ddp["fits"] and zero3["fits"] and result["recommended"] == 1
    assert peak < 2 * 2**30 < 12 * psi / 10  # under 2 GiB resident, a tenth of the state it plans
