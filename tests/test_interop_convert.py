"""jaxdp.interop's converter on models of users' own, without the parity harness: torch weights
into a Flax Linen or NNX model and back, by the rules the harness checks.

- HF's GPT-2 (examples/load_hf_gpt2_weights.py): the Flax twin's logits equal torch's (float64 to
  rounding, float32 to its noise), and torch -> Flax -> torch gives back every tensor exactly;
- an NNX module (examples/parity_own_model_nnx.py): a copy of it holds torch's weights (Linear
  transposed, the Embedding and a bare parameter as they are), and its forward equals torch's;
- a mismatch is refused in one message naming both sides; torch's classes are read without torch.
"""

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype,bound", [("float64", 1e-13), ("float32", 1e-5)])
def test_hf_gpt2_weights_give_the_flax_twin_torchs_logits_and_come_back_exactly(dtype, bound):
    pytest.importorskip("transformers")
    err, scale, exact = _example("load_hf_gpt2_weights").compare(dtype)
    assert scale > 0.1 and err <= bound * scale, (dtype, err, scale)
    assert exact


def test_an_nnx_module_takes_torchs_weights_and_gives_them_back():
    import jax
    from flax import nnx

    from jaxdp.interop import load_torch_weights, torch_state_dict

    example = _example("parity_own_model_nnx")
    torch.manual_seed(0)
    torch_model = example.TorchLM().double().eval()
    with jax.enable_x64(True):
        module = example.FlaxLM()
        loaded = load_torch_weights(torch_model, module, dtype=np.float64)
        sd = torch_model.state_dict()
        np.testing.assert_array_equal(np.asarray(loaded.blocks[0].qkv.kernel[...]), sd["blocks.0.qkv.weight"].numpy().T)
        np.testing.assert_array_equal(np.asarray(loaded.tok.embedding[...]), sd["tok.weight"].numpy())
        np.testing.assert_array_equal(np.asarray(loaded.pos[...]), sd["pos"].numpy())
        tokens = np.random.default_rng(0).integers(0, example.VOCAB, (2, example.SEQ))
        flax_logits = np.asarray(loaded(jax.numpy.asarray(tokens)))
        with torch.no_grad():
            torch_logits = torch_model(torch.from_numpy(tokens)).numpy()
        np.testing.assert_allclose(flax_logits, torch_logits, rtol=0, atol=1e-12)
        assert isinstance(loaded, example.FlaxLM) and loaded is not module  # a copy: the module keeps its own
        assert not np.array_equal(np.asarray(module.pos[...]), np.asarray(loaded.pos[...]))
        back = torch_state_dict(torch_model, loaded)
    assert list(back) == list(sd)
    for name, value in sd.items():
        np.testing.assert_array_equal(back[name], value.numpy(), err_msg=name)
    assert isinstance(nnx.state(loaded), nnx.State)


def test_models_that_do_not_correspond_are_refused_naming_both_sides():
    from jaxdp.interop import CorrespondenceError, derive

    torch_model = torch.nn.Module()
    torch_model.head, torch_model.extra = torch.nn.Linear(16, 32), torch.nn.Linear(3, 5)
    variables = {"params": {"head": {"kernel": np.zeros((16, 32)), "bias": np.zeros(32)},
                            "stray": {"scale": np.zeros(7)}}}
    corr = derive(torch_model, {"params": {"head": variables["params"]["head"],
                                           "extra": {"kernel": np.zeros((3, 5)), "bias": np.zeros(5)}}})
    assert [(k.torch, k.flax_name, k.layout.name) for k in corr.links][:2] == [
        ("head.weight", "params/head/kernel", "linear"), ("head.bias", "params/head/bias", "identity")]
    with pytest.raises(CorrespondenceError) as e:
        derive(torch_model, variables)
    assert str(e.value) == (
        "the weight correspondence does not cover both models: torch only: extra.weight (5, 3), extra.bias (5,); "
        "flax only: params/stray/scale (7,) (map them with override={torch name: 'collection/flax/path' | "
        "(path, layout) | None})")


def test_torch_classes_are_read_without_torch():
    from jaxdp.interop.torch_classes import is_torch

    class Linear:  # a class of the same name, not torch's
        pass

    class Mine(torch.nn.Linear):
        pass

    assert is_torch(torch.nn.Linear(2, 3), "Linear") and is_torch(Mine(2, 3), "Linear")
    assert is_torch(torch.nn.BatchNorm1d(3), "_BatchNorm") and not is_torch(torch.nn.LayerNorm(3), "_BatchNorm")
    assert not is_torch(Linear(), "Linear")
    code = "import sys, jaxdp.interop; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
