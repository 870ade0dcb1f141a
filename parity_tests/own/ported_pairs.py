"""A small pair written the way real ports are (Hugging Face's among them), for the tests: every
form the harness must take as it comes, with no correspondence written by hand.

- tied weights: torch's output head *is* the embedding's tensor (``head.weight = tok.weight``),
  Flax reads its one embedding twice (``nn.Embed.attend``);
- HF's ``Conv1D`` (weights stored (in, out)) in torch against Flax's ``Dense``, one of them square;
- keyword inputs taken from the batch (``(args, kwargs)``), on both sides;
- outputs as models return them: a namedtuple in torch (``outputs[0]``), a dataclass in Flax
  (``outputs.logits``);
- a tensor of different kinds on the two sides: torch's ``temperature`` buffer is a Flax param
  read under ``stop_gradient``; torch's frozen ``pos`` parameter is Flax ``constants`` state;
- ``loaded_pair``: the torch model's weights loaded from a "checkpoint" (``load_state_dict``),
  kept with ``init_from="loaded"``; ``partly_loaded_pair``: one tensor missing from it.

    run_pair("parity_tests.own.ported_pairs:ported_pair", PairRun(strategy="ddp", devices=2))
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import numpy as np

VOCAB, SEQ, DIM, DEPTH = 24, 6, 8, 2

TorchOut = collections.namedtuple("TorchOut", ["logits", "hidden"])


@dataclasses.dataclass
class FlaxOut:
    logits: Any
    hidden: Any


def _torch_modules():
    import torch
    from torch import nn

    class Conv1D(nn.Module):
        """HF's (transformers.pytorch_utils.Conv1D): a Linear whose weight is stored (in, out)."""

        def __init__(self, nf: int, nx: int):
            super().__init__()
            self.nf, self.nx = nf, nx
            self.weight = nn.Parameter(0.2 * torch.randn(nx, nf))
            self.bias = nn.Parameter(0.1 * torch.randn(nf))

        def forward(self, x):
            return x @ self.weight + self.bias

    class TorchBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(DIM)
            self.up = Conv1D(2 * DIM, DIM)
            self.down = Conv1D(DIM, 2 * DIM)
            self.mix = Conv1D(DIM, DIM)  # square: its layout is its class's

        def forward(self, x):
            return x + self.mix(self.down(torch.tanh(self.up(self.ln(x)))))

    class TorchPortedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(VOCAB, DIM)
            self.pos = nn.Parameter(0.1 * torch.randn(SEQ, DIM), requires_grad=False)  # a fixed table
            self.blocks = nn.ModuleList(TorchBlock() for _ in range(DEPTH))
            self.head = nn.Linear(DIM, VOCAB, bias=False)
            self.head.weight = self.tok.weight  # tied: one tensor under two names
            self.register_buffer("temperature", torch.tensor(1.5))

        def forward(self, tokens, mask):
            x = (self.tok(tokens) + self.pos[: tokens.shape[1]]) * mask[..., None]
            for block in self.blocks:
                x = block(x)
            return TorchOut(self.head(x) / self.temperature, x)

    return TorchPortedLM, TorchBlock


def _flax_modules():
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    class FlaxBlock(nn.Module):
        dtype: Any = jnp.float32

        @nn.compact
        def __call__(self, x):
            h = nn.LayerNorm(epsilon=1e-5, dtype=self.dtype, name="ln")(x)
            h = nn.Dense(DIM, dtype=self.dtype, name="down")(jnp.tanh(nn.Dense(2 * DIM, dtype=self.dtype, name="up")(h)))
            return x + nn.Dense(DIM, dtype=self.dtype, name="mix")(h)

    class FlaxPortedLM(nn.Module):
        dtype: Any = jnp.float32
        tie: bool = True  # False: a head of its own (against torch's tied one: refused, saying so)

        @nn.compact
        def __call__(self, tokens, mask):
            tok = nn.Embed(VOCAB, DIM, dtype=self.dtype, name="tok")
            pos = self.variable("constants", "pos", jnp.zeros, (SEQ, DIM)).value
            x = (tok(tokens) + pos[: tokens.shape[1]]) * mask[..., None].astype(self.dtype)
            for i in range(DEPTH):
                x = FlaxBlock(self.dtype, name=f"blocks_{i}")(x)
            temperature = jax.lax.stop_gradient(self.param("temperature", nn.initializers.ones, ()))
            # tied: the embedding read again
            logits = tok.attend(x) if self.tie else nn.Dense(VOCAB, use_bias=False, dtype=self.dtype, name="head")(x)
            return FlaxOut(logits / temperature.astype(self.dtype), x)

    return FlaxPortedLM, FlaxBlock


def sample_batch(rng: np.random.Generator, rows: int) -> dict:
    tokens = rng.integers(0, VOCAB, (rows, SEQ + 1)).astype(np.int32)
    mask = (np.arange(SEQ) < rng.integers(SEQ // 2, SEQ + 1, (rows, 1))).astype(np.float32)
    return {"tokens": tokens, "mask": mask}


def model_inputs(batch):
    return (batch["tokens"][:, :-1],), {"mask": batch["mask"]}


def flax_loss(outputs, batch):
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(outputs.logits, batch["tokens"][:, 1:])


def torch_loss(outputs, batch):
    import torch.nn.functional as F

    return F.cross_entropy(outputs[0].transpose(1, 2), batch["tokens"][:, 1:], reduction="none")


def ported_pair(init_from: str = "torch", checkpoint=None):
    from parity_tests.own import ModelPair

    torch_lm, torch_block = _torch_modules()
    flax_lm, flax_block = _flax_modules()
    model = torch_lm()
    if checkpoint is not None:  # as from_pretrained does: the checkpoint's tensors, in its dtype
        state = checkpoint(model)
        model.load_state_dict(state, strict=False)
        model.to(next(iter(state.values())).dtype)
    return ModelPair(flax_model=flax_lm(), torch_model=model, sample_batch=sample_batch, flax_loss=flax_loss,
                     torch_loss=torch_loss, flax_inputs=model_inputs, flax_units=(flax_block,),
                     torch_units=(torch_block,), init_from=init_from, name="ported LM")


def checkpoint(model, missing: str = "", dtype: str = "float32"):
    """A stand-in for a file: every parameter of ``model`` (a tied one once) but ``missing``, drawn
    from its own fixed generator (not torch's seed), and its buffers as they are; in ``dtype``
    (a bfloat16 checkpoint too)."""
    import torch

    rng = np.random.default_rng(1234)
    params = {k: torch.from_numpy(0.3 * rng.standard_normal(tuple(p.shape))) for k, p in model.named_parameters()}
    state = {**params, **{k: b.clone() for k, b in model.named_buffers()}}
    return {k: v.to(getattr(torch, dtype)) for k, v in state.items() if k != missing}


loaded_pair = functools.partial(ported_pair, init_from="loaded", checkpoint=checkpoint)
bf16_checkpoint_pair = functools.partial(ported_pair, init_from="loaded",
                                         checkpoint=functools.partial(checkpoint, dtype="bfloat16"))
partly_loaded_pair = functools.partial(ported_pair, init_from="loaded",
                                       checkpoint=functools.partial(checkpoint, missing="blocks.1.mix.bias"))
