"""``jaxdp bench --mesh data=4 data=2,model=2 data=2,stage=2``: one row per (strategy, mesh layout), jaxdp only.

Each row is ``jax_side.bench_jax`` on the named mesh (compiled once, timed after warm-up), with
the per-axis traffic of ``jaxdp.analysis.axes`` (ring bytes per device per step over each mesh
axis, from the compiled HLO, beside the formulas) and, for a mesh with a stage axis (PPxDP,
GPipe with M = S micro-batches, ``jaxdp.analysis.axes.pipeline_accounting``), a ``bubble``
column: the measured idle fraction beside GPipe's (S-1)/(M+S-1). The estimator is
``torch_commands/bench/pipeline_bubble.py``'s, 1 - t_ideal / t: the ideal pipelined step is the
same work split over all the devices with no bubble, taken here as the same strategy's step on
a data-only mesh of as many devices in the same run (blank without one). torch_ref's twins of
these layouts are not timed here (parity_tests.model_parallel and pipeline_parallel check their numbers).

Jax-free at import.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from torch_commands.bench.jax_side import bench_jax

AXES_SHOWN = ("data", "model", "stage")
LAYOUT_HEADER = ("| strategy | mesh | jaxdp step s | img/s | compile s | params/dev MiB | traffic/step MiB "
                 + " ".join(f"| {a} axis MiB meas / formula" for a in AXES_SHOWN) + " | bubble meas / (S-1)/(M+S-1) |")


def mesh_text(sizes: dict) -> str:
    return ",".join(f"{a}={s}" for a, s in sizes.items())


def layout_row(name: str, sizes: dict, cfg: dict, rng) -> dict:
    """One (strategy, mesh) row: the global batch split over the data axis."""
    n = math.prod(sizes.values())
    size = cfg.get("image_size", 32)
    images = rng.normal(size=(cfg["global_batch"], size, size, 3)).astype(np.float32)
    labels = rng.integers(0, 10, size=cfg["global_batch"]).astype(np.int32)
    try:
        rec = bench_jax(name, n, cfg, images, labels, mesh=sizes)
    except Exception as e:  # e.g. a strategy that refuses the mesh: the row says why
        rec = {"error": f"{type(e).__name__}: {e}"}
    times = rec.get("step_times_s") or []
    if times:
        rec["median_step_s"] = float(np.median(times))
        rec["images_per_s"] = cfg["global_batch"] / rec["median_step_s"]
    axes = rec.get("axes") or {}
    if "collectives" in rec and axes:  # the compiled step's collectives, per mesh axis
        from jaxdp.analysis.axes import traffic_by_axis

        axes["traffic"] = traffic_by_axis(rec["collectives"], tuple(sizes.values()), tuple(sizes))
    pipeline = axes.get("pipeline") or {}
    return {"strategy": name, "mesh": sizes, "n": n, "global_batch": cfg["global_batch"], "jaxdp": rec,
            "bubble": pipeline.get("bubble_formula"), "bubble_measured": None}


def measured_bubble(ideal_s: float, step_s: float) -> float:
    """The idle fraction a pipelined step of ``step_s`` shows against a bubble-free ``ideal_s``."""
    return 1 - ideal_s / step_s


def add_measured_bubbles(rows: list) -> None:
    """Each stage row's measured bubble, against the same strategy's data-only row of as many devices."""
    ideal = {(r["strategy"], r["n"]): r["jaxdp"].get("median_step_s") for r in rows if set(r["mesh"]) == {"data"}}
    for r in rows:
        t, t_ideal = r["jaxdp"].get("median_step_s"), ideal.get((r["strategy"], r["n"]))
        if r["mesh"].get("stage", 1) > 1 and t and t_ideal:
            r["bubble_measured"] = measured_bubble(t_ideal, t)


def run_layouts(cfg: dict, strategies: Sequence[str], meshes: Sequence[dict], log=print) -> list:
    rng = np.random.default_rng(0)
    rows = []
    log(LAYOUT_HEADER)
    for sizes in meshes:
        for name in strategies:
            rows.append(layout_row(name, sizes, cfg, rng))
            log(layout_line(rows[-1]))
    add_measured_bubbles(rows)  # the stage rows' lines above had no data-only row to compare with yet
    return rows


def _mib(x, spec=".3f"):
    return "-" if x is None else format(x / 2 ** 20, spec)


def layout_line(r: dict) -> str:
    j = r["jaxdp"]
    if "error" in j:
        return f"| {r['strategy']} | {mesh_text(r['mesh'])} | error: {j['error']} |"
    axes = j.get("axes") or {}
    traffic, formula = axes.get("traffic") or {}, axes.get("traffic_formula") or {}
    params = sum(v["bytes"] for v in (axes.get("state") or {}).get("params", {}).values()) or None
    cells = [r["strategy"], mesh_text(r["mesh"]), f"{j['median_step_s']:.4f}", f"{j['images_per_s']:.1f}",
             f"{j.get('compile_s', 0):.1f}", _mib(params), _mib((j.get("collectives") or {}).get("ring_bytes"))]
    for a in AXES_SHOWN:
        cells.append(f"{_mib(traffic[a]['ring_bytes'])} / {_mib(formula.get(a))}" if a in traffic else "")
    if r["bubble"] is not None:
        cells.append(f"{'-' if r.get('bubble_measured') is None else format(r['bubble_measured'], '.2f')} / "
                     f"{r['bubble']:.2f}")
    else:
        cells.append("")
    return "| " + " | ".join(cells) + " |"


def layout_markdown(result: dict) -> str:
    c = result["config"]
    lines = [f"{c['model']}, global batch {c['global_batch']}, {c['dtype']}, {c['optimizer']}; "
             f"median of {c['steps']} steps after {c['warmup']} warm-up; {result['environment']['device_kind']} "
             f"x {result['environment']['jax_devices']} (simulated), {result['environment']['cpu_count']} cores",
             "", LAYOUT_HEADER, "|" + "---|" * (LAYOUT_HEADER.count("|") - 1)]
    lines += [layout_line(r) for r in result["rows"]]
    return "\n".join(lines)
