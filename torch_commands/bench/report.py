"""The bench's tables and plots: one row per (N, strategy), Markdown beside the JSON, and a PNG
of throughput, memory per device and traffic per step."""

from __future__ import annotations

import os
from typing import List

import numpy as np

from torch_commands.bench.variants import label


def _fmt(x, spec=".3f", none="-"):
    return none if x is None else format(x, spec)


def _mb(x):
    return None if x is None else x / 2 ** 20


HEADER = ("| strategy | N | jaxdp step s | torch step s | jax/torch | jaxdp img/s | torch img/s | compile s "
          "| mem/dev MiB (compiled) | state MiB meas / formula | traffic MiB/step meas / formula "
          "| torch.compile step s | jax/best torch |")


def _row_cells(r: dict) -> list:
    j, t = r.get("jaxdp", {}), r.get("torch_ref", {})
    st = j.get("state") or {}
    meas = st.get("measured") or {}
    form = st.get("formula") or {}
    state_m = sum(v for k, v in meas.items() if k in ("params", "grads", "opt") and v is not None) if meas else None
    state_f = sum(form.values()) if form else None
    coll = (j.get("collectives") or {}).get("ring_bytes")
    err = j.get("error") or t.get("error")
    return [r["strategy"] + (f" {r['mesh_shape'][0]}x{r['mesh_shape'][1]}" if r.get("mesh_shape") else "")
            + label(r.get("options", {})) + (f" [{r['lever']}]" if r.get("lever") not in (None, "default") else ""),
            str(r["n"]), _fmt(j.get("median_step_s"), ".4f"),
            _fmt(t.get("median_step_s"), ".4f", "n/a" if "torch_ref" not in r else "err"),
            _fmt(r.get("ratio_jax_over_torch"), ".2f"), _fmt(j.get("images_per_s"), ".1f"),
            _fmt(t.get("images_per_s"), ".1f"), _fmt(j.get("compile_s"), ".1f"),
            _fmt(_mb((j.get("memory") or {}).get("total_bytes")), ".2f"),
            f"{_fmt(_mb(state_m), '.3f')}{' (no grads)' if meas and meas.get('grads') is None else ''}"
            f" / {_fmt(_mb(state_f), '.3f')}",
            f"{_fmt(_mb(coll), '.3f')} / {_fmt(_mb(j.get('traffic_formula_bytes')), '.3f')}",
            _fmt((r.get("torch_compile") or {}).get("median_step_s"), ".4f", "-" if "torch_compile" not in r else "err"),
            _fmt(r.get("ratio_jax_over_best_torch"), ".2f")] + ([err[:80]] if err else [])


def row_line(r: dict) -> str:
    return " | ".join(_row_cells(r))


def markdown(result: dict) -> str:
    c, e = result["config"], result["environment"]
    lines = [
        f"Model {c['model']} width {c['width']} blocks {c['blocks'] or 'default'}, {c['dtype']}, {c['optimizer']}, "
        f"global batch {c['global_batch']}, median of {c['steps']} steps after {c['warmup']} warm-up.",
        f"Machine: {e['device_kind']} ({e['backend']}), {e['cpu_count']} CPUs ({e['cpu_model']}), "
        f"jax {e['jax']}, torch {e.get('torch')}, {e['date_utc']} UTC; load average start "
        f"{', '.join(f'{x:.2f}' for x in e['loadavg'])}, end {', '.join(f'{x:.2f}' for x in e['loadavg_end'])}.",
        f"XLA_FLAGS: `{e['XLA_FLAGS']}`; torch: 1 intra-op thread per rank.",
        "",
        HEADER,
        "|" + "---|" * (HEADER.count("|") - 1),
    ]
    for r in result["rows"]:
        cells = _row_cells(r)[:HEADER.count("|") - 1]
        lines.append("| " + " | ".join(cells) + " |")
    if result.get("peak_flops"):
        lines += ["", f"MFU: {result['flop_per_image'] / 1e9:.3g} GFLOP per trained image (jaxdp.run.flops), "
                      f"peak {result['peak_flops'] / 1e12:.4g} TFLOP/s per device (jaxdp.run.perf.PEAK_FLOPS)."]
        for r in result["rows"]:
            if "mfu_jaxdp" in r:
                lines.append(f"- MFU {r['strategy']} N={r['n']}: jaxdp {r['mfu_jaxdp']:.1%}, torch_ref "
                             f"{_fmt(r.get('mfu_torch_ref'), '.1%')}, torch.compile {_fmt(r.get('mfu_torch_compile'), '.1%')}")
    p = result.get("pipeline")
    if p and "images_per_s" in p:
        lines += ["", f"Input pipeline (numpy, epoch_batches with augmentation, {p['replicas']} replicas): "
                      f"{p['images_per_s']:.0f} images/s on the host; best jaxdp training rate "
                      f"{_fmt(p.get('best_jaxdp_train_images_per_s'), '.1f')} images/s; headroom "
                      f"{_fmt(p.get('headroom'), '.1f')}x."]
    return "\n".join(lines)


FRAMEWORKS = ("jaxdp", "torch_ref", "torch_compile")


def problems(result: dict) -> dict:
    """Every component of a bench result that errored or did not run: {"errors": ["what: message"],
    "not_run": [...]}; a bench that has any exits non-zero (``exit_status``)."""
    found = {"errors": [], "not_run": []}

    def note(what: str, rec) -> None:
        if isinstance(rec, dict):
            for key, into in (("error", "errors"), ("not_run", "not_run")):
                if rec.get(key):
                    found[into].append(f"{what}: {str(rec[key]).strip().splitlines()[-1][:400]}")

    for r in result.get("rows", []):
        for fw in FRAMEWORKS:
            note(f"{r['strategy']} N={r['n']} {fw}", r.get(fw))
    for key, bare in (result.get("bare") or {}).items():
        for side, rec in (bare or {}).items():
            note(f"bare N={key} {side}", rec)
    note("jaxdp train", result.get("train"))
    note("input pipeline", result.get("pipeline"))
    for name, rec in (result.get("extra") or {}).items():
        note(name, rec)
    return found


def exit_status(result: dict) -> int:
    """0: every component ran; 1: one errored (a torch.compile that failed included); 3: none
    errored but one was not run (the deadline)."""
    found = problems(result)
    return 1 if found["errors"] else 3 if found["not_run"] else 0


def problems_markdown(result: dict) -> str:
    """Each component that errored or did not run, with its message: a bench that has one exits
    non-zero, and says why here."""
    found = problems(result)
    if not (found["errors"] or found["not_run"]):
        return ""
    lines = ["", f"**{len(found['errors'])} component(s) failed, {len(found['not_run'])} not run** "
                 f"(exit {exit_status(result)}):", ""]
    lines += [f"- ERROR {e}" for e in found["errors"]] + [f"- NOT RUN {e}" for e in found["not_run"]]
    return "\n".join(lines)


def plots(result: dict, out: str, tag: str) -> List[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    strategies = result["strategies"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    ax = axes[0]
    for k, s in enumerate(strategies):  # one colour per strategy; solid jaxdp, dashed torch_ref
        rs = [r for r in rows if r["strategy"] == s]
        for fw, style in (("jaxdp", "-o"), ("torch_ref", "--s")):
            pts = [(r["n"], r[fw]["images_per_s"]) for r in rs if (r.get(fw) or {}).get("images_per_s")]
            if pts:
                ax.plot(*zip(*pts), style, color=f"C{k % 10}", label=f"{s} {fw}")
    ax.set_xticks(sorted({r["n"] for r in rows}))
    ax.set_xlabel("devices / ranks N")
    ax.set_ylabel("images/s")
    ax.set_title("throughput")
    if ax.get_legend_handles_labels()[0]:  # no row timed: nothing to label
        ax.legend(fontsize=7)
    nmax = max((r["n"] for r in rows), default=1)
    last = [r for r in rows if r["n"] == nmax and (r.get("jaxdp") or {}).get("memory")]
    xs = np.arange(len(last))
    ax = axes[1]
    comp = [_mb(r["jaxdp"]["memory"]["total_bytes"]) for r in last]
    meas = [_mb(sum(v or 0 for k, v in ((r["jaxdp"].get("state") or {}).get("measured") or {}).items()
                    if k in ("params", "grads", "opt"))) for r in last]
    form = [_mb(sum(((r["jaxdp"].get("state") or {}).get("formula") or {}).values())) for r in last]
    ax.bar(xs - 0.27, comp, 0.27, label="compiled step (arg+out-alias+temp)")
    ax.bar(xs, meas, 0.27, label="model state measured")
    ax.bar(xs + 0.27, form, 0.27, label="model state formula")
    ax.set_xticks(xs, [r["strategy"] + label(r.get("options", {})) for r in last])
    ax.set_ylabel("MiB per device")
    ax.set_title(f"memory per device, N={nmax}")
    ax.legend(fontsize=7)
    ax = axes[2]
    meas = [_mb((r["jaxdp"].get("collectives") or {}).get("ring_bytes") or 0) for r in last]
    form = [_mb(r["jaxdp"].get("traffic_formula_bytes") or 0) for r in last]
    ax.bar(xs - 0.2, meas, 0.4, label="HLO measured (ring bytes)")
    ax.bar(xs + 0.2, form, 0.4, label="formula")
    ax.set_xticks(xs, [r["strategy"] + label(r.get("options", {})) for r in last])
    ax.set_ylabel("MiB sent per device per step")
    ax.set_title(f"collective traffic, N={nmax}")
    ax.legend(fontsize=7)
    c = result["config"]
    fig.suptitle(f"jaxdp vs torch_ref: {c['model']} w{c['width']} {c['dtype']} batch {c['global_batch']} "
                 f"({result['environment']['device_kind']}, load {result['environment']['loadavg'][0]:.1f})")
    fig.tight_layout()
    path = os.path.join(out, f"{tag}.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]
