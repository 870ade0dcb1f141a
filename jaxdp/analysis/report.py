"""``jaxdp inspect``'s table: a ``measure`` report (a dict) as text."""

import numpy as np

from jaxdp.analysis.measured import against_measurement
from jaxdp.analysis.state import COMPRESSED_BYTES
from jaxdp.strategies import facts


def _mb(x) -> str:
    return "n/a" if x is None else f"{round(x):,}"


def _formula_name(r: dict) -> str:
    """The strategy's ``facts.traffic_text``, its all-reduce written as its options make it."""
    compress = r.get("options", {}).get("compress")
    if compress == "powersgd":
        allreduce = "compressed step: 2(N-1)/N·p·(uncompressed + Σ(rows+cols)·r)"
    elif compress in COMPRESSED_BYTES:
        allreduce = f"2Ψ·{COMPRESSED_BYTES[compress]}B(N-1)/N, {compress} on the wire"
    else:
        allreduce = "2Ψp(N-1)/N"
    return facts(r["strategy"]).traffic_text.format(allreduce=allreduce)


def format_report(r: dict) -> str:
    mesh = f" (mesh {r['mesh_shape'][0]}x{r['mesh_shape'][1]})" if r.get("mesh_shape") else ""
    if _model_parallel(r):
        mesh = " (mesh " + " x ".join(f"{a}={s}" for a, s in r["mesh"].items()) + ")"
    size = f" width {r['width']} blocks {','.join(map(str, r['blocks']))}" if r.get("blocks") else ""  # a ResNet's
    what = f": {r['model']}{size}, {r['dtype']}, {r['optimizer']}" if "model" in r else ""
    options = "".join(f", {k} {v}" for k, v in r.get("options", {}).items() if k != "mesh_shape")
    lines = [
        f"{r['strategy']} on {_device_count(r)} devices{mesh}{what}{options} "
        f"(p = {r['param_bytes']} B, K = {r['opt_bytes_per_param']} B per param)",
        f"Ψ = {r['psi']:,} params"
        + (f"; Ψ_local (one model device's) = {r['psi_local']:,}" if _model_parallel(r) else "")
        + f"; padded for {r['shards']} shards: {r['psi_padded']:,} (+{r['psi_padded'] - r.get('psi_local', r['psi']):,})"
        + (f"; root unit (outside every FSDP unit, gathered once per step): {r['psi_root_padded']:,}"
           if r.get("psi_root_padded") is not None else ""),
        "",
        f"{'bytes per device':<22}{'measured':>16}{'formula':>16}{'formula (padded)':>18}{'meas/formula':>14}",
    ]
    s = r["state"]
    parts = [("params", "params"), ("grads", "grads (kept) *"), ("opt", "optimizer state")]
    if s["measured"]["extra"] or s["formula"]["extra"]:
        parts.append(("extra", "extra state"))
    for part, label in parts:
        m, f, fp = s["measured"][part], s["formula"][part], s["formula_padded"][part]
        ratio = f"{m / f:.4f}" if m is not None and f else "-"
        lines.append(f"{label:<22}{_mb(m):>16}{_mb(f):>16}{_mb(fp):>18}{ratio:>14}")
    if s["formula"].get("unsharded_grads"):  # accum_reduce once: the gradients summed whole over micro-batches
        lines.append(f"{'unsharded grads *':<22}{'':>16}{_mb(s['formula']['unsharded_grads']):>16}"
                     f"{_mb(s['formula_padded']['unsharded_grads']):>18}")
    scalars = s["measured"]["opt_scalars"]
    lines.append(f"{'':<22}(+ {scalars} B of optimizer step counts, replicated)")
    lines.append("* grads live only inside the step: traced per-device shapes, not live arrays")
    if "memory" in r:
        m = r["memory"]
        lines += ["", "compiled step, bytes per device: " + ", ".join(
            f"{k.replace('_bytes', '')} {_mb(v)}" for k, v in m.items() if k != "generated_code_bytes")
            + f"; argument+temp {_mb(m['argument_bytes'] + m['temp_bytes'])}"]
    if "traffic" in r:
        lines += [""] + _format_collectives(r)
    if r.get("collectives"):
        lines += [""] + format_overlap(r)
    if "target" in r:
        lines += [""] + _format_estimate(r)
    if _model_parallel(r):
        lines += [""] + _format_axes(r)
    return "\n".join(lines)


def _device_count(r: dict) -> int:
    """Every device of the mesh (``devices`` counts the data-parallel ones)."""
    return int(np.prod(list(r["mesh"].values()))) if _model_parallel(r) else r["devices"]


def _model_parallel(r: dict) -> bool:
    """A mesh with a model or stage axis of size > 1: the per-axis section is printed."""
    return any(r.get("mesh", {}).get(a, 1) > 1 for a in ("model", "stage"))


def _format_axes(r: dict) -> list:
    """Bytes per device by the axes each part is cut over, activations, and traffic per mesh axis."""
    a = r["axes"]
    lines = [f"per mesh axis: Ψ_rep (whole on every model device) {a['psi_rep']:,}, Ψ_split (cut over model) "
             f"{a['psi_split']:,}, Ψ_local = Ψ_rep + Ψ_split/M = {a['psi_local']:,}",
             f"{'bytes per device':<22}" + "".join(f"{_cut(k):>22}" for k in _state_labels(a)) + f"{'total':>14}"]
    for part, label in (("params", "params"), ("grads", "grads"), ("opt", "optimizer state")):
        by = a["state"][part]
        lines.append(f"{label:<22}" + "".join(f"{_mb(by.get(k, {}).get('bytes', 0)):>22}" for k in _state_labels(a))
                     + f"{_mb(sum(v['bytes'] for v in by.values())):>14}")
    if a.get("activations") is not None:
        lines.append(f"{'activations (temp)':<22}{_mb(a['activations']):>22}")
    if "traffic" in a:
        lines.append(f"{'traffic / step':<22}{'count':>8}{'ring B / device':>18}{'formula':>16}  ops")
        for axes, t in sorted(a["traffic"].items()):
            f = a["traffic_formula"].get(axes)
            ops = ", ".join(f"{k} {v:,.0f}" for k, v in t["ops"].items())
            lines.append(f"{'over ' + axes:<22}{t['count']:>8}{t['ring_bytes']:>18,.0f}{_mb(f):>16}  {ops}")
        lines.append("formulas: data = the strategy's over Ψ_local; model = 4·depth·2(M-1)/M·B·T·d·b "
                     "(Megatron: two layer pairs per block, one all-reduce each in forward and backward); "
                     "stage = 2(M+S-1)·(B/M)·a (GPipe: one permute of a micro-batch's boundary buffer per tick)")
    pipe = a.get("pipeline")
    if pipe is not None:
        lines.append(f"pipeline (stage axis): S = {pipe['stages']} stages, M = {pipe['microbatches']} micro-batches; "
                     f"params {_mb(pipe['params_bytes']).strip()} B per device (L = {pipe['stage_length']:,}); "
                     f"boundary activations in flight {_mb(pipe.get('activations_in_flight_bytes')).strip()} B; "
                     f"bubble (S-1)/(M+S-1) = {pipe['bubble_formula']:.2f}")
    return lines


def _cut(axes: str) -> str:
    return "replicated" if axes == "-" else "cut over " + axes


def _state_labels(a: dict) -> list:
    return sorted({k for part in a["state"].values() for k in part}, key=lambda k: (k.count("+"), k))


def _format_collectives(r: dict) -> list:
    c = r["traffic"]
    lines = [f"{'collectives / step':<20}{'count':>7}{'input B / device':>18}{'output B / device':>19}"
             f"{'ring B / device':>18}  groups"]
    for kind, o in c["ops"].items():
        if o["count"]:
            sizes = sorted({len(g["groups"][0]) for g in o["by_groups"] if g["groups"]})
            groups = f"of {','.join(map(str, sizes))}" if sizes else "pairs"
            lines.append(f"{kind:<20}{o['count']:>7}{o['input_bytes']:>18,.0f}{o['output_bytes']:>19,.0f}"
                         f"{o['ring_bytes']:>18,.0f}  {groups}")
    for i, branches in enumerate(c.get("conditionals", [])):
        lines.append(f"conditional {i}: ring bytes per branch " + " / ".join(f"{b:,.0f}" for b in branches)
                     + " (the total counts the larger)")
    f = r["traffic_formula_bytes"]
    steady = _steady_ring_bytes(r)
    ratio = f" ({steady / f:.4f} of formula)" if f else ""
    lines.append(f"{'total':<20}{'':>7}{'':>18}{'':>19}{c['ring_bytes']:>18,.0f}")
    if steady != c["ring_bytes"]:
        lines.append(f"{'compressed step':<20}{'':>7}{'':>18}{'':>19}{steady:>18,.0f}  (the smaller branch)")
    lines.append(f"formula ({_formula_name(r)}, ring terms): {'n/a' if f is None else f'{round(f):,} bytes'}{ratio}")
    written = r.get("ring_bytes_as_written")
    if written and abs(written / c["ring_bytes"] - 1) > 0.01:
        of = f" ({written / f:.4f} of formula)" if f else ""
        lines.append(f"as written (HLO before XLA's passes): {written:,.0f} bytes{of}; the compiled program differs")
    if c["unknown_trip_counts"]:
        lines.append(f"note: {c['unknown_trip_counts']} while loop(s) of unknown trip count counted once")
    return lines


def format_overlap(r: dict) -> list:
    """Per kind of collective: how many run asynchronously, and how many of those have compute (any
    kernel; a convolution or matmul) scheduled between their halves; bytes per device by link; for a
    GPU target, the estimate's exposed time (``estimate.py``)."""
    estimated = "exposed_s" in r["collectives"][0]
    lines = [f"{'overlap':<20}{'count':>7}{'async':>7}{'+compute':>10}{'+matmul':>9}{'MiB NVLink':>12}"
             f"{'MiB network':>13}" + (f"{'exposed us':>12}" if estimated else "")]
    for kind in sorted({c["kind"] for c in r["collectives"]}):
        ops = [c for c in r["collectives"] if c["kind"] == kind]
        link = {across: sum(c["runs"] * c["ring_bytes"] for c in ops if c["across_hosts"] == across) / 2**20
                for across in (False, True)}
        lines.append(f"{kind:<20}{sum(c['runs'] for c in ops):>7}{sum(c['async'] for c in ops):>7}"
                     f"{sum(c['async'] and c['compute_between'] > 0 for c in ops):>10}"
                     f"{sum(c['async'] and c['matmul_between'] > 0 for c in ops):>9}{link[False]:>12.2f}{link[True]:>13.2f}"
                     + (f"{sum(c['exposed_s'] for c in ops) * 1e6:>12.1f}" if estimated else ""))
    if r.get("backend") == "cpu":
        lines.append("(XLA:CPU runs every collective synchronously: no overlap to see here; compile for a GPU "
                     "with --target h100)")
    return lines


def _format_estimate(r: dict) -> list:
    ms = 1e3
    if "estimated_step_s" not in r:  # --no-compile: the state's bytes alone
        return [f"for {r['devices']} {r['target'].upper()} on {r['hosts']} host(s), not compiled (--no-compile): "
                f"no memory, collectives or estimate"]
    lines = [f"compiled for {r['devices']} {r['target'].upper()} on {r['hosts']} host(s), without a GPU "
             f"(jaxdp.runtime.target); memory above is XLA's GPU buffer assignment (no cuDNN workspace)",
             f"ESTIMATED step time (a roofline from the target's published peaks, not a measurement): "
             f"{r['estimated_step_s'] * ms:.3f} ms = kernels {r['kernels_s'] * ms:.3f} (each its own roofline, one "
             f"after another) + exposed communication {r['exposed_communication_s'] * ms:.3f} (of "
             f"{r['communication_s'] * ms:.3f}: each collective hidden only by the kernels inside its own window)",
             f"whole-step bounds: compute {r['compute_s'] * ms:.3f} ms ({r['flops'] / 1e9:,.1f} GFLOP), memory "
             f"{r['memory_s'] * ms:.3f} ms ({r['bytes_accessed'] / 2**20:,.1f} MiB accessed per device)"]
    measured = against_measurement(r)
    if measured:
        lines.append(f"measured on an H200 (docs/strategies.md, GPU programs without a GPU): "
                     f"{measured['measured_step_s'] * ms:.2f} ms; estimate / measured = "
                     f"{measured['estimate_over_measured']:.2f}")
    return lines


def _steady_ring_bytes(r: dict) -> float:
    """Ring bytes of the step that runs in steady state: PowerSGD's compressed branch (the smaller)."""
    c = r["traffic"]
    if r.get("options", {}).get("compress") != "powersgd":
        return c["ring_bytes"]
    return c["ring_bytes"] - sum(max(b) - min(b) for b in c.get("conditionals", []))
