"""The estimated step as a picture (``jaxdp inspect --target ... --plot schedule.png``).

A time axis in milliseconds, from the estimate's play of the schedule (``estimate.timeline``),
four lanes from the top:

- **windows**: each collective from its start to its done, coloured by kind (stacked where
  windows overlap): what XLA's schedule put in flight together;
- **collective stream**: when each one moves its bytes (one after another);
- **compute**: the kernels, matmuls (convolutions, GEMMs) darker than the rest;
- **exposed**: where the compute stream waits for a collective (red, at its done).

``lanes`` computes the bars (data a test asserts on); ``draw_schedule`` only draws them, with
matplotlib, imported when it draws: it is in jaxdp's [torch] extra, not a dependency.
"""

from dataclasses import dataclass
from typing import Dict, List

from jaxdp.analysis.estimate import COLLECTIVE_LANE, COMPUTE_LANE, Timeline

WINDOWS, STREAM, COMPUTE, EXPOSED = "windows", "collective stream", "compute", "exposed"
LANES = (EXPOSED, COMPUTE, STREAM, WINDOWS)  # bottom to top
BASE = {EXPOSED: 0, COMPUTE: 1.2, STREAM: 2.4, WINDOWS: 3.6}  # where each lane starts on the y axis
COLOURS = {"all-gather": "tab:blue", "reduce-scatter": "tab:orange", "all-reduce": "tab:green",
           "collective-permute": "tab:purple", "all-to-all": "tab:brown", "async": "tab:gray",
           "matmul": "#3b3b3b", "kernel": "#b0b0b0", "loop": "#707070", "exposed": "tab:red"}


class PlotError(ValueError):
    """The plot cannot be drawn here (one line: what to install)."""


@dataclass(frozen=True)
class Bar:
    lane: str  # one of LANES
    row: int  # within the lane (windows that overlap stack)
    start: float  # seconds
    end: float
    kind: str  # a collective's kind, "matmul", "kernel", "loop" or "exposed"
    name: str  # the HLO instruction


def lanes(played: Timeline) -> List[Bar]:
    """Every bar of the picture, in seconds from the step's start."""
    bars, rows_end = [], []  # rows_end: where each row of the windows lane is free again
    for x in played.intervals:
        if x.lane == COMPUTE_LANE:
            bars.append(Bar(COMPUTE, 0, x.start, x.end, x.kind, x.name))
            continue
        if x.lane != COLLECTIVE_LANE:
            continue
        row = next((i for i, free in enumerate(rows_end) if free <= x.start), None)
        if row is None:
            row = len(rows_end)
            rows_end.append(x.end)
        rows_end[row] = x.end
        bars.append(Bar(WINDOWS, row, x.start, x.end, x.kind, x.name))
        bars.append(Bar(STREAM, 0, x.busy_from, x.busy_to, x.kind, x.name))
        if x.exposed > 0:
            bars.append(Bar(EXPOSED, 0, x.end - x.exposed, x.end, "exposed", x.name))
    return bars


def describe(report: dict) -> str:
    """The picture's title from an inspect report."""
    hosts = f"{report['hosts']} hosts x " if report.get("hosts", 1) > 1 else ""
    per_host = report["devices"] // report.get("hosts", 1)
    return (f"{report['strategy']} on {hosts}{per_host} {report['target'].upper()}: estimated step "
            f"{report['estimated_step_s'] * 1e3:.3f} ms = kernels {report['kernels_s'] * 1e3:.3f} + exposed "
            f"communication {report['exposed_communication_s'] * 1e3:.3f} ms")


def require_matplotlib() -> None:
    """PlotError, in one line, where matplotlib is missing: checked before a compile that would be wasted."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotError("--plot draws with matplotlib, which is not installed: pip install matplotlib "
                        "(jaxdp's [torch] extra has it)") from None


def draw_schedule(played: Timeline, path: str, title: str = "") -> None:
    """Draw ``lanes(played)`` to ``path`` (a PNG)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    bars = lanes(played)
    window_rows = max((b.row for b in bars if b.lane == WINDOWS), default=0) + 1
    base = BASE
    fig, ax = plt.subplots(figsize=(14, 2.2 + 0.25 * window_rows))
    by_style: Dict[tuple, list] = {}
    for b in bars:
        by_style.setdefault((b.lane, b.row, b.kind), []).append((b.start * 1e3, (b.end - b.start) * 1e3))
    for (lane, row, kind), spans in by_style.items():
        height = 0.8 if lane == WINDOWS else 0.9
        ax.broken_barh(spans, (base[lane] + row + (1 - height) / 2, height), facecolors=COLOURS.get(kind, "tab:gray"),
                       edgecolor="white" if lane == COMPUTE else "none", linewidth=0.2,
                       alpha=0.55 if lane == WINDOWS else 1.0)
    ax.set_yticks([base[lane] + (window_rows if lane == WINDOWS else 1) / 2 for lane in LANES])
    ax.set_yticklabels(["exposed\n(compute waits)", "compute", "collective\nstream", "collective\nwindows"])
    ax.set_ylim(0, base[WINDOWS] + window_rows)
    ax.set_xlim(0, played.step_s * 1e3)
    ax.set_xlabel("ms (estimated: each kernel's roofline; each collective hidden only by the kernels in its window)")
    kinds = sorted({b.kind for b in bars})
    ax.legend(handles=[Patch(color=COLOURS.get(k, "tab:gray"), label=k) for k in kinds], loc="upper center",
              bbox_to_anchor=(0.5, -0.32), ncol=len(kinds), fontsize=8, frameon=False)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)

