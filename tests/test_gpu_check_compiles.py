"""gpu-check's jax programs compile for one H100 on this CPU machine: a GPU-only compile error shows up
here, not in the first minute of a lent GPU (issue 43, item 6).

Every GPU pair of gpu-check's one-GPU plan (``python -m torch_commands.gpu_check --dry-run --devices 1``,
read from the plan code: ResNet-18 w64 in float32 under every strategy, zero3 in bf16, ddp and zero3 in
float64, the ViT in float32 and bf16) has its jax side built as ``jaxdp parity`` builds it on that GPU
(the host's plan, parity mode's XLA flags, the highest matmul precision, x64 for float64, the optimizer,
``return_grads``, hsdp's 1x1 mesh) and compiled for a compile-only H100 from shapes
(``parity_tests.runner.compile_for_target``): XLA:GPU's whole pipeline and ptxas, nothing run. ``dp`` is
``jax.pmap``, which in jax 0.10 lowers and compiles for compile-only devices as jit does; its per-device
layout comes from ``PmapEngine.step_shapes``.

What it found first (jax 0.10.2): the ViT's steps did not compile ("Couldn't find output tile sizes":
XLA's Triton GEMM with its one untuned tiling, whatever parity mode's flags; parity mode now sends
matmuls to cuBLAS, as torch's); zero1's and zero2's took 105 and 135 s to compile where ddp's took 28
on shared cores (one device's buckets: ``layout.gather_group``); and hsdp's did not trace at 6eeb85c, its returned
gradients typed as varying over ``replica`` (``ties.after``, fixed in 5ee562b).

The compiles run in one subprocess (``gpu_check_compile_job.py``) with the user's XLA flags, not the
suite's: 11 compiles, about 130 CPU-seconds on 2 cores (12 a pair; 2.5 to 5 minutes of wall time while
other work shared the cores). They need JAX's CUDA plugin (``make install-gpu-target``): without it these tests skip, except
where ``JAXDP_REQUIRE_GPU_TARGET`` is set, as in CI, where they fail.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from helpers import require_plugin
from jaxdp.runtime.target import GPUS

HERE = Path(__file__).parent
JOB = HERE / "gpu_check_compile_job.py"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, module_user_env):
    """The job's report: each GPU pair of the one-GPU plan, compiled for one H100 or its error."""
    require_plugin()
    out = tmp_path_factory.mktemp("gpu-check-compiles") / "report.json"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(JOB), str(out), "h100"], env=module_user_env, capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    report["seconds"] = time.perf_counter() - start
    print(f"\n{report['target']}: {len(report['pairs'])} pairs in {report['seconds']:.0f} s")
    for name, pair in report["pairs"].items():
        print(f"  {name}: {'compiled' if pair['compiled'] else pair['error']} ({pair['seconds']:.1f} s)")
    return report


def test_every_gpu_pair_of_the_one_gpu_plan_compiles_for_an_h100(compiled):
    failed = {name: pair["error"] for name, pair in compiled["pairs"].items() if not pair["compiled"]}
    assert not failed, "\n".join(f"{name}: {error}" for name, error in failed.items())
    assert compiled["xla_flags_in_effect"], "parity mode's XLA flags were set after jax started"


def test_the_plan_holds_both_models_every_dtype_and_every_strategy(compiled):
    """The pairs compiled are the plan's: a plan that lost its pairs (no torch, a budget cut) would pass
    the test above with nothing in it."""
    from torch_commands.gpu_check.plan import REALISTIC, REALISTIC_DTYPES, RESNET, strategies

    pairs = compiled["pairs"].values()
    assert {p["size"] for p in pairs} == set(REALISTIC) and not compiled["left_out"]
    assert {p["dtype"] for p in pairs if p["size"] == RESNET} == set(REALISTIC_DTYPES)
    assert [p["strategy"] for p in pairs if (p["size"], p["dtype"]) == (RESNET, "float32")] == list(strategies())


def test_each_program_is_cudas_and_fits_an_h100(compiled):
    """Built for the GPU as the run would be (torch on nccl, so TF32 off and the highest matmul precision),
    convolutions by cuDNN, and the step's memory (the donated state counted once) within the H100's."""
    from jaxdp.analysis.plan import with_total

    for name, pair in compiled["pairs"].items():
        if pair["compiled"]:  # the others fail the test above
            assert pair["cuda"] and pair["cudnn_convolutions"] > 0, name
            assert 0 < with_total(pair["memory"])["total_bytes"] <= GPUS["h100"].memory_bytes, (name, pair["memory"])


def described(tree):
    return jax.tree_util.tree_map(lambda x: (tuple(x.shape), str(x.dtype), x.sharding.spec), tree)


def one_gpu_pairs():
    """The GPU pairs of the one-GPU plan, from the plan code (no parity mode: this process's jax runs)."""
    from torch_commands.gpu_check.plan import GPU, REALISTIC_DTYPES, make_plan, strategies

    plan = make_plan("gpu", 1, "nccl", REALISTIC_DTYPES, strategies(), "runs/unused", dry_run=True, bench=False)
    return [p for p in plan.pairs if p.where == GPU]


@pytest.mark.parametrize("pair", one_gpu_pairs(), ids=lambda p: p.id)
def test_the_shapes_compiled_are_the_parity_runs_state_and_batch(pair):
    """What the compile starts from (``engine.step_shapes``: shapes and shardings, nothing allocated) is,
    leaf for leaf, the state and the batch that ``run_jax`` steps from: torch's initial weights in the
    run's dtype (bf16: float32 master weights) placed by the strategy; for ``dp``, pmap's copy per device."""
    from parity_tests.inputs import init_state_dict, make_batches
    from parity_tests.jax_side import global_batch, initial_state, jax_strategy
    from parity_tests.plan import plan
    from torch_commands.gpu_check.plan import parity_config

    cfg = parity_config(pair.argv)
    p = plan(cfg, gpus=1)
    batch = global_batch(*make_batches(cfg)[0])
    with jax.enable_x64(cfg.dtype == "float64"):
        strategy = jax_strategy(p, jax.devices()[:1])
        ran = initial_state(p, strategy, init_state_dict(cfg)), strategy.engine.shard_batch(batch)
        assert described(strategy.engine.step_shapes(batch)) == described(ran)
