"""``jaxdp train``'s run loop and its bookkeeping: what a run builds first (setup.py), where it starts
and what its checkpoints record (resume.py; the Trainer saves and restores them, ``jaxdp.checkpoint``),
the loop (train.py), where its batches come from (feed.py, device_data.py), records (rundir.py,
scalars.py), progress, speed and FLOPs (progress.py, perf.py, flops.py) and Ctrl-C/SIGTERM
(interrupts.py). rundir.py and interrupts.py are jax-free: torch_ref's loop uses them."""
