"""``make gpu-check``: every strategy's parity with its PyTorch twin on the GPUs at hand, at the
test suite's tiny size and at realistic sizes, in ONE report with one verdict that cannot lie.

    python -m torch_commands.gpu_check                  # on a GPU host (1 GPU or more): run the plan
    python -m torch_commands.gpu_check --dry-run        # anywhere: print and write the plan only
    python -m torch_commands.gpu_check --rehearse       # CPU: the one-GPU plan's GPU pairs at N = 1 (slow)
    python -m torch_commands.gpu_check --simulate 2,3   # CPU: the simulated part alone, tiny, on
                                                      # 3 simulated JAX devices and gloo torch ranks

- ``plan``: what runs, decided and fitted to the budget before anything runs (``--dry-run``
  prints exactly that); the per-pair estimates.
- ``hardware``: the GPUs torch and JAX see, float64 on the GPU, the installed versions.
- ``run``: the simulated child from time zero, this process's pairs, the bench row, the
  hard deadline.
- ``report``: the verdict (PASS only when every planned pair and row ran and passed; a pair
  that did not run makes it INCOMPLETE, exit 3), ``report.md``, ``report.json``, the table.
- ``command``: the options and the checks before a plan (refused in one line, exit 2).

Each pair's configuration is built by parsing its own ``jaxdp parity ...`` command line with
the parity CLI's parser, so the command printed in the plan is exactly what ran; each pair's
``report.json`` (and with ``--png`` its ``parity.png``) go to ``OUT/pairs/<pair>/``. The check
runs in parity mode (``parity_tests.parity_mode``: deterministic cuDNN engines on both sides,
no TF32), set up before JAX starts. Nothing here imports jax at module level: ``--simulate``
sets XLA's device count first.
"""

from torch_commands.gpu_check.command import main  # noqa: F401
