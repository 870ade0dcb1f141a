"""The legs' parity pairs (``.ci/torch_leg`` and ``.ci/jax_leg`` run this in their venvs): ddp,
zero1, zero3 and hsdp at N=2 in float64 and zero3 in bfloat16 (gradients reduced in float32, and
in bfloat16), on the parity tests' tiny ResNet, in one process (one JAX start and one forkserver
for every pair's torch ranks: a fraction of six
``jaxdp parity`` runs). Prints the versions, then PASS or FAIL per pair with its largest error,
and the full report of a failing pair; exit status 1 if any failed.

    python .ci/parity_leg.py [--out runs/torch-leg] [--leg "jax leg"]
"""

import argparse
import os
import sys
import time

from jaxdp.runtime.mesh import simulate_cpu_devices

simulate_cpu_devices(2)  # before JAX starts

import jax  # noqa: E402
import torch  # noqa: E402

from parity_tests import report  # noqa: E402
from parity_tests.config import ParityConfig  # noqa: E402
from parity_tests.runner import run_parity  # noqa: E402

TINY = dict(model="resnet18", width=4, blocks=(1, 1, 1, 1), image_size=16, batch_per_device=8, steps=4, devices=2)
SGD = dict(optimizer="sgd", lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
ADAM = dict(optimizer="adam", lr=1e-3, betas=(0.9, 0.99), weight_decay=1e-4)
PAIRS = {
    "ddp float64": dict(strategy="ddp", dtype="float64", **SGD),
    "zero1 float64": dict(strategy="zero1", dtype="float64", **ADAM),
    "zero3 float64": dict(strategy="zero3", dtype="float64", **ADAM),
    "hsdp float64": dict(strategy="hsdp", dtype="float64", **SGD),
    "zero3 bfloat16": dict(strategy="zero3", dtype="bfloat16", **ADAM),  # FSDP2's bf16 policies, BatchNorm fp32
    # ... with gradients reduce-scattered in bf16 (MixedPrecisionPolicy(reduce_dtype=bf16))
    "zero3 bf16 reduce": dict(strategy="zero3", dtype="bfloat16", reduce_dtype="bfloat16", **ADAM),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/torch-leg", help="each pair's report (JSON) goes here")
    parser.add_argument("--leg", default="torch leg", help="the name its lines start with")
    args = parser.parse_args(argv)
    versions = f"torch {torch.__version__}, jax {jax.__version__}"
    print(f"{args.leg}: {versions}", flush=True)
    rows, failed = [], []
    for name, options in PAIRS.items():
        start = time.time()
        result = run_parity(ParityConfig(**TINY, **options))
        os.makedirs(args.out, exist_ok=True)
        report.write_json(result, f"{args.out}/{name.replace(' ', '-')}.json")
        status = "PASS" if result.passed else "FAIL"
        rows.append(f"  {name:<15} {status}  {time.time() - start:5.0f}s  {result.message()}")
        print(rows[-1], flush=True)
        if not result.passed:
            failed.append(name)
            report.print_report(result)
    print(f"{args.leg} ({versions}), N=2:")
    print("\n".join(rows))
    print(f"{args.leg}: {'FAIL: ' + ', '.join(failed) if failed else 'PASS'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
