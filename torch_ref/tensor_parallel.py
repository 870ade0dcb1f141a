"""The torch twin of jaxdp's tensor parallelism: torchtitan's recipe on a 2-D ``DeviceMesh``.

``parallelize_module`` splits each ViT encoder block over the mesh's ``tp`` dim (Megatron:
``qkv`` and ``fc1`` ``ColwiseParallel``, ``proj`` and ``fc2`` ``RowwiseParallel``), then the
data-parallel wrapper runs over the ``dp`` dim: ``DistributedDataParallel(device_mesh=...)``
for ddp, FSDP2 ``fully_shard`` per block and on the root for zero3.

One step of adaptation, as Megatron does for its fused QKV: ``ColwiseParallel`` gives rank j
a contiguous block of ``qkv``'s output rows, but those rows are ``[q | k | v]``, so the block
would hold q of every head and none of v. The rows are therefore regrouped by rank,
``[q_0 k_0 v_0 | q_1 k_1 v_1]`` (``group_rows``), before the split, and each rank's attention
runs its own ``heads / tp`` heads. Full tensors read back (``full_tensor()``) are regrouped
to the canonical order before they are recorded, so they compare with jaxdp's canonical state.

A ResNet (``BUILDERS["resnet"]``) is split by hand instead, channel-parallel inside each
block (``torch_ref/resnet_tp.py``): the TP styles refuse ``Conv2d``.

Runs on CPU with gloo (torch 2.13): ``run_tp_steps`` starts ``dp x tp`` ranks.
"""

from typing import Any, Dict, List, Mapping, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

QKV_GROUPS = 3


def group_rows(t: torch.Tensor, tp: int, to_rank_order: bool = True) -> torch.Tensor:
    """``qkv``'s rows (dim 0) between the canonical ``[group][rank][rows]`` and the
    rank-major ``[rank][group][rows]`` order."""
    rows = t.shape[0] // (QKV_GROUPS * tp)
    first = (QKV_GROUPS, tp, rows) if to_rank_order else (tp, QKV_GROUPS, rows)
    return t.reshape(first + tuple(t.shape[1:])).transpose(0, 1).reshape(t.shape)


def parallelize_vit(model, tp_mesh) -> None:
    """Megatron tensor parallelism over ``tp_mesh`` for every encoder block of a torch_ref ViT (in place)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    for block in model.blocks:
        attn = block.attn
        plan = {"mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
        if attn.heads % tp == 0:  # else attention stays whole on every rank, as jaxdp's tp_plan does
            with torch.no_grad():
                attn.qkv.weight.copy_(group_rows(attn.qkv.weight, tp))
                attn.qkv.bias.copy_(group_rows(attn.qkv.bias, tp))
            plan.update({"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel()})
            attn.heads //= tp
        parallelize_module(block, tp_mesh, plan)


def dtensor_layouts(model) -> Dict[str, tuple]:
    """{name: (mesh, placements)} of the model's DTensor params: DDP swaps them for their local
    shards (``_pre_dp_module_transform``), so how to reassemble them is read before it does."""
    from torch.distributed.tensor import DTensor

    return {n: (p.device_mesh, p.placements) for n, p in model.named_parameters() if isinstance(p, DTensor)}


def canonical(name: str, t: torch.Tensor, tp: int, layouts: Mapping[str, tuple]) -> np.ndarray:
    """A full tensor as the unsplit model holds it (qkv rows back in [q | k | v] order)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor) and name in layouts:  # a local shard of a tensor-parallel param
        t = DTensor.from_local(t, *layouts[name], run_check=False)
    t = t.full_tensor() if isinstance(t, DTensor) else t
    if name in layouts and name.endswith(("attn.qkv.weight", "attn.qkv.bias")):  # split, so regrouped
        t = group_rows(t, tp, to_rank_order=False)
    return t.detach().cpu().numpy().copy()


def _data_parallel(model, dp_mesh, strategy: str):
    """The twin ``strategy`` over the mesh's ``dp`` dim (its ``Twin.on_mesh``: DDP, or FSDP2 per block)."""
    from torch_ref.strategies import TWINS, twin

    on_mesh = twin(strategy).on_mesh
    if on_mesh is None:
        raise ValueError(f"torch_ref's tensor-parallel twin runs {' or '.join(n for n, t in TWINS.items() if t.on_mesh)}, "
                         f"not {strategy!r}")
    return on_mesh(model, dp_mesh)


def build_vit(cfg: Mapping[str, Any], state_dict: Mapping[str, np.ndarray], mesh):
    """This rank's tensor-parallel ViT from the full ``state_dict``, and its ``canonical(name, t)``."""
    from torch_ref.vit import VisionTransformer

    model = VisionTransformer(**cfg["model"]).to(getattr(torch, cfg["dtype"]))
    model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in state_dict.items()})
    parallelize_vit(model, mesh["tp"])
    layouts = dtensor_layouts(model)
    tp = mesh["tp"].size()
    return model, lambda name, t: canonical(name, t, tp, layouts)


def _resnet_tp(cfg, state_dict, mesh):  # channel-parallel by hand: torch's TP styles refuse Conv2d
    from torch_ref.resnet_tp import build

    return build(cfg, state_dict, mesh)


# Each model family's tensor-parallel twin: (cfg, full state_dict, 2-D mesh) -> (model, canonical).
BUILDERS = {"vit": build_vit, "resnet": _resnet_tp}


def tp_rank_steps(cfg: Mapping[str, Any], state_dict: Mapping[str, np.ndarray],
                  batches: Sequence[Tuple[np.ndarray, np.ndarray]]) -> List[dict]:
    """One rank's steps; every rank returns the records (the same on all)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torch_ref.strategies import optimizer_for

    dp = cfg["dp"]
    mesh = init_device_mesh("cpu", (dp, cfg["tp"]), mesh_dim_names=("dp", "tp"))
    dtype = getattr(torch, cfg["dtype"])
    model, full = BUILDERS[cfg.get("family", "vit")](cfg, state_dict, mesh)
    wrapped = _data_parallel(model, mesh["dp"], cfg["strategy"])
    # Held from here on: DDP's forward hooks swap tensor-parallel params between their local
    # shards and DTensors, and after the first forward model.named_parameters() lists only
    # the others (torch 2.13; docs/design-notes.md, "Model parallelism on CPU"). These objects are what DDP reduces.
    named = list(model.named_parameters())
    optimizer = optimizer_for([p for _, p in named], cfg["optimizer"], cfg["lr"], momentum=cfg["momentum"],
                              weight_decay=cfg["weight_decay"])
    me = mesh["dp"].get_local_rank()
    records = []
    for images, labels in batches:
        x = torch.from_numpy(np.ascontiguousarray(images[me].transpose(0, 3, 1, 2))).to(dtype)
        loss = F.cross_entropy(wrapped(x), torch.from_numpy(labels[me]).long())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        per_rank = torch.zeros(dp, dtype=torch.float64)
        per_rank[me] = loss.detach().double()
        dist.all_reduce(per_rank, group=mesh["dp"].get_group())
        grads = {n: full(n, p.grad) for n, p in named}
        optimizer.step()
        records.append({"loss": float(per_rank.mean()), "loss_per_rank": per_rank.tolist(), "grads": grads,
                        "params": {n: full(n, p.detach()) for n, p in named}})
        # BatchNorm running statistics (a ResNet's), as dp rank 0 holds them: DDP broadcasts
        # them from there before each forward.
        buffers = {n: full(n, b) for n, b in model.named_buffers() if n.endswith(("running_mean", "running_var"))}
        if buffers:
            records[-1]["buffers"] = buffers
    return records


def run_tp_steps(cfg: Mapping[str, Any], state_dict: Mapping[str, np.ndarray],
                 batches: Sequence[Tuple[np.ndarray, np.ndarray]], timeout_s: float = 300.0) -> List[dict]:
    """``cfg["dp"] x cfg["tp"]`` gloo ranks; each step's record (rank 0's). ``batches``: per
    step, images (dp, b, H, W, C) and labels (dp, b): the dp ranks' rows, as jaxdp's data axis splits."""
    from torch_ref.launcher import run_ranks

    world = cfg["dp"] * cfg["tp"]
    out = run_ranks(world, tp_rank_steps, [(dict(cfg), dict(state_dict), list(batches))] * world,
                    backend="gloo", timeout_s=timeout_s)
    return out[0]
