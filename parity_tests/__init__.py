"""Cross-framework parity: each jaxdp strategy against its PyTorch twin, step by step.

The torch side of jaxdp, installed with the [torch] extra; jaxdp itself never imports it
(``jaxdp parity`` and ``jaxdp bench`` reach it as entry points, ``jaxdp.commands``).

- ``config``: ``ParityConfig`` (a step's options, ``jaxdp.config.step``, plus the run's size);
- ``pairs``: the pair table (jaxdp strategy -> torch_ref twin), from each strategy's facts;
- ``plan``: what one run will do, refused in one line where there is no twin;
- ``inputs``, ``jax_side``, ``torch_side``: the shared weights and batches, K steps on each side;
- ``runner``: ``run_parity``; ``command``: the ``jaxdp parity`` command;
- ``compare``: per-tensor relative errors, bounds (float64 tight, float32 measured), the
  first divergence;
- ``report``: terminal table, JSON, PNG;
- ``bugs``: deliberately broken jaxdp variants that the harness must catch and name;
- ``optim_state``: jaxdp's optimizer state in torch.optim's vocabulary.

The user commands built on this harness (``jaxdp bench``, ``make gpu-check``) are ``torch_commands``.

Nothing here imports jax or torch at import time (``--devices`` must come first).
"""
