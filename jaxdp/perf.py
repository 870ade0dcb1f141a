"""How fast and how big a run is: model FLOPs utilisation, per-device memory, a profiler
trace of chosen steps, the persistent compilation cache, and the time to the first step.

MFU = the compiled step's FLOPs per device (XLA's ``cost_analysis``: the per-device
program, so it already counts recomputation and the collectives' arithmetic) / the step
time (the moving median of ``jaxdp.progress.Throughput``) / the device's peak FLOP/s.
The peak is ``--peak-flops`` if given; else, for ``--dtype bfloat16`` on a GPU named in
``PEAK_FLOPS``, its dense bf16 tensor-core peak from the vendor's data sheet; else MFU is
not reported ("n/a"): a CPU has no peak worth quoting, and a float32 step's peak depends
on whether XLA uses TF32.

Memory per device: the device's own peak bytes in use (``memory_stats()``, GPUs), else
the compiled step's footprint (``memory_analysis()``: arguments + outputs + temporaries -
donated buffers), which is what XLA:CPU reports.
"""

import os
from typing import Optional

# Dense (no sparsity) bf16 peak per device, FLOP/s, by a substring of jax's device_kind; the
# first match wins (so "H100 PCIe" before "H100", which is the SXM part).
PEAK_FLOPS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))


def peak_flops(device_kind: str, dtype: str, given: Optional[float]) -> Optional[float]:
    if given:
        return given
    if dtype != "bfloat16":
        return None
    return next((peak for name, peak in PEAK_FLOPS if name in device_kind), None)


class StepCost:
    """FLOPs and memory of one compiled training step, per device."""

    def __init__(self, compiled):
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # older jax: one dict per program
        self.flops = float((cost or {}).get("flops", 0.0)) or None
        mem = compiled.memory_analysis()
        self.compiled_bytes = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                               - mem.alias_size_in_bytes) if mem is not None else None


def device_peak_bytes(device) -> Optional[int]:
    """The device's peak bytes in use so far, where the backend tracks it (GPUs; not CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return (stats or {}).get("peak_bytes_in_use")


class Utilisation:
    """The MFU and memory fields of each train record."""

    def __init__(self, cost: Optional[StepCost], device, peak: Optional[float], images_per_step: int):
        self.cost, self.device, self.peak, self.images_per_step = cost, device, peak, images_per_step

    def fields(self, images_per_sec: Optional[float]) -> dict:
        memory = device_peak_bytes(self.device)
        if memory is None and self.cost is not None:
            memory = self.cost.compiled_bytes
        mfu = None
        if self.peak and images_per_sec and self.cost is not None and self.cost.flops:
            step_seconds = self.images_per_step / images_per_sec
            mfu = self.cost.flops / step_seconds / self.peak
        return {"mfu": mfu, "memory_mb": None if memory is None else memory / 2**20}

    def describe(self) -> str:
        flops = f"{self.cost.flops / 1e9:.3g} GFLOP" if self.cost and self.cost.flops else "? FLOP"
        peak = f"peak {self.peak / 1e12:.4g} TFLOP/s" if self.peak else "MFU n/a (pass --peak-flops FLOP/s per device)"
        return f"compiled step: {flops} per device; {peak}"


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
