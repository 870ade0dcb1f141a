"""Does XLA:GPU let a program pin a collective's window to compute? A probe for the installed jaxlib.

    .venv/bin/python benchmarks/scheduling_group_probe.py [--out benchmarks/results]

XLA's latency-hiding scheduler closes each collective's window once its cost model says the transfer
is covered. For ZeRO-3's three smallest forward and backward gathers (ResNet-18 w64, bf16, 8 H100s:
0.46, 0.59 and 2.36 MB) the kernels that cover them are BatchNorm reductions, not convolutions.
XLA's one public lever on a window is a scheduling group (``set_xla_metadata(_scheduling_group_id=...)``
on the collective and on the compute meant to run inside it). This compiles a toy step for 8
compile-only H100s, an all-gather beside two matmuls and a reduction, twice: plain, and with gather
and compute in one group. It prints what sits between the gather's start and done each time.

Measured with jaxlib 0.10.2 and 0.12.0.1: plain, the window holds a matmul and three other kernels.
Grouped, XLA drops the group from the compute and makes the gather synchronous, with the warning "Async
collective pair ... with scheduling group id 1 is not overlapped after scheduling and is converted
to a synchronous collective". So jaxdp orders its collectives with data dependences only (``strategies/ties.py``,
``strategies/lead.py``), and sizing the windows is left to XLA. Re-run this when jaxlib changes.
"""

import argparse
import contextlib
import json
import os
import re

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax.experimental.xla_metadata import set_xla_metadata
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxdp.runtime.target import Target, compile_only_devices

GROUP = 1


def step(grouped: bool):
    """A gather of the next layer's weight beside this layer's compute (one matmul, a reduction)."""
    def body(x, w1, w2_chunk):
        h = jnp.tanh(x @ w1)
        with set_xla_metadata(_scheduling_group_id=GROUP) if grouped else contextlib.nullcontext():
            h = jnp.tanh(h @ w1)
            h = jnp.sum(h, axis=0, keepdims=True) * h
        w2 = jax.lax.all_gather(w2_chunk, "data", axis=0, tiled=True)
        if grouped:
            w2 = set_xla_metadata(w2, _scheduling_group_id=GROUP)
        return jnp.tanh(h @ w2)
    return body


def window(grouped: bool, devices) -> dict:
    """The ops between the all-gather's start and done in the compiled entry computation."""
    mesh = Mesh(np.array(devices), ("data",))
    f = jax.jit(jax.shard_map(step(grouped), mesh=mesh, in_specs=(P("data"), P(), P("data")), out_specs=P("data")))
    x = jax.ShapeDtypeStruct((len(devices) * 256, 1024), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)
    text = f.lower(x, w, w).compile().as_text()
    names = [m.group(1) for m in re.finditer(r"^\s*(?:ROOT )?%(\S+) = ", text[text.index("ENTRY"):], re.M)]
    if not any(n.startswith("all-gather-start") for n in names):
        return {"async": False, "between": []}
    start = next(i for i, n in enumerate(names) if n.startswith("all-gather-start"))
    done = next(i for i, n in enumerate(names) if n.startswith("all-gather-done"))
    between = [n for n in names[start + 1:done] if "fusion" in n or "custom-call" in n]
    return {"async": True, "between": between}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for scheduling_group_probe.json")
    args = ap.parse_args(argv)
    devices = compile_only_devices(Target.parse("h100", devices=8, hosts=1))
    result = {"jaxlib": jaxlib.__version__,
              "plain": window(False, devices), "grouped": window(True, devices)}
    for name in ("plain", "grouped"):
        w = result[name]
        print(f"{name:8s} async={w['async']!s:5s} between start and done: {', '.join(w['between']) or 'nothing'}")
    honoured = result["grouped"]["async"] and any("dot" in n for n in result["grouped"]["between"])
    print("XLA keeps the matmul in the gather's window when asked:", "yes" if honoured else "no")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "scheduling_group_probe.json"), "w") as f:
            json.dump({**result, "honoured": honoured}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
