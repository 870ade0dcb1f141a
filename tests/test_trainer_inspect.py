"""``trainer.inspect``: the LM examples' own Trainers (NNX and Linen), built on 2 CPU devices, compiled
for compile-only H100s (``jaxdp.analysis.trainer_inspect``): each under zero3 on one host of 8 and
under hsdp on 2 hosts of 8.

The compiles run in a subprocess with the user's XLA flags (``trainer_inspect_job.py``), as
test_gpu_target.py's do; they need JAX's CUDA plugin (``make install-gpu-target``) and skip without it,
except where ``JAXDP_REQUIRE_GPU_TARGET`` is set.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import require_plugin

HERE = Path(__file__).parent
JOB = HERE / "trainer_inspect_job.py"
JOBS = {"nnx-zero3": "nnx:zero3:1", "linen-zero3": "linen:zero3:1", "nnx-hsdp": "nnx:hsdp:2",
        "linen-hsdp": "linen:hsdp:2"}
ROWS_PER_DEVICE, TOKENS = 4, 17  # 8 example rows on 2 devices; examples' SEQ + 1 int32 tokens a row


@pytest.fixture(scope="module")
def reports(tmp_path_factory, module_user_env):
    require_plugin()
    out = tmp_path_factory.mktemp("trainer_inspect")
    env = dict(module_user_env, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, str(JOB), str(out), *[f"{k}={v}" for k, v in JOBS.items()]], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {name: json.loads((out / f"{name}.json").read_text()) for name in JOBS} | \
        {f"{name}-no-compile": json.loads((out / f"{name}-no-compile.json").read_text()) for name in JOBS}, env


@pytest.mark.parametrize("name", JOBS)
def test_argument_bytes_are_the_formulas_sharded_state_and_the_batch(reports, name):
    """To the byte: the formula's padded params and AdamW moments per device, AdamW's step count, the
    batch's rows per device, and the step counter (4 bytes each)."""
    r = reports[0][name]
    state = sum(r["state"]["formula_padded"][part] for part in ("params", "opt", "extra"))
    assert r["batch_bytes"] == ROWS_PER_DEVICE * TOKENS * 4 and r["batch_per_device"] == ROWS_PER_DEVICE
    assert r["memory"]["argument_bytes"] == state + r["state"]["measured"]["opt_scalars"] + r["batch_bytes"] + 4
    assert r["state"]["measured"]["params"] == r["state"]["formula_padded"]["params"]


@pytest.mark.parametrize("flavour", ["nnx", "linen"])
def test_the_trainers_axes_are_laid_over_the_targets_gpus(reports, flavour):
    """zero3 built on data=2 CPU devices: data=8 H100s. hsdp built on replica=2 x data=1: one shard group
    per host of 8, its replica all-reduce the only traffic between hosts."""
    zero3, hsdp = reports[0][f"{flavour}-zero3"], reports[0][f"{flavour}-hsdp"]
    assert (zero3["mesh"], zero3["hosts"], zero3["target"]) == ({"data": 8}, 1, "h100")
    assert (hsdp["mesh"], hsdp["hosts"], hsdp["devices"]) == ({"replica": 2, "data": 8}, 2, 16)
    assert not any(c["across_hosts"] for c in zero3["collectives"])
    assert {"all-gather", "reduce-scatter"} <= {c["kind"] for c in zero3["collectives"]}
    across = {c["kind"] for c in hsdp["collectives"] if c["across_hosts"]}
    assert across == {"all-reduce"} and {"all-gather", "reduce-scatter"} <= {c["kind"] for c in hsdp["collectives"]}
    for r in (zero3, hsdp):
        assert r["exposed_communication_s"] == pytest.approx(sum(c["exposed_s"] for c in r["collectives"]))
        assert r["estimated_step_s"] == pytest.approx(r["kernels_s"] + r["exposed_communication_s"])


def test_the_cli_prints_the_trainers_report(reports):
    """``jaxdp inspect --trainer MODULE:FUNCTION --json`` is ``trainer.inspect``'s report (without
    compiling here: the same state, formulas and batch)."""
    env = dict(reports[1], PYTHONPATH=os.pathsep.join([str(HERE), reports[1].get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "jaxdp.cli", "inspect", "--target", "h100", "--devices", "8",
                           "--trainer", "trainer_inspect_job:nnx_zero3", "--no-compile", "--json"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout) == reports[0]["nnx-zero3-no-compile"]
