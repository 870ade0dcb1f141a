"""torch_ref: the PyTorch reference that jaxdp is compared against, step by step.

It shares only the numpy data pipeline and the weight conversion
(``jaxdp.interop``) with jaxdp; everything else is ordinary PyTorch.

- ``models``: torchvision-layout ResNets (``resnet(name, num_classes, width, blocks, stem)``)
  and ``create_model(name, ...)`` for every model, the timm-layout ViTs of ``vit`` included.
- ``strategies``: dp (``nn.DataParallel``), ddp (``DistributedDataParallel`` + comm hooks),
  zero1 (DDP + ``ZeroRedundancyOptimizer``), zero2/zero3 (FSDP2 ``fully_shard``,
  ``reshard_after_forward`` False/True), hsdp (FSDP2 on a 2-D ``DeviceMesh``).
- ``train``: ``torchrun --nproc_per_node N -m torch_ref.train ...``, the options, data,
  metrics and checkpoints of ``jaxdp train``.
- ``step_api``: ``build(config, init_state_dict) -> Runner``; ``Runner.step`` returns loss,
  averaged grads, params, BN buffers and optimizer state for parity checks.
- ``launcher``: ``run_steps(world_size, config, init_state_dict, batches)`` runs those steps
  on N processes from one Python call (rank r: ``LOCAL_RANK=r``, so ``cuda:r`` on nccl).
- ``checkpoint``, ``dist``: strategy-independent checkpoints; process-group plumbing
  (backend ``auto|nccl|gloo``, ``JAXDP_TORCH_BACKEND``; device ``cuda:LOCAL_RANK`` or cpu).

Nothing here imports JAX at module level (``jaxdp.optim`` is imported only for a
non-constant lr schedule), so torch ranks start without it. The package itself imports
nothing (not even torch) until a name is used: ``jaxdp export``'s entry point
(``torch_commands.export``) is read by ``jaxdp --help`` also where torch is not installed.
"""

__all__ = ["MODELS", "STEMS", "ResNet", "create_model", "resnet"]


def __getattr__(name):
    if name not in __all__:
        raise AttributeError(f"module 'torch_ref' has no attribute {name!r}")
    from torch_ref import models

    return getattr(models, name)
