"""The own-pair example with its Flax side in NNX: the tiny causal transformer LM of
examples/parity_own_model.py written as an ``nnx.Module``, against the same PyTorch original,
step by step under ddp and zero3 on 2 (simulated) devices, in float64 and in bfloat16.

    python examples/parity_own_model_nnx.py   # ~60 s on 2 CPU cores (as parity_own_model.py, and each torch rank builds the NNX model)
    jaxdp parity --pair examples.parity_own_model_nnx:make_pair --strategy zero3 --devices 2 --dtype float64

The weights match by name and shape as for Linen: an NNX module's attribute paths are its names,
an ``nnx.List``'s index a part (torch ``blocks.0.qkv.weight`` <-> Flax ``params/blocks/0/qkv/kernel``,
transposed). The harness runs the module in the run's dtype by setting the ``dtype`` attribute of
every layer that has one (bfloat16: bf16 compute over float32 params). The ZeRO-3 units are the
``Block`` class here; ``flax_units=("blocks/*",)`` names the same modules by path.
"""

import math
import os

if __name__ == "__main__":  # 2 simulated CPU devices for the runs below, set before jax starts
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from examples.parity_own_model import (DEPTH, DIM, HEADS, SEQ, VOCAB, TorchBlock, TorchLM, check,  # noqa: E402
                                       flax_loss, model_inputs, sample_batch, torch_loss)


class Block(nnx.Module):
    def __init__(self, dim: int, heads: int, rngs: nnx.Rngs):
        self.heads = heads
        self.ln1 = nnx.LayerNorm(dim, epsilon=1e-5, rngs=rngs)  # torch's epsilon; Flax's default is 1e-6
        self.qkv = nnx.Linear(dim, 3 * dim, rngs=rngs)
        self.proj = nnx.Linear(dim, dim, rngs=rngs)
        self.ln2 = nnx.LayerNorm(dim, epsilon=1e-5, rngs=rngs)
        self.fc1 = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.fc2 = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).reshape(b, t, 3, self.heads, d // self.heads).transpose(2, 0, 3, 1, 4)
        scores = q @ k.swapaxes(-2, -1) / math.sqrt(d // self.heads)
        causal = jnp.tril(jnp.ones((t, t), bool))
        # softmax in float32 at least (torch's autocast does the same under bfloat16)
        scores = jnp.where(causal, scores, -jnp.inf).astype(jnp.promote_types(scores.dtype, jnp.float32))
        attention = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        x = x + self.proj((attention @ v).transpose(0, 2, 1, 3).reshape(b, t, d))
        return x + self.fc2(nnx.gelu(self.fc1(self.ln2(x)), approximate=False))  # torch's GELU is exact


class FlaxLM(nnx.Module):
    def __init__(self, vocab=VOCAB, seq=SEQ, dim=DIM, heads=HEADS, depth=DEPTH, rngs: nnx.Rngs = None):
        rngs = rngs or nnx.Rngs(0)
        self.tok = nnx.Embed(vocab, dim, rngs=rngs)
        self.pos = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (seq, dim)))
        self.blocks = nnx.List([Block(dim, heads, rngs) for _ in range(depth)])
        self.ln_f = nnx.LayerNorm(dim, epsilon=1e-5, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.tok(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_pair():
    """What ``jaxdp parity --pair examples.parity_own_model_nnx:make_pair`` calls, in every process."""
    from parity_tests.own import ModelPair

    return ModelPair(flax_model=FlaxLM(), torch_model=TorchLM(), sample_batch=sample_batch,
                     flax_loss=flax_loss, torch_loss=torch_loss, flax_inputs=model_inputs,
                     flax_units=(Block,), torch_units=(TorchBlock,), name="tiny causal LM (Flax NNX)")


if __name__ == "__main__":  # the guard matters: the torch ranks re-import this file
    check(make_pair)
