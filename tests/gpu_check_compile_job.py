"""Compile the jax side of every GPU pair of gpu-check's one-GPU plan for a compile-only GPU, and write
what each gave as JSON (test_gpu_check_compiles.py).

    python tests/gpu_check_compile_job.py OUT.json [TARGET]     # TARGET: h100 (default), h200, a100

The plan is gpu-check's own (``--dry-run --devices 1``: its pairs, in its order, with its budget), and so
is the set-up before jax starts (parity mode's XLA flags). Each pair's program is the one ``jaxdp parity``
runs on that GPU (``parity_tests.runner.compile_for_target``), compiled and never run. ``jax.devices()``
fails here: a target's mesh must be built from the target's devices alone.
"""

import argparse
import json
import sys
import tempfile
import time

from gpu_target_job import forbid_local_devices


def one_gpu_plan(out: str):
    """The GPU pairs and the notes of the plan ``python -m torch_commands.gpu_check --dry-run --devices 1``
    prints (``prepare`` also sets parity mode's XLA flags, as it does before a GPU run)."""
    from torch_commands.gpu_check.command import add_args, prepare
    from torch_commands.gpu_check.plan import GPU

    parser = argparse.ArgumentParser()
    add_args(parser)
    plan = prepare(parser.parse_args(["--dry-run", "--devices", "1", "--out", out]))
    return [p for p in plan.pairs if p.where == GPU], plan.left_out


def compile_pair(pair, target) -> dict:
    """Compiled (its memory and cuDNN convolutions) or not (the error's first line), and the seconds."""
    from jaxdp.analysis.hlo import compiled_memory
    from parity_tests.runner import compile_for_target
    from torch_commands.gpu_check.plan import parity_config

    start = time.perf_counter()
    try:
        plan, compiled = compile_for_target(parity_config(pair.argv), target)
    except Exception as e:  # every pair is tried: one report names each failure
        lines = [line for line in str(e).splitlines() if line.strip()] or [""]
        return {"compiled": False, "error": f"{type(e).__name__}: {lines[0][:400]}", "detail": str(e)[-4000:],
                "seconds": time.perf_counter() - start}
    text = compiled.as_text()
    return {"compiled": True, "seconds": time.perf_counter() - start, "memory": compiled_memory(compiled),
            "cudnn_convolutions": text.count('custom_call_target="__cudnn$conv'),
            "cuda": plan.cuda, "torch_twin": plan.torch_strategy}


def main(out: str, target_name: str = "h100") -> None:
    forbid_local_devices()
    from jaxdp.runtime.target import Target
    from parity_tests import parity_mode

    with tempfile.TemporaryDirectory() as plan_out:  # a dry run writes nothing; its pairs' out paths go here
        pairs, left_out = one_gpu_plan(plan_out)
    target = Target.parse(target_name, devices=1, hosts=1)
    report = {"target": target.describe(), "device_memory": target.gpu.memory_bytes, "left_out": left_out,
              "xla_flags_in_effect": parity_mode.xla_flags_in_effect(), "pairs": {}}
    for pair in pairs:
        report["pairs"][pair.id] = dict(compile_pair(pair, target), command=pair.command, strategy=pair.strategy,
                                        dtype=pair.dtype, size=pair.size)
        got = report["pairs"][pair.id]
        print(f"{pair.id}: {'compiled' if got['compiled'] else got['error']} ({got['seconds']:.1f} s)", flush=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
