# Entry points: `make train` (the quickstart run), `make test` (the suite), on a host with
# NVIDIA GPUs (one or more) `make gpu-check` (parity of every strategy on the GPUs at realistic
# sizes, report in runs/gpu-check/) and `make gpu-bench` (<= 5 minutes of GPU time, report in
# runs/gpu-bench/); on any machine `make gpu-check-rehearsal` (the one-GPU plan's pairs on the CPU,
# slow: about an hour on 2 cores) and `make kill-check` (runs killed at every write point and at
# random, resumed and compared with one never killed; ~15 min). Each creates .venv and installs
# the project into it on first use; the two GPU targets first try the python at hand (a GPU
# image's own jax and torch: nothing to install).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
QUICKSTART_ARGS := --strategy ddp --model resnet18 --width 8 --devices 2 --global-batch-size 128 \
	--epochs 2 --synthetic-size 5000,1000 --lr 0.2 --out runs/quickstart --overwrite

.PHONY: train test install install-gpu install-gpu-target gpu-check gpu-check-rehearsal gpu-bench kill-check clean

# pyproject.toml admits torch 2.6 to < 3; CONSTRAINTS pins the one installed here (2.13.0, the
# CPU wheel on the build machines). Another torch: make install CONSTRAINTS=/dev/null.
CONSTRAINTS ?= .ci/constraints.txt

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e ".[dev]"
	touch $@

train: install
	$(BIN)/jaxdp train $(QUICKSTART_ARGS)

# Three workers (pytest-xdist) on 2 cores: the suite's time is mostly single-threaded XLA
# compiles and torch launches, and its multi-process tests wait on each other (with two
# workers the cores were busy 1.77 of 2 on average; four were slower than three: 12 min 58 s
# vs 12 min 16 s). Each test module runs whole on one worker (--dist loadfile), so its
# module fixtures, in-process jit caches and shared torch runs are built once, not once per
# worker: 11 min 20 s instead of 12 min 16 s on one machine.
# make test JAX_LEG=0.12.0.1: the same suite on another jax, in .ci/jax_leg's venv (Python 3.12,
# jaxlib and its GPU-target plugin of that version, flax 0.12.12, torch 2.14.1; built on first use).
JAX_LEG ?=
ifeq ($(JAX_LEG),)
test: install install-gpu-target
	$(BIN)/python -m pytest -q -n 3 --dist loadfile
else
test:
	JAX_LEG=$(JAX_LEG) .ci/jax_leg --suite
endif

# Compile-only GPU targets (jaxdp inspect/plan --target h100, without a GPU): JAX's CUDA plugin and PJRT
# of the installed jaxlib's exact version, with --no-deps, in a directory of their own beside the venv
# (.venv/jaxdp-gpu-target/), never site-packages: there the plugin would register at every `import jax`
# and print a CUDA traceback on a machine without a GPU. ptxas comes from a CUDA toolkit, else from
# nvidia-cuda-nvcc-cu12 in the same directory. 480 MB; make test installs it (its tests compile for H100s).
install-gpu-target: $(VENV)/.installed-gpu-target

$(VENV)/.installed-gpu-target: $(VENV)/.installed
	$(BIN)/python -m jaxdp.runtime.target install
	touch $@

# JAX's CUDA build on top of the dev install (torch's default Linux wheel already has CUDA).
install-gpu: $(VENV)/.installed-gpu

$(VENV)/.installed-gpu: $(VENV)/.installed
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e ".[dev,gpu]"
	touch $@

# JAX must see the GPUs (JAX_PLATFORMS unset) and leave memory to the torch ranks sharing them.
# The python at hand runs it when it imports jax, torch, flax, optax, orbax and jaxdp (a stock
# GPU image after `pip install --no-deps -e .`: no network, nothing to install); else .venv,
# installed first with JAX's CUDA build.
# Extra options: make gpu-check GPU_CHECK_ARGS="--devices 4" (or --dtypes float64, --budget 0, ...).
GPU_CHECK_ARGS ?=
GPU_CHECK_IMPORTS := import jax, torch, flax, optax, orbax.checkpoint, jaxdp, parity_tests
gpu-check:
	@if $(PYTHON) -c "$(GPU_CHECK_IMPORTS)" 2>/dev/null; then py="$(PYTHON)"; \
	else $(MAKE) install-gpu && py="$(BIN)/python"; fi; \
	echo "gpu-check with $$py"; \
	env -u JAX_PLATFORMS XLA_PYTHON_CLIENT_PREALLOCATE=false \
		$$py -m torch_commands.gpu_check --out runs/gpu-check $(GPU_CHECK_ARGS)

# gpu-check's one-GPU plan, every GPU pair run on the CPU at N = 1 (jax on XLA:CPU, torch on gloo),
# so that the first GPU run tests the GPU, not the plan. Not part of the suite: slow (report in
# runs/gpu-check-rehearsal/; the last run's table is in docs/parity.md).
gpu-check-rehearsal: install
	$(BIN)/python -m torch_commands.gpu_check --rehearse --out runs/gpu-check-rehearsal $(GPU_CHECK_ARGS)

# The <= 5 minute GPU bench (jaxdp bench --preset gpu --quick; report in runs/gpu-bench/). It uses
# $(PYTHON) as it is when jax, torch and jaxdp import there (a stock GPU image after
# `pip install --no-deps -e .`: no network, nothing installed), else the .venv with the GPU extras.
# Extra options: make gpu-bench GPU_BENCH_ARGS="--dry-run" (or --levers default,autotune-0, ...).
GPU_BENCH_ARGS ?=
gpu-bench:
	@if $(PYTHON) -c "import jax, torch, jaxdp" 2>/dev/null; then py=$(PYTHON); \
	else $(MAKE) install-gpu && py=$(BIN)/python; fi; \
	env -u JAX_PLATFORMS XLA_PYTHON_CLIENT_PREALLOCATE=false \
		$$py -m jaxdp.cli bench --preset gpu --quick --out runs/gpu-bench $(GPU_BENCH_ARGS)

# The kill campaign: a tiny run killed at every named write point and at random moments (SIGKILL,
# SIGTERM, SIGINT; 1 process and a 2-process job), resumed, and compared with a run never killed.
# Not part of the suite: ~15 min on 2 cores; its table is in docs/checkpoints-and-faults.md.
# Extra options: make kill-check KILL_CHECK_ARGS="--random 20 --seed 1" (or --only KILL,2p).
KILL_CHECK_ARGS ?=
kill-check: install
	$(BIN)/python tests/kill_campaign.py --out runs/kill-check $(KILL_CHECK_ARGS)

clean:
	rm -rf runs .pytest_cache
