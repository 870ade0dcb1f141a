"""How fast and how big a run is: model FLOPs utilisation, per-device memory, a profiler
trace of chosen steps, the persistent compilation cache, and the time to the first step.

MFU = images/s (the moving median of ``jaxdp.run.progress.Throughput``) x the model's FLOPs per
trained image (``jaxdp.run.flops``: the forward's convolutions and matmuls, x 3) / (devices x the
device's peak FLOP/s); ``jaxdp bench`` computes its MFU with the same ``jaxdp.run.flops.mfu``.
Not the compiled step's ``cost_analysis()``: on a GPU it counts the cuDNN/cuBLAS custom calls
that do the work as 0 FLOPs.

The peak is ``--peak-flops`` if given; else, for ``--dtype bfloat16`` on a GPU named in
``PEAK_FLOPS``, its dense bf16 tensor-core peak from the vendor's data sheet; else MFU is
not reported ("n/a"): a CPU has no peak worth quoting, and a float32 step's peak depends
on whether XLA uses TF32.

Memory per device: the device's own peak bytes in use (``memory_stats()``, GPUs), else
the compiled step's footprint (``memory_analysis()``: arguments + outputs + temporaries -
donated buffers), which is what XLA:CPU reports.

Jax-free at import (jax in the functions that use it): bench's parser reads ``PEAK_FLOPS``, and
gpu-check imports ``enable_compile_cache`` before it asks whether jax has started.
"""

import os
from typing import Optional

# The one table of device peaks (train and bench): dense (no sparsity) bf16 tensor-core
# FLOP/s per device, by a substring of jax's or torch's device name, case-insensitive; the
# first match wins (so "H100 PCIe" before "H100", the SXM part; "L40S" before "L4"; "GH200"
# matches "H200").
PEAK_FLOPS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12),
              ("L40S", 362e12), ("L4", 121e12), ("A10G", 70e12))


def peak_flops(device_kind: str, dtype: str, given: Optional[float] = None) -> Optional[float]:
    if given:
        return given
    if dtype != "bfloat16":
        return None
    return next((peak for name, peak in PEAK_FLOPS if name.lower() in device_kind.lower()), None)


class StepCost:
    """The memory of one compiled training step, per device."""

    def __init__(self, compiled):
        mem = compiled.memory_analysis()
        self.compiled_bytes = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                               - mem.alias_size_in_bytes) if mem is not None else None


def device_peak_bytes(device) -> Optional[int]:
    """The device's peak bytes in use so far, where the backend tracks it (GPUs; not CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return (stats or {}).get("peak_bytes_in_use")


class Utilisation:
    """The MFU and memory fields of each train record."""

    def __init__(self, cost: Optional[StepCost], device, peak: Optional[float], devices: int,
                 flops_per_image: Optional[float]):
        self.cost, self.device, self.peak = cost, device, peak
        self.devices, self.flops_per_image = devices, flops_per_image

    def fields(self, images_per_sec: Optional[float]) -> dict:
        from jaxdp.run.flops import mfu

        memory = device_peak_bytes(self.device)
        if memory is None and self.cost is not None:
            memory = self.cost.compiled_bytes
        return {"mfu": mfu(images_per_sec, self.flops_per_image, self.devices, self.peak),
                "memory_mb": None if memory is None else memory / 2**20}

    def describe(self) -> str:
        if not self.peak:
            return "MFU n/a (pass --peak-flops FLOP/s per device)"
        flops = f"{self.flops_per_image / 1e9:.3g} GFLOP" if self.flops_per_image else "? FLOP"
        return f"model: {flops} per trained image; peak {self.peak / 1e12:.4g} TFLOP/s per device"


class ProfileWindow:
    """``--profile-steps A:B``: a ``jax.profiler`` trace of global steps A..B-1 (1-based, as
    in metrics.jsonl) in ``logdir``; TensorBoard's profile tab opens it."""

    def __init__(self, steps, logdir: str, enabled: bool = True):
        self.start, self.stop = steps if steps else (None, None)
        self.logdir, self.enabled, self.active = logdir, enabled and steps is not None, False

    def before_step(self, step: int) -> None:
        """``step``: the number the step about to run will have."""
        if self.enabled and not self.active and self.start <= step < self.stop:
            import jax

            jax.profiler.start_trace(self.logdir)
            self.active = True

    def after_step(self, step: int, outputs) -> None:
        if self.active and step >= self.stop - 1:
            import jax

            jax.block_until_ready(outputs)  # whole steps in the trace, not their dispatch only
            self.close()

    def close(self) -> None:
        if self.active:
            import jax

            jax.profiler.stop_trace()
            self.active = False


def compile_cache_dir(process_count: int) -> str:
    """``$JAXDP_CACHE_DIR``, else ``$XDG_CACHE_HOME/jaxdp`` (``~/.cache/jaxdp``), per job size:
    one directory is never shared by single- and multi-process programs (a 2-process job
    once hung on a cache that mixed both)."""
    root = os.environ.get("JAXDP_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxdp")
    return os.path.join(root, "jax-compile", f"{process_count}-process")


def enable_compile_cache(enabled: bool) -> Optional[str]:
    """JAX's persistent compilation cache, on by default: a rerun or a resume loads its
    programs instead of compiling them (JAX caches only those that took over a second to
    compile). A directory the user set (``JAX_COMPILATION_CACHE_DIR``) is kept. Returns the
    directory in use, or None."""
    import jax

    if not enabled:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_enable_compilation_cache", True)
    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", compile_cache_dir(jax.process_count()))
    return jax.config.jax_compilation_cache_dir
