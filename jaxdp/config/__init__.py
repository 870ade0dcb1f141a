"""Configuration, in one home: the tree of typed sections (tree.py) whose fields (fields.py) carry
their default, help and whether they change the numbers; the step's own section that parity and
torch_ref share (step.py); the names a user picks from (choices.py); the command-line flags (flags.py)
and config files (files.py) generated from the fields. jax-free: the CLI reads it before jax loads."""
