"""Where a program runs: XLA's device flags before jax loads (startup.py), joining a multi-process
job (distributed.py), device meshes and batch placement (mesh.py), XLA compile options (compile_options.py),
files that survive a kill and the named points where a test kills it (durable.py)."""
