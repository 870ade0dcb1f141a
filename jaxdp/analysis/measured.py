"""GPU step rates measured on real hardware (``gpu_measurements.json``), beside the estimate.

The figures are data, not constants: a new measurement is a new row of the JSON file. Each row
names the configuration it was measured in (target, devices, strategy, model, width, dtype,
batch per device) and its images per second over all devices; ``jaxdp inspect --target``
prints its estimate against the row of its own configuration, and
``benchmarks/estimate_vs_measured.py`` against every row.
"""

import json
from pathlib import Path
from typing import List, Optional

DATA = Path(__file__).with_name("gpu_measurements.json")
CONFIGURATION = ("target", "devices", "strategy", "model", "width", "dtype", "batch_per_device")


def measurements() -> List[dict]:
    """Every measured row, each with its ``step_s`` (the global batch over the measured images/s)."""
    rows = json.loads(DATA.read_text())["measurements"]
    return [dict(r, step_s=r["batch_per_device"] * r["devices"] / r["images_per_s"]) for r in rows]


def against_measurement(report: dict) -> Optional[dict]:
    """The estimate beside the measurement of ``report``'s configuration, if there is one."""
    if not report.get("estimated_step_s"):
        return None
    for m in measurements():
        if all(report.get(k) == m[k] for k in CONFIGURATION):
            return {"measured_step_s": m["step_s"], "estimate_over_measured": report["estimated_step_s"] / m["step_s"]}
    return None
