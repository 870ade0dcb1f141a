"""DDP's ``powerSGD_hook`` with a known initial Q and its state readable by param name.

torch keeps PowerSGD's state per DDP *bucket*: ``error_dict[i]`` is the error feedback
for bucket ``i`` (flat, every element of the bucket), ``q_memory_dict[i]`` the warm-start
Qs of the bucket's compressed tensors (flat, grouped by matrix shape in order of first
appearance, as the hook slices them). ``Hook`` records which params each bucket held
when the hook last ran, so that both can be read back as ``{param name: tensor}``: the
form jaxdp keeps (params-shaped error, one Q per param), which the parity harness
compares step by step.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd


class PowerSGDError(ValueError):
    """A PowerSGD option or initial Q that cannot work (raised before training starts)."""


def q_shapes(model: nn.Module, rank: int, min_compression_rate: float = 2.0) -> Dict[str, Tuple[int, int]]:
    """{param name: shape of its Q} for the params PowerSGD compresses.

    PowerSGD views a gradient as the matrix ``g.view(g.shape[0], -1)`` (n x m) and
    compresses it to P (n x r) and Q (m x r), r = min(n, m, rank), when that saves at
    least ``min_compression_rate``; smaller tensors (biases, BN) are all-reduced as is.
    """
    shapes = {}
    for name, p in model.named_parameters():
        n = p.shape[0]
        m = p.numel() // n
        r = min(n, m, rank)
        if psgd._should_compress(n, m, r, min_compression_rate)[0]:
            shapes[name] = (m, r)
    return shapes


class Hook:
    """``powerSGD_hook`` (error feedback, warm start) plus the bucket layout it saw.

    ``initial_q`` ({param name: (m, r) array}) replaces torch's random first Q, e.g. to
    give both frameworks the same one; either way the hook orthogonalises Q before use.
    """

    def __init__(self, module: nn.Module, *, rank: int = 1, start_iter: int = 1000, seed: int = 0,
                 initial_q: Optional[Mapping[str, Any]] = None):
        if rank < 1:
            raise PowerSGDError(f"powersgd_rank must be >= 1, got {rank}")
        if start_iter < 2:
            raise PowerSGDError(f"powersgd_start_iter must be >= 2 (torch's PowerSGD with warm start "
                                f"and error feedback refuses less), got {start_iter}")
        self.state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                        start_powerSGD_iter=start_iter, use_error_feedback=True,
                                        warm_start=True, random_seed=seed)
        self.params = dict(module.named_parameters())
        self.names = {p: n for n, p in self.params.items()}
        self.q_shapes = q_shapes(module, rank, self.state.min_compression_rate)
        self.initial_q = dict(initial_q) if initial_q is not None else None
        if self.initial_q is not None:
            missing = sorted(set(self.q_shapes) - set(self.initial_q))
            if missing:
                raise PowerSGDError(f"initial Q missing for compressed params: {', '.join(missing)}")
        # bucket index -> the names of its params, in bucket order. DDP rebuilds its buckets
        # after the first iteration, so this is refreshed at every call.
        self.buckets: Dict[int, List[str]] = {}

    def register(self, ddp_model) -> None:
        ddp_model.register_comm_hook(self.state, self.hook)

    def hook(self, state, bucket):
        index = bucket.index()
        self.buckets[index] = [self.names[p] for p in bucket.parameters()]
        if (self.initial_q is not None and state.iter >= state.start_powerSGD_iter
                and index not in state.q_memory_dict):
            self._seed_q(bucket)
        return psgd.powerSGD_hook(state, bucket)

    def _q_order(self, index: int) -> List[str]:
        """The bucket's compressed params in the order the hook lays out their Qs:
        grouped by matrix shape (n, m), groups in order of first appearance."""
        groups: Dict[Tuple[int, int], List[str]] = {}
        for name in self.buckets[index]:
            if name in self.q_shapes:
                groups.setdefault((self.params[name].shape[0], self.q_shapes[name][0]), []).append(name)
        return [name for group in groups.values() for name in group]

    def _seed_q(self, bucket) -> None:
        """Pre-fill the hook's P/Q buffers for this bucket with ``initial_q``."""
        index, buf = bucket.index(), bucket.buffer()
        qs, p_size = [], 0
        for name in self._q_order(index):
            q = torch.as_tensor(self.initial_q[name])
            if tuple(q.shape) != self.q_shapes[name]:
                raise PowerSGDError(f"initial Q for {name} has shape {tuple(q.shape)}, "
                                    f"expected {self.q_shapes[name]}")
            qs.append(q.to(buf.dtype).reshape(-1))
            p_size += self.params[name].shape[0] * q.shape[1]
        self.state.p_memory_dict[index] = torch.empty(p_size, device=buf.device, dtype=buf.dtype)
        self.state.q_memory_dict[index] = (torch.cat(qs) if qs else buf.new_empty(0)).to(buf.device)

    def named_state(self) -> Dict[str, Dict[str, torch.Tensor]]:
        """This rank's state by param name: ``{"error": params-shaped}`` for every param and
        ``{"q": (m, r)}`` for the compressed ones. Before compression starts torch has
        allocated neither: the error is then zero (no error feedback yet) and Q the
        ``initial_q`` the first compressed step will use (none if torch draws it)."""
        params = self.params
        out = {name: {"error": torch.zeros_like(p.detach())} for name, p in params.items()}
        for name, q in (self.initial_q or {}).items():
            out[name]["q"] = torch.as_tensor(q).to(params[name].dtype)
        for index, names in self.buckets.items():
            error = self.state.error_dict.get(index)
            if error is not None:
                offset = 0
                for name in names:
                    numel = params[name].numel()
                    out[name]["error"] = error[offset:offset + numel].view_as(params[name]).clone()
                    offset += numel
            q = self.state.q_memory_dict.get(index)
            if q is not None:
                offset = 0
                for name in self._q_order(index):
                    m, r = self.q_shapes[name]
                    out[name]["q"] = q[offset:offset + m * r].view(m, r).clone()
                    offset += m * r
        return out
