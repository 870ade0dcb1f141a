"""An *estimated* step time for a program compiled for a GPU target: a roofline, not a measurement.

It reads the compiled schedule (``schedule.py``) and plays it on two streams, with the target's
published figures (``jaxdp.runtime.target.GPUS``):

- **compute**: the kernels in schedule order, one after another. Each takes its roofline time,
  max(its FLOPs / the peak of its dtype, the bytes it reads and writes / HBM bandwidth): FLOPs of
  its convolutions and matrix products from their HLO shapes (``kernel_flops``), bytes as XLA's
  cost analysis counts them (``schedule.kernel_bytes``);
- **communication**: the collectives, one after another on a stream of their own, each its ring
  bytes per device (``schedule.collective_list``) over NVLink, or over the network when its
  groups span hosts. An asynchronous collective starts when the compute stream reaches its
  start and the stream is free; the compute stream waits at its done until it has finished. So
  a collective hides behind the kernels inside its own start..done window and no others, and
  only when the collectives before it have left the stream in time. A synchronous one (no
  start/done pair, or XLA's ``is_sync``) stalls the compute stream for its whole time.

Each collective's ``exposed_s`` is how long the compute stream waits for it (at its done, or at a
synchronous one), ``exposed_communication_s`` their sum, and ``estimated_step_s`` = the kernels'
time + the exposed communication: the time the compute stream takes. A ``while`` in the schedule
runs its body's own two-stream play once per trip; a ``conditional`` its dearer branch.

It knows nothing of kernel efficiency, launch gaps, caches, the input pipeline or NCCL's real
bandwidth, nor of compute slowed by a collective running beside it: treat it as a lower bound's
order of magnitude, and read it beside a measurement where there is one (``measured.py``).
``compute_s`` and ``memory_s`` are the whole step's bounds (its jaxpr's FLOPs over the peak, its
kernels' bytes over the bandwidth), for comparison.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional

from jaxdp.analysis.flops import jaxpr_flops
from jaxdp.analysis.hlo_text import Module, branches, callees, read_module, trip_count
from jaxdp.analysis.kernel_flops import instruction_flops
from jaxdp.analysis.schedule import COLLECTIVES, bytes_accessed, kernel_bytes, op_kind

COMPUTE_LANE, COLLECTIVE_LANE = "compute", "collectives"


def peak_flops(gpu, dtype: str) -> float:
    """The target's dense peak for ``dtype`` (float32 matmuls: TF32 tensor cores, XLA's default precision)."""
    key = {"float32": "tf32"}.get(dtype, dtype)
    return gpu.peak_flops.get(key, gpu.peak_flops["float32"])


def link_bandwidth(gpu, across_hosts: bool) -> float:
    return gpu.network_bandwidth if across_hosts else gpu.nvlink_bandwidth


@dataclass(frozen=True)
class Interval:
    """One thing on a stream of the estimated step: a kernel on the compute lane, or a collective's
    start..done window on the collective lane (``busy_from``: when the stream takes it up)."""

    lane: str  # COMPUTE_LANE or COLLECTIVE_LANE
    name: str  # the HLO instruction (a collective: its start)
    kind: str  # "matmul", "kernel", "loop" (a while or conditional) or the collective's kind
    start: float  # seconds from the step's start: a kernel's launch, a collective's start instruction
    end: float  # a kernel's end; a collective's done (when the compute stream is past it)
    busy_from: Optional[float] = None  # a collective: when its transfer begins (the stream was free)
    busy_to: Optional[float] = None  # a collective: when its transfer ends
    exposed: float = 0.0  # a collective: how long the compute stream waited for it


class _Play:
    """The two streams of one computation, played once (``Timeline`` holds the entry's)."""

    def __init__(self, module: Module, collectives: Dict[str, dict], gpu):
        self.module, self.collectives, self.gpu = module, collectives, gpu

    def run(self, computation: str, draw: bool):
        """(duration, the kernels' own seconds, exposed seconds by collective name, the intervals when
        ``draw``). The duration is the kernels' seconds plus the exposed ones."""
        t = free = busy = 0.0  # the compute stream's clock, and when the collective stream is free
        exposed: Dict[str, float] = {}
        in_flight: Dict[str, Interval] = {}  # started, not yet done: by start name
        drawn: List[Interval] = []
        for i in self.module.instructions(computation):
            kind = op_kind(i, self.module)
            if not kind:
                continue
            what, stage = kind
            if what in COLLECTIVES or what == "async":
                if stage == "done":
                    start = in_flight.pop(i.operands[0], None) if i.operands else None
                    if start is not None:
                        wait = max(0.0, start.busy_to - t)
                        t += wait
                        exposed[start.name] = exposed.get(start.name, 0.0) + wait
                        drawn.append(Interval(COLLECTIVE_LANE, start.name, start.kind, start.start, t,
                                              start.busy_from, start.busy_to, wait))
                    continue
                name = self._collective_of(i)
                begin = max(t, free)
                free = begin + self._transfer(name)
                if stage == "start" and '"is_sync":true' not in i.line:
                    in_flight[i.name] = Interval(COLLECTIVE_LANE, name, what, t, t, begin, free)
                    continue
                wait = free - t  # synchronous: the compute stream waits for the stream and the transfer
                exposed[name] = exposed.get(name, 0.0) + wait
                drawn.append(Interval(COLLECTIVE_LANE, name, what, t, free, begin, free, wait))
                t = free
                continue
            seconds, own, inner = self._kernel(computation, i)
            busy += own
            for name, e in inner.items():
                exposed[name] = exposed.get(name, 0.0) + e
            drawn.append(Interval(COMPUTE_LANE, i.name, "loop" if inner or i.opcode in _LOOPS else what,
                                  t, t + seconds))
            t += seconds
        for start in in_flight.values():  # a start whose done is not in this computation: waited for at its end
            wait = max(0.0, start.busy_to - t)
            t += wait
            exposed[start.name] = exposed.get(start.name, 0.0) + wait
            drawn.append(Interval(COLLECTIVE_LANE, start.name, start.kind, start.start, t, start.busy_from,
                                  start.busy_to, wait))
        return t, busy, exposed, (drawn if draw else None)

    def _collective_of(self, i) -> str:
        """The name ``collective_list`` knows instruction ``i`` by: its own, or for an ``async-start``
        wrapping one (XLA:GPU's form for some), the collective inside the computation it calls."""
        if i.name in self.collectives or i.opcode != "async-start":
            return i.name
        called = next((c for key, c in callees(i.line) if key == "calls"), None)
        return next((inner.name for inner in self.module.instructions(called) if inner.name in self.collectives),
                    i.name)

    def _transfer(self, name: str) -> float:
        c = self.collectives.get(name)
        return 0.0 if c is None else c["ring_bytes"] / link_bandwidth(self.gpu, c["across_hosts"])

    def _kernel(self, computation: str, i):
        """(seconds, its kernels' own seconds, exposed seconds by collective inside it) of one compute
        instruction: its roofline, or a while's body played ``trip`` times, or a conditional's dearer
        branch played once."""
        if i.opcode in _LOOPS:
            if i.opcode == "while":
                body = next((c for key, c in callees(i.line) if key == "body"), None)
                plays = [(body, trip_count(i.line) or 1)] if body else []
            elif i.opcode == "conditional":
                plays = [(b, 1) for b in branches(i.line)]
            else:
                plays = [(c, 1) for key, c in callees(i.line) if key in ("calls", "to_apply")]
            played = [(self.run(c, False), n) for c, n in plays if c in self.module.computations]
            if played:
                (seconds, own, exposed, _), n = max(played, key=lambda p: p[0][0] * p[1])
                return seconds * n, own * n, {name: e * n for name, e in exposed.items()}
        flops, dtype = instruction_flops(self.module, computation, i)
        moved = kernel_bytes(i, self.module.result_bytes(computation))
        seconds = max(flops / peak_flops(self.gpu, dtype or "float32") if flops else 0.0,
                      moved / self.gpu.memory_bandwidth)
        return seconds, seconds, {}


_LOOPS = ("while", "conditional", "call")


@dataclass(frozen=True)
class Timeline:
    """The entry computation's two streams: what ``jaxdp inspect --plot`` draws."""

    step_s: float
    kernels_s: float
    exposed: Dict[str, float]  # by collective (its start's or its own instruction name)
    intervals: List[Interval]


def timeline(hlo: str, gpu, collectives: List[dict]) -> Timeline:
    """The estimated step of compiled module ``hlo`` on ``gpu`` (``collectives``: ``collective_list``'s)."""
    module = read_module(hlo)
    step, kernels, exposed, drawn = _Play(module, {c["name"]: c for c in collectives}, gpu).run(module.entry, True)
    return Timeline(step, kernels, exposed, drawn)


def estimate(gpu, dtype: str, flops: float, hlo: str, collectives: List[dict]) -> dict:
    """The estimate and its parts, in seconds; each of ``collectives`` (``schedule.collective_list``'s,
    for ``hlo``) gets its ``exposed_s``. ``flops``: the step's (its jaxpr's), ``dtype`` its compute dtype."""
    played = timeline(hlo, gpu, collectives)
    for c in collectives:
        c["exposed_s"] = played.exposed.get(c["name"], 0.0)
    communication = sum(c["runs"] * c["ring_bytes"] / link_bandwidth(gpu, c["across_hosts"]) for c in collectives)
    moved = bytes_accessed(hlo)
    return {"estimated_step_s": played.step_s, "kernels_s": played.kernels_s,
            "compute_s": flops / peak_flops(gpu, dtype), "memory_s": moved / gpu.memory_bandwidth,
            "communication_s": communication, "exposed_communication_s": sum(c["exposed_s"] for c in collectives),
            "flops": flops, "bytes_accessed": moved}


def step_flops(step_jaxpr) -> float:
    """FLOPs of the step's jaxpr, per device (backward and recomputation included)."""
    return jaxpr_flops(step_jaxpr)
