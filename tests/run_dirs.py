"""A run directory read back, to compare a run that was killed and resumed with one that was not:
its final checkpoint, its metrics rows, its sample ids and its TensorBoard scalars as TensorBoard
shows them. Used by test_kill_points.py and the kill campaign (kill_campaign.py)."""

import glob
import json
import os
import struct

import jax
import numpy as np
import orbax.checkpoint as ocp

from launch_helpers import sample_records

TIMING = ("images_per_sec", "time_to_first_step_s", "mfu", "memory_mb")  # measured: differ run to run


def final_state(out):
    """The last checkpoint's canonical state, as numpy, whatever topology wrote it."""
    root = os.path.abspath(os.path.join(out, "checkpoints"))
    path = os.path.join(root, str(max(int(x) for x in os.listdir(root) if x.isdigit())), "state")
    checkpointer = ocp.StandardCheckpointer()
    meta = checkpointer.metadata(path)
    wide = [m.dtype for m in jax.tree_util.tree_leaves(meta.item_metadata.tree) if np.dtype(m.dtype).itemsize == 8]
    if wide and not jax.config.jax_enable_x64:  # else read as 32 bits: a difference could vanish
        raise RuntimeError(f"{path} holds {wide[0]} arrays: turn jax_enable_x64 on to read them")
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    like = jax.tree_util.tree_map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                                  meta.item_metadata.tree)
    return jax.tree_util.tree_map(np.asarray, checkpointer.restore(path, like))


def metrics_rows(out) -> list:
    """metrics.jsonl's rows, in order, without their timings."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in f]


def sample_steps(out):
    """({step: (epoch, step in epoch, {rank: its ids})} from every process's sample-id file, and
    the (file, step) pairs a file holds more than once)."""
    steps, seen, repeated = {}, set(), []
    for r in sample_records(out):
        if (r["file"], r["step"]) in seen:
            repeated.append((r["file"], r["step"]))
        seen.add((r["file"], r["step"]))
        _, _, ids = steps.setdefault(r["step"], (r["epoch"], r["step_in_epoch"], {}))
        ids.update(zip(r["ranks"], r["ids"]))
    return steps, repeated


def tensorboard_scalars(logdir) -> dict:
    """{tag: [(step, value)]} as TensorBoard shows them: the events files in name order, each
    purge event (a resumed writer's first) hiding what earlier files logged at its step or later;
    TFRecord framing parsed by hand, the Event proto with tensorboardX's own."""
    from tensorboardX.proto.event_pb2 import Event  # the optional dependency that writes them

    shown = {}
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        for event in map(Event.FromString, _records(path)):
            if event.HasField("session_log") and event.session_log.status == event.session_log.START:
                shown = {tag: [(s, v) for s, v in points if s < event.step] for tag, points in shown.items()}
            for value in event.summary.value:
                shown.setdefault(value.tag, []).append((event.step, value.simple_value))
    return shown


def _records(path):
    """The whole records of a TFRecord file (length, its crc, data, its crc); a torn last one ends it."""
    with open(path, "rb") as f:
        data = f.read()
    at = 0
    while at + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[at:at + 8])
        if at + 12 + length + 4 > len(data):
            return
        yield data[at + 12:at + 12 + length]
        at += 12 + length + 4


def differences(out, whole) -> list:
    """What differs between the run in ``out`` and the run in ``whole``, one line each; [] when it
    is the same run bit for bit: final params, optimizer state and BatchNorm statistics, and every
    metrics row, every step's sample ids and every TensorBoard scalar, each exactly once."""
    found = []
    mine, theirs = final_state(out), final_state(whole)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(mine), jax.tree_util.tree_leaves(theirs)):
        if not np.array_equal(a, b):
            found.append(f"state {jax.tree_util.keystr(path)}: max difference {np.max(np.abs(a - b)):.3g}")
    rows, want = metrics_rows(out), metrics_rows(whole)
    if rows != want:
        at = next((i for i, (r, w) in enumerate(zip(rows, want)) if r != w), min(len(rows), len(want)))
        found.append(f"metrics.jsonl: {len(rows)} rows, {len(want)} expected; first difference at row {at + 1}: "
                     f"{rows[at] if at < len(rows) else None} vs {want[at] if at < len(want) else None}")
    (steps, repeated), (want_steps, _) = sample_steps(out), sample_steps(whole)
    if repeated:
        found.append(f"sample ids logged more than once: {repeated[:5]}")
    if steps != want_steps:
        found.append(f"sample ids: steps {sorted(steps)} vs {sorted(want_steps)}, or their ids differ")
    scalars, want_scalars = ({tag: points for tag, points in tensorboard_scalars(os.path.join(run, "tensorboard")).items()
                              if tag.split("/")[-1] not in TIMING} for run in (out, whole))
    if scalars != want_scalars:
        tags = sorted(t for t in set(scalars) | set(want_scalars) if scalars.get(t) != want_scalars.get(t))
        found.append(f"TensorBoard: {', '.join(tags[:4])} differ, e.g. {tags[0]} at steps "
                     f"{[s for s, _ in scalars.get(tags[0], [])]} vs {[s for s, _ in want_scalars.get(tags[0], [])]}")
    return found
