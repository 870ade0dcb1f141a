"""The torch twin of jaxdp's pipeline stages (``jaxdp/parallel/pipeline.py``): GPipe over a 2-D mesh.

``init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))``: pp rank s holds stage s,
a contiguous run of the model's pipeline layers cut by the same rule as jaxdp's
(``jaxdp.parallel.pipeline.stage_bounds``, computed once in the caller and handed to every
rank as ``cfg["bounds"]``), under the full model's parameter names (``blocks.1.attn.qkv.weight``),
so records compare name by name with jaxdp's canonical tree. The layers, as jaxdp's
(``jaxdp/models/vit/pipeline.py``, ``jaxdp/models/toy.py``):

    ViT   0: patch embedding + class token + positions, 1..depth: the blocks, depth + 1: norm + head
    toy   0: net1 + ReLU, 1: net2   (the DDP tutorial's ToyMpModel)

Each stage module is handed to ``torch.distributed.pipelining.PipelineStage`` and run by
``ScheduleGPipe(stage, M, loss_fn, scale_grads=True)``: the loss runs per micro-batch on the
last stage, unscaled, and the schedule divides every grad by M once all micro-batches are
back (torch < 2.7 has no ``scale_grads`` and sums: ``compat.gpipe`` leaves that division to
the step loop). The data-parallel average is then one explicit all-reduce of each grad over the ``dp``
dim, divided by dp: DDP's reduction, written out. Why not ``DistributedDataParallel`` around
the stage module (which ``PipelineStage`` knows: ``no_sync`` for every micro-batch but the
last): with M > 1 it trips an internal assert in DDP's bucket rebuild on its second step
("rebuilt parameter indices size is not same as original model parameters size. Original
model param size is: 16 versus rebuilt params size of: 32", torch 2.13, gloo): the reducer
records each param once per micro-batch backward. The schedule never zeroes grads: each
step zeroes them first.

Runs on CPU with gloo (torch 2.13): ``run_pipeline_steps`` starts ``dp x pp`` ranks.
``python -m torch_ref.pipeline`` is the twin of ``examples/ddp_model_parallel.py``: DDP around
the tutorial's ToyMpModel split over two stages, one micro-batch.
"""

from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from torch_ref.vit import VisionTransformer

# The data-parallel twin (torch_ref.strategies.TWINS) whose average the dp dim writes out below.
DATA_PARALLEL = "ddp"

IN_FEATURES, HIDDEN, OUT_FEATURES = 10, 10, 5


class ToyMpModel(nn.Module):
    """The tutorial's model: ``Linear(10, 10) -> ReLU -> Linear(10, 5)`` (torch's default init)."""

    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(IN_FEATURES, HIDDEN)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(HIDDEN, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


class ViTStage(nn.Module):
    """Pipeline layers ``[first, last)`` of a torch_ref ViT, holding the full model's own modules."""

    def __init__(self, vit: VisionTransformer, first: int, last: int):
        super().__init__()
        depth = len(vit.blocks)
        self.embeds, self.classifies = first == 0, last == depth + 2
        if self.embeds:
            self.patch_embed, self.cls_token, self.pos_embed = vit.patch_embed, vit.cls_token, vit.pos_embed
        # Keyed by the block's index in the whole model: its params keep their names.
        self.blocks = nn.ModuleDict({str(i): vit.blocks[i] for i in range(max(first - 1, 0), min(last - 1, depth))})
        if self.classifies:
            self.norm, self.head = vit.norm, vit.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embeds:  # VisionTransformer's own code, on the attributes this stage holds
            x = VisionTransformer.embed(self, x)
        for block in self.blocks.values():
            x = block(x)
        return VisionTransformer.classify(self, x) if self.classifies else x


class ToyStage(nn.Module):
    """Layers ``[first, last)`` of ToyMpModel: net1 with its ReLU, net2."""

    def __init__(self, toy: ToyMpModel, first: int, last: int):
        super().__init__()
        self.net1 = toy.net1 if first == 0 else None
        self.net2 = toy.net2 if last == 2 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.net1 is not None:
            x = torch.relu(self.net1(x))
        return self.net2(x) if self.net2 is not None else x


class Pipelined(NamedTuple):
    """A pipelined model family: its whole torch model from the config's sizes, its stage module,
    and how many pipeline layers it has (jaxdp's ``model.pipeline_layers()`` has as many)."""
    whole: Callable[[Mapping[str, Any]], nn.Module]
    stage: type
    layers: Callable[[Mapping[str, Any]], int]


PIPELINED = {
    "vit": Pipelined(lambda sizes: VisionTransformer(**sizes), ViTStage, lambda sizes: sizes["depth"] + 2),
    "toy": Pipelined(lambda sizes: ToyMpModel(), ToyStage, lambda sizes: 2),
}


def pipeline_layer_count(family: str, model: Mapping[str, Any]) -> int:
    """How many pipeline layers the model has (jaxdp's ``model.pipeline_layers()`` has as many)."""
    return PIPELINED[family].layers(model)


def build_stage(cfg: Mapping[str, Any], state_dict: Mapping[str, np.ndarray], stage: int) -> nn.Module:
    """Stage ``stage`` of the config's model, loaded from the full ``state_dict``."""
    family = PIPELINED[cfg.get("family", "vit")]
    whole = family.whole(cfg.get("model", {})).to(getattr(torch, cfg["dtype"]))
    whole.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in state_dict.items()})
    first, last = cfg["bounds"][stage]
    return family.stage(whole, first, last)


def pipeline_rank_steps(cfg: Mapping[str, Any], state_dict: Mapping[str, np.ndarray],
                        batches: Sequence[Tuple[np.ndarray, np.ndarray]]) -> List[dict]:
    """One rank's steps; every rank returns the records (every stage's params, gathered)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage

    from torch_ref.compat import gpipe
    from torch_ref.strategies import optimizer_for

    dp, pp = cfg["dp"], cfg["pp"]
    mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
    me, s = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    module = build_stage(cfg, state_dict, s)
    named = list(module.named_parameters())
    stage = PipelineStage(module, s, pp, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule, unscaled = gpipe(stage, cfg["microbatches"], loss_fn=F.cross_entropy)
    optimizer = optimizer_for([p for _, p in named], cfg["optimizer"], cfg["lr"], momentum=cfg["momentum"],
                              weight_decay=cfg["weight_decay"])
    dtype, last = getattr(torch, cfg["dtype"]), s == pp - 1
    records = []
    for images, labels in batches:
        x = torch.from_numpy(np.ascontiguousarray(_channels_first(images[me]))).to(dtype)
        losses: List[torch.Tensor] = []
        optimizer.zero_grad(set_to_none=True)  # the schedule accumulates into .grad and never zeroes it
        schedule.step(*([x] if s == 0 else []),
                      **({"target": torch.from_numpy(labels[me]).long(), "losses": losses} if last else {}))
        per_rank = torch.zeros(dp, dtype=torch.float64)
        if last:  # each micro-batch's mean loss, unscaled: their mean is the rank's batch mean
            per_rank[me] = torch.stack(losses).mean().detach().double()
        dist.all_reduce(per_rank)  # over the world: only the last stage's entries are non-zero
        for _, p in named:  # DDP's average over the data-parallel ranks of this stage
            dist.all_reduce(p.grad, group=mesh["dp"].get_group())
            p.grad.div_(dp * unscaled)  # unscaled: M where the schedule summed micro-batches (torch < 2.7)
        grads = {n: _numpy(p.grad) for n, p in named}
        optimizer.step()
        records.append({"loss": float(per_rank.mean()), "loss_per_rank": per_rank.tolist(),
                        **_gathered({"grads": grads, "params": {n: _numpy(p) for n, p in named}}, me)})
    return records


def _channels_first(images: np.ndarray) -> np.ndarray:
    return images.transpose(0, 3, 1, 2) if images.ndim == 4 else images  # NHWC -> NCHW; toy rows as they are


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().copy()


def _gathered(parts: Dict[str, Dict[str, np.ndarray]], dp_rank: int) -> Dict[str, Dict[str, np.ndarray]]:
    """Every stage's ``{kind: {name: array}}`` merged, as held on dp rank 0 (the others hold the same)."""
    import torch.distributed as dist

    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, parts if dp_rank == 0 else None)
    return {kind: {n: a for p in everyone if p is not None for n, a in p[kind].items()} for kind in parts}


def run_pipeline_steps(cfg: Mapping[str, Any], state_dict: Mapping[str, np.ndarray],
                       batches: Sequence[Tuple[np.ndarray, np.ndarray]], timeout_s: float = 300.0) -> List[dict]:
    """``cfg["dp"] x cfg["pp"]`` gloo ranks; each step's record. ``batches``: per step, inputs
    (dp, b, ...) and labels (dp, b): the dp ranks' rows, as jaxdp's data axis splits them.
    Without ``cfg["bounds"]`` the stages are cut by jaxdp's rule (which imports jax, here only)."""
    from torch_ref.launcher import run_ranks

    cfg = dict(cfg)
    if "bounds" not in cfg:
        from jaxdp.parallel.pipeline import stage_bounds

        cfg["bounds"] = stage_bounds(pipeline_layer_count(cfg.get("family", "vit"), cfg.get("model", {})), cfg["pp"])
    world = cfg["dp"] * cfg["pp"]
    return run_ranks(world, pipeline_rank_steps, [(cfg, dict(state_dict), list(batches))] * world,
                     backend="gloo", timeout_s=timeout_s)[0]


def toy_main(steps: int = 30, batch: int = 20) -> List[float]:
    """examples/ddp_model_parallel.py in torch: DDP over dp=2 around ToyMpModel on two stages, M=1."""
    torch.manual_seed(0)
    state_dict = {k: v.numpy() for k, v in ToyMpModel().double().state_dict().items()}
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(batch, IN_FEATURES)), rng.integers(0, OUT_FEATURES, batch)
    data = [(x.reshape(2, batch // 2, IN_FEATURES), y.reshape(2, batch // 2))] * steps  # 10 rows per dp rank
    cfg = {"family": "toy", "dp": 2, "pp": 2, "microbatches": 1, "dtype": "float64", "bounds": [(0, 1), (1, 2)],
           "optimizer": "sgd", "lr": 0.1, "momentum": 0.0, "weight_decay": 0.0}
    losses = [r["loss"] for r in run_pipeline_steps(cfg, state_dict, data)]
    for step in [s for s in range(steps) if s % 10 == 0 or s == steps - 1]:
        print(f"step {step:2d}  loss {losses[step]:.4f}")
    return losses


if __name__ == "__main__":
    toy_main()
