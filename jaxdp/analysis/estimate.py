"""An *estimated* step time for a program compiled for a GPU target: a roofline, not a measurement.

From XLA's cost analysis and the target's published figures (``jaxdp.runtime.target.GPUS``):

- **compute**: the step's FLOPs (its jaxpr's convolutions and matrix products, backward and
  recomputation included: ``jaxdp.analysis.flops``) over the peak of the compute dtype. XLA's own
  cost analysis has nothing to say here: it counts cuDNN/cuBLAS custom calls as 0 FLOPs, and for a
  compile-only GPU ``cost_analysis()`` returns None, before and after XLA's passes;
- **memory**: the bytes the compiled program's kernels read and write (``schedule.bytes_accessed``,
  as XLA's cost analysis would count them) over the HBM bandwidth;
- **communication**: each collective's ring bytes per device (``schedule.collective_list``) over
  NVLink, or over the network when its groups span hosts. A collective that overlaps compute
  (asynchronous, kernels between its halves) is hidden, as far as the compute lasts: the
  collectives run one after another on their stream; the others add their time.

``estimated_step_s = max(compute, memory, overlapped communication) + exposed communication``. It knows nothing of kernel
efficiency, launch gaps, the input pipeline or NCCL's real bandwidth: treat it as a lower bound's
order of magnitude, and compare it with a measurement where there is one.
"""

from typing import List, Optional

from jaxdp.analysis.flops import jaxpr_flops
from jaxdp.analysis.schedule import bytes_accessed

# The one GPU measurement there is (DESIGN.md section 10): one H200, jaxdp's ddp step, ResNet-18
# width 64 on 32x32 images, bfloat16, batch 512: 7.6 ms (67.3k images/s).
H200_MEASURED = {"target": "h200", "devices": 1, "strategy": "ddp", "model": "resnet18", "width": 64,
                 "dtype": "bfloat16", "batch_per_device": 512, "step_s": 512 / 67.3e3}


def peak_flops(gpu, dtype: str) -> float:
    """The target's dense peak for ``dtype`` (float32 matmuls: TF32 tensor cores, XLA's default precision)."""
    key = {"float32": "tf32"}.get(dtype, dtype)
    return gpu.peak_flops.get(key, gpu.peak_flops["float32"])


def link_bandwidth(gpu, across_hosts: bool) -> float:
    return gpu.network_bandwidth if across_hosts else gpu.nvlink_bandwidth


def estimate(gpu, dtype: str, flops: float, bytes_accessed: float, collectives: List[dict]) -> dict:
    """The estimate and its parts, in seconds (``collectives``: ``schedule.collective_list``'s)."""
    compute = flops / peak_flops(gpu, dtype)
    memory = bytes_accessed / gpu.memory_bandwidth
    times = [(c, c["runs"] * c["ring_bytes"] / link_bandwidth(gpu, c["across_hosts"])) for c in collectives]
    exposed = sum(t for c, t in times if not (c["async"] and c["compute_between"]))
    hidden = sum(t for _, t in times) - exposed
    # The collectives run one after another on their stream: compute hides them only up to its own time.
    return {"estimated_step_s": max(compute, memory, hidden) + exposed, "compute_s": compute, "memory_s": memory,
            "communication_s": sum(t for _, t in times), "exposed_communication_s": exposed,
            "flops": flops, "bytes_accessed": bytes_accessed}


def program_costs(step_jaxpr, compiled_text: str) -> tuple:
    """(FLOPs of the step's jaxpr, bytes accessed by its compiled program), per device."""
    return jaxpr_flops(step_jaxpr), bytes_accessed(compiled_text)


def against_measurement(report: dict) -> Optional[dict]:
    """The estimate beside the H200 measurement, when ``report`` is the measured configuration."""
    m = H200_MEASURED
    same = all(report.get(k) == m[k] for k in ("strategy", "model", "width", "dtype", "batch_per_device")) and \
        report.get("target") == m["target"] and report.get("devices") == m["devices"]
    if not same or not report.get("estimated_step_s"):
        return None
    return {"measured_step_s": m["step_s"], "estimate_over_measured": report["estimated_step_s"] / m["step_s"]}
