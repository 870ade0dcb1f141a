"""Hugging Face's own two GPT-2s, PyTorch's ``GPT2LMHeadModel`` and Flax's ``FlaxGPT2LMHeadModule``,
checked step by step as a port of one's own: no correspondence written by hand.

    pip install -e ".[hf]"                   # transformers < 5: the last line with Flax models
    python examples/parity_hf_gpt2.py        # ddp and zero3 on 2 simulated devices, float64 and bfloat16
    jaxdp parity --pair examples.parity_hf_gpt2:make_pair --strategy zero3 --devices 2 --dtype float64
    jaxdp parity --pair examples.parity_hf_gpt2:left_padded_pair --strategy ddp --devices 2   # fails: see below

Both models come from one tiny random ``GPT2Config`` with its defaults (tied input and output
embeddings, ``return_dict=True``), dropout off; nothing is downloaded. The harness matches the
weights by itself: HF's ``Conv1D`` (weights stored (in, out)) against ``FlaxConv1D`` (kernels
stored (out, in)), the square ones as their classes' other weights say; the tied ``lm_head``
is torch's ``transformer.wte.weight`` under a second name, Flax's ``wte`` embedding used twice.
The attention mask and the position ids come from the batch, by keyword on both sides.

The batches are right-padded (a random length per row). Left-padded, the two ports differ
(``left_padded_pair``): on a query row whose keys are all padding, Flax adds ``finfo.min`` to
every masked key (its softmax as if nothing were masked), torch's ``scaled_dot_product_attention``
gives that row zeros. The loss here counts every position, padding included, so the harness
sees it: at step 0, and the first module whose output differs is ``transformer.h.0.attn.c_proj``
(docs/parity.md, "Porting a Hugging Face model").
"""

import os

if __name__ == "__main__":  # 2 simulated CPU devices for the runs below, set before jax starts
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import numpy as np  # noqa: E402

VOCAB, SEQ, POSITIONS = 64, 8, 16


def config():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=32, n_layer=2, n_head=2,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def sample_batch(rng: np.random.Generator, rows: int, left: bool = False) -> dict:
    """Random tokens, each row real for a random length (at least half) and padded after it
    (``left``: before it), position ids counting the real tokens as HF's generate does."""
    lengths = rng.integers(SEQ // 2, SEQ + 1, (rows, 1))
    real = np.arange(SEQ) < lengths
    if left:
        real = real[:, ::-1]
    positions = np.maximum(np.cumsum(real, axis=1) - 1, 0)
    return {"input_ids": rng.integers(0, VOCAB, (rows, SEQ)).astype(np.int32),
            "attention_mask": real.astype(np.int32), "position_ids": positions.astype(np.int32)}


def left_padded_batch(rng: np.random.Generator, rows: int) -> dict:
    return sample_batch(rng, rows, left=True)


def model_inputs(batch):
    """(args, kwargs) on both sides: indexing only, so the same for jnp arrays and torch tensors."""
    return (batch["input_ids"],), {"attention_mask": batch["attention_mask"], "position_ids": batch["position_ids"]}


def flax_loss(outputs, batch):
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(outputs.logits[:, :-1], batch["input_ids"][:, 1:])


def torch_loss(outputs, batch):
    import torch.nn.functional as F

    return F.cross_entropy(outputs["logits"][:, :-1].transpose(1, 2), batch["input_ids"][:, 1:], reduction="none")


def make_pair(batches=sample_batch):
    """What ``jaxdp parity --pair examples.parity_hf_gpt2:make_pair`` calls, in every process."""
    from transformers import GPT2LMHeadModel
    from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2Block, FlaxGPT2LMHeadModule
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from parity_tests.own import ModelPair

    return ModelPair(flax_model=FlaxGPT2LMHeadModule(config()), torch_model=GPT2LMHeadModel(config()),
                     sample_batch=batches, flax_loss=flax_loss, torch_loss=torch_loss, flax_inputs=model_inputs,
                     flax_units=(FlaxGPT2Block,), torch_units=(GPT2Block,), name="HF GPT-2")


def left_padded_pair():
    return make_pair(left_padded_batch)


if __name__ == "__main__":  # the guard matters: the torch ranks re-import this file
    from parity_tests.own import PairRun, run_pair

    for strategy in ("ddp", "zero3"):
        for dtype in ("float64", "bfloat16"):
            result = run_pair(make_pair, PairRun(strategy=strategy, devices=2, dtype=dtype, steps=3))
            print(f"{strategy} {dtype}: {'PASS' if result.passed else 'FAIL'}: {result.message()}")
    result = run_pair(left_padded_pair, PairRun(strategy="ddp", devices=2, dtype="float64", steps=1))
    print(f"left-padded ddp float64: {'PASS' if result.passed else 'FAIL'}: {result.message()}")
