"""The public API: ``Trainer`` (trainer.py), the loss contract (task.py, model_task.py), global
reductions that stay right under every layout (reductions.py), save/restore (saving.py) and the
one-line input errors (validate.py). ``import jaxdp`` reaches all of it by name."""
