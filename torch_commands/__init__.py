"""The user commands that need torch, installed with the [torch] extra and registered with ``jaxdp``
by entry point (``jaxdp.cli.commands``): ``jaxdp bench`` (bench/: jaxdp vs torch_ref timed side by
side), ``jaxdp export`` (export.py: a jaxdp checkpoint as a torch state_dict) and ``make gpu-check``
(gpu_check/: every parity pair on every GPU). The parity harness they build on is parity_tests/;
jaxdp never imports either (tests/test_structure.py)."""
