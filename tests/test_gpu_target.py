"""GPU programs without a GPU: jaxdp's real ResNet-18 step (width 64, bfloat16, 64 images per device)
compiled for 8 compile-only H100s (``jaxdp.runtime.target``), and what XLA:GPU's schedule and
buffer assignment say about it.

The compiles run in a subprocess with the user's XLA flags, not the suite's (``gpu_target_job.py``,
which also makes ``jax.devices()`` fail: a target's mesh is built from its own devices). They need
JAX's CUDA plugin in its own directory (``make install-gpu-target``; ``make test`` installs it). Without
it these tests skip, except where ``JAXDP_REQUIRE_GPU_TARGET`` is set, as CI sets it: there they fail.

What is asserted, and why not more. The collectives' *order* is jaxdp's (data dependences,
``strategies/ties.py`` and ``units.Lead``): ZeRO-3 gathers each unit on its own, forward and backward,
one unit ahead, and reduce-scatters per unit; DDP's buckets stay separate. *Where* XLA puts each
start between those bounds is its latency-hiding scheduler's choice, from its cost model: without a
GPU nothing is autotuned, a cuDNN convolution is priced at a flat 10 us and a BatchNorm reduction at
17 us, and a window is sized to the collective's estimated time. So every collective here must
overlap compute, and most must have a convolution inside their window; which ones is XLA's call.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from helpers import require_plugin
from jaxdp.models import create_model
from jaxdp.runtime import target as gpu_target

HERE = Path(__file__).parent
JOB = HERE / "gpu_target_job.py"
STRATEGIES = {"ddp": "ddp:bucket_cap_mb=2", "zero1": "zero1", "zero2": "zero2", "hsdp": "hsdp:mesh_shape=2x4"}
ZERO3_BEFORE_TEMP = 168.1 * 2**20  # ResNet-18 w64 bf16 at 8xH100, before prefetch (docs/design-notes.md)
UNITS = 8  # ResNet-18's residual blocks
MIB = 2**20


def run_job(out, env, target, per_host, hosts, width, blocks, jobs: dict, timeout=900) -> dict:
    args = [sys.executable, str(JOB), str(out), target, str(per_host), str(hosts), str(width), blocks,
            *[f"{name}={spec}" for name, spec in jobs.items()]]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {name: json.loads((Path(out) / f"{name}.json").read_text()) for name in jobs}


@pytest.fixture(scope="module")
def h100x8(tmp_path_factory, module_user_env):
    """Each strategy's report, and zero3's from ``jaxdp inspect --target ... --json`` itself (timed)."""
    require_plugin()
    user_env = module_user_env
    out = tmp_path_factory.mktemp("h100x8")
    reports = run_job(out, user_env, "h100", 8, 1, 64, "-", STRATEGIES)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "jaxdp.cli", "inspect", "--target", "h100", "--devices", "8",
                           "--strategy", "zero3", "--model", "resnet18", "--width", "64", "--dtype", "bfloat16",
                           "--batch-per-device", "64", "--schedule", "--json"], env=user_env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports["zero3"] = json.loads(proc.stdout)
    reports["zero3"]["cli_s"] = time.perf_counter() - start
    return reports


def of_kind(report, kind):
    return [c for c in report["collectives"] if c["kind"] == kind]


def overlaps(c, matmul=False) -> bool:
    return c["async"] and (c["matmul_between"] if matmul else c["compute_between"]) > 0


def test_the_cli_report_has_the_keys_scripts_read(h100x8):
    r = h100x8["zero3"]
    assert r["cli_s"] < 120, f"jaxdp inspect --target took {r['cli_s']:.0f} s"
    assert (r["target"], r["devices"], r["hosts"]) == ("h100", 8, 1)
    assert {"argument_bytes", "output_bytes", "temp_bytes"} <= set(r["memory"])
    assert r["estimated_step_s"] > 0 and r["compute_s"] > 0 and r["memory_s"] > 0
    for c in r["collectives"]:
        assert {"kind", "bytes", "groups", "async", "compute_between", "matmul_between", "exposed_s"} <= set(c)
        assert all(0 <= d < 8 for group in c["groups"] for d in group)


@pytest.mark.parametrize("name", ["ddp", "zero3"])
def test_exposed_communication_is_each_collectives_and_they_add_up(h100x8, name):
    """Each collective is hidden only by the kernels in its own window (``jaxdp.analysis.estimate``):
    zero3's largest forward gather (the last block's, one kernel in its window) is mostly exposed,
    where the estimate before counted any window with a kernel in it as hiding the whole collective
    (0.58 us exposed over the whole step)."""
    r = h100x8[name]
    assert r["exposed_communication_s"] == pytest.approx(sum(c["exposed_s"] for c in r["collectives"]))
    assert r["estimated_step_s"] == pytest.approx(r["kernels_s"] + r["exposed_communication_s"])
    assert 0 < r["exposed_communication_s"] < r["communication_s"]
    if name == "zero3":  # the largest forward gather (the last block's) had one convert kernel in its window
        forward = [c for c in r["collectives"] if c["kind"] == "all-gather" and c["async"]][:9]
        biggest = max(forward, key=lambda c: c["bytes"])
        alone = biggest["ring_bytes"] / gpu_target.GPUS["h100"].nvlink_bandwidth
        assert overlaps(biggest, matmul=True) and 0 <= biggest["exposed_s"] < alone  # now convolutions hide it


def windows(report, kind, phase):
    """Each ``kind`` start/done pair of ``phase`` in the schedule: (the unit it moves, the units whose
    kernels run between its halves). A unit is a block's module path (``layer2/1``)."""
    ops = report["schedule"]
    done = {o["start"]: i for i, o in enumerate(ops) if o["stage"] == "done"}
    out = []
    for i, o in enumerate(ops):
        if o["kind"] == kind and o["stage"] == "start" and o["phase"] == phase and o["scope"] in BLOCKS:
            between = ops[i + 1:done[o["name"]]]
            out.append((o["scope"], {unit_of(k["scope"]) for k in between if k["kind"] in ("kernel", "matmul")}))
    return out


def unit_of(scope: str) -> str:
    return "/".join(scope.split("/")[:2])


BLOCKS = [f"layer{stage}/{block}" for stage in (1, 2, 3, 4) for block in (0, 1)]  # forward order


@pytest.mark.parametrize("name", ["zero3", "hsdp"])
def test_zero3_gathers_each_unit_forward_and_backward_one_unit_ahead(h100x8, name):
    """Every unit gathered on its own, in forward and again in backward (16 for 8 units, plus the root's),
    each after the first asynchronous with compute between its halves. Before: 14 all-gathers, 10 with
    nothing between their halves. hsdp: the same within each host's shard group."""
    r = h100x8[name]
    gathers = of_kind(r, "all-gather")
    assert len(gathers) >= 2 * UNITS
    assert all(overlaps(c) for c in gathers[1:]), [(c["name"], c["compute_between"]) for c in gathers]
    if name == "zero3":  # the last unit's re-gather may start with its own forward: a convolution in its window
        assert sum(overlaps(c, matmul=True) for c in gathers[1:]) >= 12
    print(f"{name}: {sum(overlaps(c, matmul=True) for c in gathers[1:])} of {len(gathers) - 1} gathers after the "
          "first have a convolution between their halves")


@pytest.mark.parametrize("name", ["zero3", "hsdp"])
def test_zero3_prefetches_forward_and_backward(h100x8, name):
    """FSDP2's prefetch, read off the schedule: unit k+1's forward gather runs beside the compute of the
    units before it (unit k's, or XLA moves it into the tail of the one before); in backward, unit k's
    re-gather beside the backward of the units after it, the last unit's beside the head's. In order."""
    r = h100x8[name]
    forward, backward = windows(r, "all-gather", "forward"), windows(r, "all-gather", "backward")
    # The first unit has no unit before it to follow: XLA may merge its gather into the root's.
    assert [unit for unit, _ in forward] in (BLOCKS, BLOCKS[1:]) and [unit for unit, _ in backward] == BLOCKS[::-1]
    for unit, running in forward[1:]:  # unit k+1's gather runs beside earlier units' compute
        assert running & set(BLOCKS[:BLOCKS.index(unit)]), f"{unit}'s gather overlaps no earlier unit: {running}"
    for unit, running in backward:  # unit k's re-gather beside later units' backward (the last: the head's)
        # The last unit's re-gather may start with its own forward (its params then stay gathered to its
        # backward, as torchtitan keeps the last block's): the head's few kernels left it synchronous.
        later = set(BLOCKS[BLOCKS.index(unit) + 1:]) or {"fc", "", unit}  # the root's head: fc, pooling, the loss
        assert running & later, f"{unit}'s re-gather overlaps no backward before its own: {running}"


@pytest.mark.parametrize("name", ["zero3", "hsdp"])
def test_zero3_reduce_scatters_each_unit_as_its_backward_ends(h100x8, name):
    """One reduce-scatter per unit, in backward order (before: one, combined, after the whole backward),
    each overlapping the backward of units still to come (the one before it, or, where XLA's schedule
    starts it later, the one before that); then the root's."""
    r = h100x8[name]
    scatters = windows(r, "reduce-scatter", "backward")
    assert [unit for unit, _ in scatters] == BLOCKS[::-1]
    for unit, running in scatters[:-1]:
        earlier = set(BLOCKS[:BLOCKS.index(unit)])
        assert running & earlier, f"{unit}'s reduce-scatter overlaps no later backward: {running}"
    assert len(of_kind(r, "reduce-scatter")) == UNITS + 1  # and the root's, last
    print(f"{name}: {sum(overlaps(c, matmul=True) for c in of_kind(r, 'reduce-scatter'))} of "
          f"{UNITS + 1} reduce-scatters have a convolution between their halves")


ZERO3_GATHERED_BEFORE = 79.9e6  # all-gather output bytes per step and device with float32 gathers (70.5 MB of them)


def test_zero3_gathers_the_bf16_it_computes_in(h100x8):
    """Each conv kernel and the fc cast to bfloat16 before the all-gather (FSDP2's param_dtype=bfloat16),
    the BatchNorm scales and shifts gathered as the float32 they are used in: 44.7 MB, from 79.9."""
    gathered = h100x8["zero3"]["traffic"]["ops"]["all-gather"]
    assert gathered["output_bytes"] <= 48e6 < ZERO3_GATHERED_BEFORE
    assert gathered["output_by_dtype"]["bf16"] > 50 * gathered["output_by_dtype"].get("f32", 0)


def test_zero3_temp_memory_stays_within_a_quarter_of_before(h100x8):
    """Prefetching keeps two units' params alive at most: temp must not grow past 1.25x (it fell)."""
    assert h100x8["zero3"]["memory"]["temp_bytes"] <= 1.25 * ZERO3_BEFORE_TEMP


def test_ddp_buckets_stay_separate_and_overlap_the_backward(h100x8):
    """A 2 MiB bucket cap: one all-reduce per bucket (XLA would merge them into two), every bucket but
    the last with compute between its halves."""
    reduces = of_kind(h100x8["ddp"], "all-reduce")
    assert len(reduces) >= 4
    assert all(overlaps(c) for c in reduces[:-1]), [(c["name"], c["compute_between"]) for c in reduces]


@pytest.mark.parametrize("name", ["zero1", "zero2"])
def test_zero1_and_zero2_buckets_overlap(h100x8, name):
    """zero1's and zero2's bucketed gathers of the updated params, zero2's bucketed reduce-scatters: every
    one asynchronous, with compute between its halves (the gathers run while the backward goes on)."""
    r = h100x8[name]
    moving = of_kind(r, "all-gather") + of_kind(r, "reduce-scatter")
    assert moving and all(overlaps(c) for c in moving), [(c["name"], c["compute_between"]) for c in moving]


@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2", "zero3", "hsdp"])
def test_argument_bytes_are_the_formulas_state_and_the_batch(h100x8, name):
    """To the byte, as on CPU: the formula's model state (padded), the batch, the BatchNorm statistics
    (replicated) and the step counter."""
    assert_arguments_are_state_and_batch(h100x8[name], create_model("resnet18", width=64, dtype="bfloat16"))


def assert_arguments_are_state_and_batch(r, net):
    shapes = jax.eval_shape(net.init, jax.random.key(0), jnp.zeros((2, 32, 32, 3), jnp.bfloat16))["batch_stats"]
    stats = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(shapes))
    state = sum(r["state"]["formula_padded"][part] for part in ("params", "opt", "extra"))
    assert r["batch_bytes"] == 64 * (32 * 32 * 3 * 2 + 4)
    assert r["memory"]["argument_bytes"] - state - r["batch_bytes"] - stats == 4, r["strategy"]


def test_dp_compiles_for_a_target_in_pmaps_layout(tmp_path, module_user_env):
    """dp (``jax.pmap``) from the engine's own step shapes: every leaf with its leading device axis.
    (Before, ``inspect --target --strategy dp`` failed deep inside jax with an IndexError.)"""
    require_plugin()
    r = run_job(tmp_path, module_user_env, "h100", 2, 1, 8, "1,1,1,1", {"dp": "dp"})["dp"]
    assert (r["target"], r["devices"], r["strategy"]) == ("h100", 2, "dp")
    assert_arguments_are_state_and_batch(r, create_model("resnet18", width=8, blocks=(1, 1, 1, 1), dtype="bfloat16"))


def test_every_gathered_byte_is_counted(h100x8):
    """The per-collective list adds up to the per-kind traffic (the async starts' outputs read right)."""
    for name, r in h100x8.items():
        listed = sum(c["runs"] * c["ring_bytes"] for c in r["collectives"])
        assert listed == pytest.approx(r["traffic"]["ring_bytes"]), name
    zero2 = h100x8["zero2"]
    assert zero2["traffic"]["ring_bytes"] == pytest.approx(zero2["traffic_formula_bytes"], rel=0.02)


# ----------------------------------------------------------------------------- the plugin's place

def python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_no_one_who_asks_for_no_target_meets_the_plugin(module_user_env):
    """With the plugin installed, a plain ``import jax`` (a user's script, jaxdp train, the tests) starts
    its backend without a word about CUDA, and importing jaxdp sets neither JAX_PLATFORMS nor the CUDA
    check. Control: the same script with the plugin's directory on the path prints what the user would
    otherwise see."""
    require_plugin()
    env = {k: v for k, v in module_user_env.items() if k != "JAX_PLATFORMS"}
    code = ("import os, jax, jaxdp, jaxdp.runtime.target, jaxdp.analysis; jax.devices(); "
            "print(os.environ.get('JAX_PLATFORMS'), os.environ.get('JAX_SKIP_CUDA_CONSTRAINTS_CHECK'))")
    plain = python(code, env)
    assert plain.returncode == 0 and plain.stdout.split() == ["None", "None"], plain.stderr[-2000:]
    assert "cuda" not in plain.stderr.lower()
    exposed = python(code, dict(env, PYTHONPATH=gpu_target.plugin_dir()))
    assert "cuda" in (exposed.stderr + exposed.stdout).lower()


def jaxdp_cli(*args, env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxdp.cli", *args], env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("args, says", [
    (("inspect", "--target", "h300"), "unknown GPU target 'h300'; choose from h100, h200, a100"),
    (("inspect", "--hosts", "2"), "--hosts needs --target"),
    (("inspect", "--target", "h100", "--devices", "0"), "--devices must be a positive integer with --target"),
    (("plan", "--target", "h100", "--devices", "9", "--hosts", "2"), "--devices 9 must split evenly over --hosts 2"),
])
def test_a_bad_target_is_one_line(args, says, module_user_env):
    proc = jaxdp_cli(*args, env=module_user_env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"jaxdp: error: {says}"), proc.stderr


def test_without_the_plugin_a_target_says_how_to_install_it(tmp_path, module_user_env):
    proc = jaxdp_cli("inspect", "--target", "h100", "--devices", "2", "--width", "4", "--blocks", "1,1,1,1",
                     env=dict(module_user_env, JAXDP_GPU_TARGET_DIR=str(tmp_path)))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "needs JAX's CUDA plugin" in lines[0] and "make install-gpu-target" in lines[0]
