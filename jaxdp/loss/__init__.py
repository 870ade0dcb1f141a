"""The loss contract, below the strategies: what a strategy asks of the user's loss and evaluation
(task.py: ``loss_fn``/``eval_fn``, ``classifier(model)``), a loss that receives the model jaxdp
prepared (model_task.py), and the reductions that stay right under every layout (reductions.py:
``global_mean``, ``clip_by_global_norm``). The strategies, the optimizers and model parallelism
read it; the ``Trainer`` (``jaxdp.api``) sits above them all."""
