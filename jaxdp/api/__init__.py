"""The public API, above the strategies: ``Trainer`` (trainer.py; its save/restore go through
``jaxdp.checkpoint``) and the one-line input errors (validate.py). The loss contract it takes
(``loss_fn``, ``classifier``, ``global_mean``) lives below the strategies, in ``jaxdp.loss``.
``import jaxdp`` reaches all of it by name."""
