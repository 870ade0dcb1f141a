"""``jaxdp inspect``'s table: a ``measure`` report (a dict) as text."""

from jaxdp.analysis.state import COMPRESSED_BYTES


def _mb(x) -> str:
    return "n/a" if x is None else f"{round(x):,}"


def _formula_name(r: dict) -> str:
    """The strategy's ``facts.traffic_text``, its all-reduce written as its options make it."""
    from jaxdp.strategies import facts

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
    size = f" width {r['width']} blocks {','.join(map(str, r['blocks']))}" if r.get("blocks") else ""  # a ResNet's
    what = f": {r['model']}{size}, {r['dtype']}, {r['optimizer']}" if "model" in r else ""
    options = "".join(f", {k} {v}" for k, v in r.get("options", {}).items() if k != "mesh_shape")
    lines = [
        f"{r['strategy']} on {r['devices']} devices{mesh}{what}{options} "
        f"(p = {r['param_bytes']} B, K = {r['opt_bytes_per_param']} B per param)",
        f"Ψ = {r['psi']:,} params; padded for {r['shards']} shards: {r['psi_padded']:,} "
        f"(+{r['psi_padded'] - r['psi']:,})"
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
    scalars = s["measured"]["opt_scalars"]
    lines.append(f"{'':<22}(+ {scalars} B of optimizer step counts, replicated)")
    lines.append("* grads live only inside the step: traced per-device shapes, not live arrays")
    if "memory" in r:
        m = r["memory"]
        lines += ["", "compiled step, bytes per device: " + ", ".join(
            f"{k} {_mb(v)}" for k, v in m.items() if k != "generated_code")
            + f"; argument+temp {_mb(m['argument'] + m['temp'])}"]
    if "collectives" in r:
        lines += [""] + _format_collectives(r)
    return "\n".join(lines)


def _format_collectives(r: dict) -> list:
    c = r["collectives"]
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


def _steady_ring_bytes(r: dict) -> float:
    """Ring bytes of the step that runs in steady state: PowerSGD's compressed branch (the smaller)."""
    c = r["collectives"]
    if r.get("options", {}).get("compress") != "powersgd":
        return c["ring_bytes"]
    return c["ring_bytes"] - sum(max(b) - min(b) for b in c.get("conditionals", []))
