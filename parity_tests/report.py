"""What a parity run shows: a terminal table per step, ``report.json`` and ``parity.png``.

The table has one row per step: the loss on each side, the largest absolute and
relative error over every compared tensor, the tensor closest to (or furthest over)
its bound, and OK/FAIL. Below it, the first divergence (step, tensor, error, bound),
which is what points at the bug when porting a strategy.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import platform
import sys
from typing import List, Optional

from parity_tests import parity_mode


def environment(cuda: bool = False, plan=None) -> dict:
    """Versions and devices, so a report says where its numbers came from; with ``plan``,
    also both sides' devices, the torch backend and TF32 (``devices``)."""
    env = {"python": platform.python_version(), "machine": platform.machine()}
    try:
        import jax

        env.update(jax=jax.__version__, jax_backend=jax.default_backend(),
                   jax_devices=len(jax.devices()))
    except Exception:  # pragma: no cover
        pass
    try:
        import torch

        env.update(torch=torch.__version__, torch_device="cuda" if cuda else "cpu")
    except Exception:  # pragma: no cover
        pass
    if plan is not None:
        env.update(devices(plan))
    return env


def devices(plan) -> dict:
    """What each side ran on: jaxdp's platform, device kind and matmul precision; torch's
    backend and every rank's device and TF32 flags (``torch_ref.launcher.rank_info``,
    recorded by the ranks themselves); and one verdict per side on TF32."""
    from parity_tests.torch_side import torch_ranks

    out: dict = {"torch_backend": plan.backend}
    try:
        import jax

        backend, prec = jax.default_backend(), jax.config.jax_default_matmul_precision
        out.update(jax_platform=backend, jax_device_kind=jax.devices()[0].device_kind,
                   jax_matmul_precision=prec)
        jax_tf32 = ("off (CPU: no TF32)" if backend == "cpu" else
                    "off (jax_default_matmul_precision=highest)" if str(prec) in ("highest", "float32") else
                    f"ON (jax_default_matmul_precision={prec})")
    except Exception:  # pragma: no cover
        jax_tf32 = "unknown"
    ranks = torch_ranks(plan) or []
    out["torch_ranks"] = [{k: r.get(k) for k in ("rank", "device", "device_name", "backend",
                                                 "matmul_allow_tf32", "cudnn_allow_tf32", "tf32_off",
                                                 "cudnn_deterministic", "cudnn_benchmark", "cudnn_enabled")}
                          | {"LOCAL_RANK": r.get("env", {}).get("LOCAL_RANK"),
                             "NVIDIA_TF32_OVERRIDE": r.get("env", {}).get("NVIDIA_TF32_OVERRIDE")}
                          for r in ranks]
    if not ranks:
        torch_tf32 = "unknown (no torch rank reported)"
    elif not all(r.get("tf32_off") for r in ranks):
        torch_tf32 = "ON in rank(s) " + ", ".join(str(r["rank"]) for r in ranks if not r.get("tf32_off"))
    elif all(str(r.get("device", "cpu")).startswith("cpu") for r in ranks):
        torch_tf32 = "off (CPU: no TF32)"
    else:
        torch_tf32 = "off (allow_tf32=False for matmul and cuDNN, NVIDIA_TF32_OVERRIDE=0, in every rank)"
    out["parity_mode"] = parity_mode.summary()  # the XLA flags and variables (parity_tests.parity_mode)
    verdicts = (jax_tf32, torch_tf32)
    out["tf32"] = {"jaxdp": jax_tf32, "torch": torch_tf32,  # True, False, or None: not known
                   "off_on_both_sides": (True if all(v.startswith("off") for v in verdicts) else
                                         False if any(v.startswith("ON") for v in verdicts) else None)}
    return out


def devices_line(plan) -> str:
    """One line: both sides' devices, the torch backend, TF32."""
    d = devices(plan)
    ranks = d["torch_ranks"]
    where = ", ".join(f"{r['device']}" for r in ranks) or "?"
    names = sorted({r["device_name"] for r in ranks if r.get("device_name")})
    return (f"  devices: jaxdp {plan.cfg.devices} x {d.get('jax_device_kind', '?')} ({d.get('jax_platform', '?')}); "
            f"torch_ref {plan.backend}, rank r on [{where}]{' (' + ', '.join(names) + ')' if names else ''}; "
            f"TF32 {({True: 'off on both sides', False: 'NOT off'}).get(d['tf32']['off_on_both_sides'], 'not verified')} "
            f"(jaxdp: {d['tf32']['jaxdp']}; torch: {d['tf32']['torch']})")


def header(result) -> List[str]:
    p = result.plan
    cfg = p.cfg
    j = p.to_json()
    lines = [
        f"parity: jaxdp {cfg.strategy} {j['jaxdp']['options'] or ''} on {cfg.devices} device(s)"
        f"  <->  torch_ref {p.torch_strategy} on {p.world} rank(s) ({j['torch']['backend']})",
        f"  twin: {p.pair.twin}",
        f"  {cfg.run_summary()}, jax x64 {({True: 'on', False: 'off'}).get(p.jax_x64, '?')}",
        f"  bounds: {result.comparison.bounds.name} (rel err = max|jax - torch| / max|torch| per tensor)",
        devices_line(p),
    ]
    for note in p.notes:
        lines.append(f"  note: {note}")
    return lines


def status(step) -> str:
    bad = step.first_failure()
    if bad is None:
        return "OK"
    return f"FAIL {bad.key} ({bad.rel_err:.1e} > {bad.bound:.0e}; {len(step.failures())} over)"


def table(result) -> List[str]:
    rows = [f"{'step':>4}  {'loss jaxdp':>18}  {'loss torch':>18}  {'max abs':>8}  {'max rel':>8}  "
            f"{'worst tensor (rel err / bound)':<66}  ok"]
    for s in result.comparison.steps:
        w = s.worst()
        bound = f"{w.bound:.0e}" if w and w.bound != float("inf") else "none"
        worst = f"{w.key} ({w.rel_err:.1e} / {bound})" if w else "-"
        rows.append(f"{s.step:>4}  {s.loss_jax:>18.12f}  {s.loss_torch:>18.12f}  {s.max_abs():>8.1e}  "
                    f"{s.max_rel():>8.1e}  {worst:<66}  {status(s)}")
    c = result.comparison
    if c.curve is not None:
        rows.append(f"loss curves: {c.curve.key}: rel diff {c.curve.rel_err:.1e} "
                    f"(bound {c.curve.bound:.0e}) {'OK' if c.curve.ok else 'FAIL'}")
    return rows


def print_report(result, file=None) -> None:
    import sys

    out = file or sys.stdout
    for line in header(result) + table(result):
        print(line, file=out)
    secs = result.seconds
    print(f"time: inputs {secs.get('inputs', 0):.1f}s, torch {secs.get('torch', 0):.1f}s, "
          f"jaxdp {secs.get('jax', 0):.1f}s", file=out)
    print(("PASS: " if result.ok else "FAIL: ") + result.message(), file=out)
    if not result.passed and result.plan.cfg.dtype == "float32":
        print("hint: float32 rounding is amplified by BatchNorm and by training; re-run with "
              "--dtype float64, where the noise is ~1e-14 and anything above 1e-10 is a real "
              "difference", file=out)


def write_json(result, path: str) -> str:
    with open(path, "w") as f:
        json.dump(result.to_json(), f, indent=1)
    return path


def plot(result, path: str) -> str:
    """Loss curves of both sides overlaid; max relative error per step (log) per category."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from parity_tests.compare import CATEGORIES

    c = result.comparison
    cfg = result.plan.cfg
    steps = [s.step for s in c.steps]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.8))
    ax1.plot(steps, [s.loss_torch for s in c.steps], "o-", color="tab:orange", lw=2.5, ms=5,
             label=f"torch_ref {result.plan.torch_strategy} ({result.plan.world} rank(s))")
    ax1.plot(steps, [s.loss_jax for s in c.steps], "x--", color="tab:blue", lw=1.2, ms=6,
             label=f"jaxdp {cfg.strategy} ({cfg.devices} device(s))")
    ax1.set_xlabel("step")
    ax1.set_ylabel("training loss")
    ax1.set_title("loss, both sides")
    ax1.legend()
    ax1.grid(alpha=0.3)
    nonzero = [e.rel_err for st in c.steps for e in st.entries if 0 < e.rel_err < math.inf]
    tiny = 10 ** math.floor(math.log10(min(nonzero) / 10)) if nonzero else 1e-17
    for cat in CATEGORIES:
        vals = [s.max_rel(cat) for s in c.steps if any(e.category == cat for e in s.entries)]
        if len(vals) == len(steps):
            ax2.semilogy(steps, [max(v, tiny) for v in vals], "o-", ms=3, label=cat)
    bounds = c.bounds
    for cat, style in (("grads", ":"), ("loss", "--")):
        pts = [(s, bounds.bound(cat, s)) for s in steps if math.isfinite(bounds.bound(cat, s))]
        if pts and (cat == "grads" or any(b != bounds.bound("grads", s) for s, b in pts)):
            xs = [p[0] for p in pts] + [pts[-1][0] + 1]
            ax2.step(xs, [p[1] for p in pts] + [pts[-1][1]], where="post", ls=style, color="k",
                     lw=1, label=f"{bounds.name} bound ({cat})")
    ax2.set_xlabel("step")
    ax2.set_ylabel("max relative error (max|a-b| / max|b|)")
    status = "PASS" if result.ok else "FAIL: " + result.message().split(" (")[0]
    ax2.set_title(f"max relative error per step ({cfg.dtype}; exact 0 drawn at {tiny:.0e})", fontsize=10)
    ax2.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4, frameon=False)
    ax2.grid(alpha=0.3, which="both")
    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlim(-0.5, steps[-1] + 0.5 if steps else 0.5)
    fig.suptitle(f"parity: jaxdp {cfg.strategy} vs torch_ref {result.plan.torch_strategy}, "
                 f"{cfg.model_summary()}, N={cfg.devices}, {cfg.optimizer}: {status}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(result, out_dir: str, extra_png: Optional[str] = None) -> List[str]:
    """report.json, and the plot where matplotlib is installed (without it: a note, no plot)."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [write_json(result, os.path.join(out_dir, "report.json"))]
    if importlib.util.find_spec("matplotlib") is None:
        print("jaxdp parity: no plot: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return paths
    paths.append(plot(result, os.path.join(out_dir, "parity.png")))
    if extra_png:
        os.makedirs(os.path.dirname(os.path.abspath(extra_png)), exist_ok=True)
        paths.append(plot(result, extra_png))
    return paths
