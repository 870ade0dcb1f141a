#!/usr/bin/env bash
# One lent GPU's session, prepared so that its minutes test the GPU, not the plan (issue 38).
# The device tool runs one command of at most 600 s per call and lends 15 minutes in all, start-up
# included, so the session is two calls on the stock image (jax, flax, optax, orbax, torch; no network):
#
#   bash benchmarks/gpu_session.sh check   # make gpu-check, hard stop 520 s: reports in $OUT/gpu-check
#   bash benchmarks/gpu_session.sh bench   # make gpu-bench with the mock 8-GPU row, 300 s: $OUT/gpu-bench
#
# Each call installs the project without dependencies (the image's own), records nvidia-smi and the
# versions, and copies its reports to $OUT (runs/ when OUT is unset). The exit status is the command's:
# 0 PASS, 1 FAIL, 3 INCOMPLETE (a planned pair or component did not run).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-runs}"
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$out/install.log" 2>&1 || cat "$out/install.log"
{ nvidia-smi || true; python3 -c "import jax, torch; print('jax', jax.__version__, jax.devices()); print('torch', torch.__version__, torch.cuda.device_count())"; } > "$out/host.txt" 2>&1
case "${1:-}" in
  check)
    make --no-print-directory gpu-check PYTHON=python3 GPU_CHECK_ARGS="--deadline 520 --out $out/gpu-check"
    ;;
  bench)
    make --no-print-directory gpu-bench PYTHON=python3 GPU_BENCH_ARGS="--mock-gpus 8 --deadline 300 --out $out/gpu-bench"
    ;;
  *)
    echo "usage: bash benchmarks/gpu_session.sh check|bench" >&2
    exit 2
    ;;
esac
