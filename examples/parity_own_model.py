"""Prove that your Flax port trains exactly like its PyTorch original: a tiny causal transformer
language model, written once in PyTorch and once in Flax, checked step by step under ddp and
zero3 on 2 (simulated) devices, in float64 and in bfloat16.

    python examples/parity_own_model.py       # ~30 s on 2 CPU cores (4 runs of 3 steps, and the bf16 budgets)
    jaxdp parity --pair examples.parity_own_model:make_pair --strategy zero3 --devices 2 --dtype float64

Copy it and replace the two models, the loss and the data with yours: ``make_pair`` is all the
harness needs (``parity_tests.own.ModelPair``). The weights are matched by name and shape
(torch ``blocks.0.qkv.weight`` <-> Flax ``params/blocks_0/qkv/kernel``, transposed); the
torch init is copied into the Flax params, so both start bit-identical.

What a port must get right, and this one does (each is a classic parity failure):
- ``nn.LayerNorm(epsilon=1e-5)``: Flax's default is 1e-6, torch's 1e-5;
- ``nn.gelu(x, approximate=False)``: Flax's default is the tanh approximation, torch's GELU is exact;
- the causal mask and the softmax's axis; the attention's head split (B, T, 3, H, D/H);
- the loss: per-token cross-entropy averaged over every token (returned per token here; the
  harness averages it, as torch's ``reduction="mean"``).
"""

import math
import os
from typing import Any

if __name__ == "__main__":  # 2 simulated CPU devices for the runs below, set before jax starts
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

VOCAB, SEQ, DIM, HEADS, DEPTH = 32, 8, 16, 2, 2


# ----------------------------------------------------------------------------- PyTorch

class TorchBlock(torch.nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.ln2 = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, 4 * dim)
        self.fc2 = torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        attention = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + self.proj((attention @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TorchLM(torch.nn.Module):
    def __init__(self, vocab=VOCAB, seq=SEQ, dim=DIM, heads=HEADS, depth=DEPTH):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(0.02 * torch.randn(seq, dim))
        self.blocks = torch.nn.ModuleList(TorchBlock(dim, heads) for _ in range(depth))
        self.ln_f = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ----------------------------------------------------------------------------- Flax

class Block(nn.Module):
    dim: int
    heads: int
    dtype: Any = jnp.float32  # the compute dtype (the harness sets it: float64, float32, bfloat16)

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        dense = lambda features, name: nn.Dense(features, dtype=self.dtype, name=name)  # noqa: E731
        norm = lambda name: nn.LayerNorm(epsilon=1e-5, dtype=self.dtype, name=name)  # noqa: E731
        q, k, v = dense(3 * d, "qkv")(norm("ln1")(x)).reshape(b, t, 3, self.heads, d // self.heads).transpose(
            2, 0, 3, 1, 4)
        scores = q @ k.swapaxes(-2, -1) / math.sqrt(d // self.heads)
        causal = jnp.tril(jnp.ones((t, t), bool))
        # softmax in float32 at least (torch's autocast does the same under bfloat16)
        scores = jnp.where(causal, scores, -jnp.inf).astype(jnp.promote_types(scores.dtype, jnp.float32))
        attention = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        x = x + dense(d, "proj")((attention @ v).transpose(0, 2, 1, 3).reshape(b, t, d))
        return x + dense(d, "fc2")(nn.gelu(dense(4 * d, "fc1")(norm("ln2")(x)), approximate=False))


class FlaxLM(nn.Module):
    vocab: int = VOCAB
    seq: int = SEQ
    dim: int = DIM
    heads: int = HEADS
    depth: int = DEPTH
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens):
        pos = self.param("pos", nn.initializers.normal(0.02), (self.seq, self.dim))
        x = nn.Embed(self.vocab, self.dim, dtype=self.dtype, name="tok")(tokens) + pos[: tokens.shape[1]]
        for i in range(self.depth):
            x = Block(self.dim, self.heads, self.dtype, name=f"blocks_{i}")(x)
        return nn.Dense(self.vocab, dtype=self.dtype, name="head")(
            nn.LayerNorm(epsilon=1e-5, dtype=self.dtype, name="ln_f")(x))


# ----------------------------------------------------------------------------- the pair

def sample_batch(rng: np.random.Generator, rows: int) -> dict:
    """Sequences counting up from a random start with a random stride: learnable, fully offline."""
    start = rng.integers(0, VOCAB, (rows, 1))
    stride = rng.integers(1, 4, (rows, 1))
    return {"tokens": ((start + stride * np.arange(SEQ + 1)) % VOCAB).astype(np.int32)}


def model_inputs(batch):
    return (batch["tokens"][:, :-1],)  # indexing only: the same for jnp arrays and torch tensors


def flax_loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])  # per token


def torch_loss(logits, batch):
    return F.cross_entropy(logits.transpose(1, 2), batch["tokens"][:, 1:], reduction="none")  # per token


def make_pair():
    """What ``jaxdp parity --pair examples.parity_own_model:make_pair`` calls, in every process."""
    from parity_tests.own import ModelPair

    return ModelPair(flax_model=FlaxLM(), torch_model=TorchLM(), sample_batch=sample_batch,
                     flax_loss=flax_loss, torch_loss=torch_loss, flax_inputs=model_inputs,
                     flax_units=(Block,), torch_units=(TorchBlock,), name="tiny causal LM")


def check(make=make_pair):
    """The pair ``make`` builds under ddp and zero3 on 2 devices, in float64 and bfloat16: a line each."""
    from parity_tests.own import PairRun, run_pair

    for strategy in ("ddp", "zero3"):
        for dtype in ("float64", "bfloat16"):
            result = run_pair(make, PairRun(strategy=strategy, devices=2, dtype=dtype, steps=3))
            print(f"{strategy} {dtype}: {'PASS' if result.passed else 'FAIL'}: {result.message()}")


if __name__ == "__main__":  # the guard matters: the torch ranks re-import this file
    check()
