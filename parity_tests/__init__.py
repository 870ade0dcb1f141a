"""Cross-framework parity: each jaxdp strategy against its PyTorch twin, step by step.

- ``runner``: the pair table (jaxdp strategy -> torch_ref twin), inputs shared byte for
  byte, both sides run, ``run_parity`` and the ``jaxdp parity`` command;
- ``compare``: per-tensor relative errors, bounds (float64 tight, float32 measured), the
  first divergence;
- ``report``: terminal table, JSON, PNG;
- ``bugs``: deliberately broken jaxdp variants that the harness must catch and name.

Nothing here imports jax or torch at import time (``--devices`` must come first).
"""
