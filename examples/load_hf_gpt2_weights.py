"""Hugging Face's PyTorch GPT-2 weights in its Flax twin, with ``jaxdp.interop`` alone: no parity
harness, no correspondence written by hand, nothing downloaded.

    python examples/load_hf_gpt2_weights.py     # ~15 s: float64 and float32 logits, and the way back

A tiny random ``GPT2Config`` builds both models: ``GPT2LMHeadModel`` (torch) and
``FlaxGPT2LMHeadModule`` (a Flax Linen module). ``load_torch_weights`` matches every torch
tensor to its Flax variable by HF's rules: HF's ``Conv1D`` stores its weights (in, out) and
``FlaxConv1D`` (out, in), so they are transposed, the square ``c_proj`` as its class's other
weights; the tied ``lm_head.weight`` is ``transformer.wte.weight`` under a second name, Flax's
``wte`` used twice. The two models then give the same logits (float64: to ~1e-15), and
``torch_state_dict`` brings the Flax weights back, bit for bit. With a checkpoint, pass
``GPT2LMHeadModel.from_pretrained(...)`` instead (docs/porting-weights.md).
"""

import numpy as np

VOCAB, SEQ = 64, 8


def config():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def batch(rows: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, VOCAB, (rows, SEQ)),
            "attention_mask": np.ones((rows, SEQ), np.int64)}


def compare(dtype: str = "float64", seed: int = 0):
    """(the largest |logit difference| of the two models on one batch, the largest logit,
    whether torch -> Flax -> torch gave back every tensor exactly) in ``dtype``."""
    import jax
    import jax.numpy as jnp
    import torch
    from transformers import GPT2LMHeadModel
    from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2LMHeadModule

    from jaxdp.interop import load_torch_weights, torch_state_dict, trace_linen

    torch.manual_seed(seed)
    torch_model = GPT2LMHeadModel(config()).to(getattr(torch, dtype)).eval()
    inputs = batch(seed=seed)
    with jax.enable_x64(dtype == "float64"):
        flax_model = FlaxGPT2LMHeadModule(config(), dtype=jnp.dtype(dtype))
        ids, mask = jnp.asarray(inputs["input_ids"]), jnp.asarray(inputs["attention_mask"])
        positions = jnp.broadcast_to(jnp.arange(SEQ), ids.shape)
        shapes, classes = trace_linen(flax_model, ids, mask, positions)
        variables = load_torch_weights(torch_model, shapes, flax_classes=classes, dtype=np.dtype(dtype))
        flax_logits = np.asarray(flax_model.apply(variables, ids, mask, positions).logits)
    with torch.no_grad():
        torch_logits = torch_model(input_ids=torch.from_numpy(inputs["input_ids"]),
                                   attention_mask=torch.from_numpy(inputs["attention_mask"])).logits.numpy()
    back = torch_state_dict(torch_model, variables, flax_classes=classes)
    exact = all(np.array_equal(back[k], v.numpy()) for k, v in torch_model.state_dict().items())
    return float(np.abs(flax_logits - torch_logits).max()), float(np.abs(torch_logits).max()), exact


if __name__ == "__main__":
    for dtype in ("float64", "float32"):
        err, scale, exact = compare(dtype)
        print(f"{dtype}: max |logit difference| {err:.1e} (logits up to {scale:.2f}); "
              f"torch -> Flax -> torch {'exact' if exact else 'NOT exact'}")
