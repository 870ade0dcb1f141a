"""``trainer.inspect`` of the LM examples, compiled for compile-only GPUs (test_trainer_inspect.py).

    python tests/trainer_inspect_job.py OUT_DIR NAME=FLAVOUR:STRATEGY:HOSTS ...
    jaxdp inspect --target h100 --trainer trainer_inspect_job:nnx_zero3   # tests/ on PYTHONPATH

FLAVOUR: nnx (examples/custom_model_nnx.py) or linen (examples/custom_model.py); STRATEGY: zero3 or hsdp;
HOSTS: hosts of 8 H100s. Each Trainer is built on 2 of this machine's CPU devices, with 4 rows per
device; each report is written as OUT_DIR/NAME.json, and the report without compiling as NAME-no-compile.json. Run with the user's XLA flags, as a user's
process would (the suite's change XLA's GPU schedule).
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))


def make_trainer(flavour: str, strategy: str):
    """(an LM example's Trainer on 2 CPU devices, its example batch of 8 rows)."""
    import jax
    import optax

    import jaxdp

    if flavour == "nnx":
        from flax import nnx

        import custom_model_nnx as ex
        model, loss_fn, inputs = ex.TinyLM(rngs=nnx.Rngs(0)), ex.loss_fn, {}
    else:
        import custom_model as ex
        model, loss_fn, inputs = ex.model, ex.loss_fn, {"model_inputs": lambda batch: (batch["tokens"][:, :-1],)}
    spec = jaxdp.ZeRO(stage=3, units=(ex.Block,)) if strategy == "zero3" else jaxdp.HSDP(units=(ex.Block,))
    mesh = jaxdp.make_mesh(data=2) if strategy == "zero3" else jaxdp.make_mesh(replica=2, data=1)
    trainer = jaxdp.Trainer(model, loss_fn, optax.adamw(3e-3, weight_decay=0.01), spec, mesh, **inputs)
    assert trainer.mesh.devices.flat[0].platform == "cpu" and jax.device_count() >= 2
    return trainer, next(ex.batches(1, batch_size=8))


def nnx_zero3():
    """For ``jaxdp inspect --trainer trainer_inspect_job:nnx_zero3``."""
    return make_trainer("nnx", "zero3")


def main(out, *jobs):
    for job in jobs:
        name, _, spec = job.partition("=")
        flavour, strategy, hosts = spec.split(":")
        trainer, batch = make_trainer(flavour, strategy)
        start = time.perf_counter()
        report = trainer.inspect(batch, target="h100", devices=8, hosts=int(hosts))
        report["inspect_s"] = time.perf_counter() - start
        Path(out, f"{name}.json").write_text(json.dumps(report))
        uncompiled = trainer.inspect(batch, target="h100", devices=8, hosts=int(hosts), compile=False)
        Path(out, f"{name}-no-compile.json").write_text(json.dumps(uncompiled))
        print(f"{name}: {report['inspect_s']:.1f} s", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
