"""torch_ref: every strategy against a single-process reference, the trainer end to end.

All on CPU with gloo: a ResNet of width 4 with one block per stage, float64, a 64-image
synthetic set, global batch 16 over 1, 2 or 4 ranks. Each strategy is launched once
(``run_steps``, 20 steps) and the run is shared by the tests that read it.

The reference is plain single-process torch on the same global batch, computing exactly
what data parallelism means: each rank's shard goes through the model separately (per-rank
BN statistics), the per-rank gradients are averaged, one ``torch.optim`` step follows;
the BN running stats are rank 0's. In float64 every strategy must match it to 1e-12.
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from jaxdp.data import epoch_batches, make_synthetic
from torch_ref.launcher import LaunchError, run_steps
from torch_ref.models import resnet
from torch_ref.step_api import build, resolve_config, strategy_options, to_torch_batch
from torch_ref.strategies import StrategyError, powersgd_shapes, wrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLOBAL_BATCH = 16
STEPS = 20        # per run: the loss must fall over these
PARITY_STEPS = 3  # compared in full against the reference
TOL = 1e-12

MODEL = dict(model="resnet18", width=4, blocks=(1, 1, 1, 1), stem="cifar", num_classes=10,
             dtype="float64")
SGD = dict(optimizer="sgd", lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
ADAM = dict(optimizer="adam", lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=1e-4)
ADAMW = dict(optimizer="adamw", lr=1e-2, weight_decay=1e-2, schedule="cosine", total_steps=STEPS)

# name -> (world size, config). Pairs share optimizer settings so their states can be
# compared directly: zero2 with ddp (SGD + accumulation), zero3 with ddp_adam.
CASES = {
    "ddp": (2, dict(strategy="ddp", accum_steps=2, bucket_cap_mb=0.005, **SGD)),  # several buckets
    "ddp_adam": (2, dict(strategy="ddp", **ADAM)),
    "zero1": (2, dict(strategy="zero1", **ADAMW)),  # and the jaxdp cosine through LambdaLR
    "zero2": (2, dict(strategy="zero2", accum_steps=2, **SGD)),
    "zero3": (2, dict(strategy="zero3", **ADAM)),
    "hsdp": (4, dict(strategy="hsdp", mesh_shape=(2, 2), **SGD)),
}
# These run again on 4 ranks, for the reference comparison only (PARITY_STEPS steps each:
# whether a strategy trains does not depend on the world size, and is checked at 2).
AT_WORLD_4 = ("ddp", "zero1", "zero2", "zero3")
PARITY_RUNS = [(name, world) for name, (world, _) in CASES.items()] + [(name, 4) for name in AT_WORLD_4]


# ----------------------------------------------------------------------------- fixtures

def batches(world: int, steps: int = STEPS):
    """``steps`` global batches of the synthetic set, as (world, b, ...): its first epoch
    (4 batches), repeated, so that 20 steps are enough for the loss to fall clearly."""
    train, _ = make_synthetic(64, 16, seed=0)
    epoch = [(b.images, b.labels) for b in epoch_batches(
        train, num_replicas=world, batch_per_replica=GLOBAL_BATCH // world, epoch=0, seed=0)]
    return [epoch[i % len(epoch)] for i in range(steps)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The reference and the in-process dp run are tiny: threads only contend (on the
    shared 2-core machine, 2 threads made them 20x slower). The launcher's ranks set 1 too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def init_state():
    torch.manual_seed(0)
    model = resnet(MODEL["model"], width=MODEL["width"], blocks=MODEL["blocks"]).double()
    return {k: v.numpy() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def runs(init_state):
    """Launch each case once per world size, lazily; (name, world) -> rank 0's step records.
    A world size other than the case's own runs PARITY_STEPS steps only."""
    cache = {}

    def get(name, world=None):
        own_world, config = CASES[name]
        world = world or own_world
        if (name, world) not in cache:
            steps = STEPS if world == own_world else PARITY_STEPS
            cache[name, world] = run_steps(world, dict(MODEL, **config), init_state, batches(world, steps),
                                           collect=range(PARITY_STEPS), timeout_s=180)
        return cache[name, world]

    return get


# ----------------------------------------------------------------------------- the reference

def reference(config: dict, init_state: dict, world: int, steps: int = PARITY_STEPS):
    """Single-process DDP semantics, written out; one record per step like Runner.step's,
    plus each rank's local gradient (``local_grads``)."""
    cfg = resolve_config(config)
    model = resnet(cfg["model"], width=cfg["width"], blocks=cfg["blocks"]).double()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in init_state.items()})
    params = dict(model.named_parameters())
    if cfg["optimizer"] == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"],
                              nesterov=cfg["nesterov"], weight_decay=cfg["weight_decay"])
    else:
        cls = torch.optim.Adam if cfg["optimizer"] == "adam" else torch.optim.AdamW
        opt = cls(model.parameters(), lr=cfg["lr"], betas=cfg["betas"], eps=cfg["eps"],
                  weight_decay=cfg["weight_decay"])
    # torch's own scheduler, not the shared formula: an independent check of the lr.
    sched = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg["total_steps"])
             if cfg["schedule"] == "cosine" else None)
    k = cfg["accum_steps"]
    records = []
    for images, labels in batches(world, steps):
        lr = opt.param_groups[0]["lr"]
        start = {n: b.clone() for n, b in model.named_buffers()}
        local, losses = [], []
        for r in range(world):
            for n, b in model.named_buffers():
                b.copy_(start[n])  # every rank starts from rank 0's buffers (DDP's broadcast)
            model.zero_grad(set_to_none=True)
            x, y = to_torch_batch(images[r], labels[r], torch.device("cpu"), torch.float64)
            loss_sum = 0.0
            for xm, ym in zip(x.chunk(k), y.chunk(k)):
                loss = F.cross_entropy(model(xm), ym)
                (loss / k).backward()
                loss_sum += loss.item()
            losses.append(loss_sum / k)
            local.append({n: p.grad.clone() for n, p in params.items()})
            if r == 0:
                rank0 = {n: b.clone() for n, b in model.named_buffers()}
        for n, b in model.named_buffers():
            b.copy_(rank0[n])
        for n, p in params.items():
            p.grad = sum(g[n] / world for g in local)
        grads = {n: p.grad.numpy().copy() for n, p in params.items()}
        opt.step()
        if sched is not None:
            sched.step()
        records.append({
            "loss_per_rank": losses, "lr": lr, "grads": grads,
            "local_grads": [{n: g.numpy() for n, g in lg.items()} for lg in local],
            "params": {n: p.detach().numpy().copy() for n, p in params.items()},
            "buffers": {n: b.numpy().copy() for n, b in model.named_buffers()
                        if n.endswith(("running_mean", "running_var"))},
            "optimizer_state": {n: {s: v.numpy().copy() for s, v in opt.state[p].items()}
                                for n, p in params.items()},
        })
    return records


def flat_state(state: dict) -> dict:
    return {f"{n}.{k}": np.asarray(v) for n, s in state.items() for k, v in s.items()}


def assert_close(got: dict, want: dict, what: str, tol: float = TOL) -> None:
    """Per-tensor relative error ||got - want|| / ||want|| <= tol, same keys."""
    assert sorted(got) == sorted(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))}"
    worst, where = 0.0, None
    for k in want:
        g, w = np.asarray(got[k], np.float64), np.asarray(want[k], np.float64)
        assert g.shape == w.shape, f"{what} {k}: shape {g.shape} vs {w.shape}"
        denom = np.linalg.norm(w)
        err = np.linalg.norm(g - w) / denom if denom > 0 else np.linalg.norm(g)
        if err > worst:
            worst, where = err, k
    assert worst <= tol, f"{what}: relative error {worst:.3g} at {where} (tolerance {tol})"


def assert_matches_reference(records, ref, label: str) -> None:
    for i, (got, want) in enumerate(zip(records[:PARITY_STEPS], ref)):
        what = f"{label} step {i + 1}"
        np.testing.assert_allclose(got["loss_per_rank"], want["loss_per_rank"], rtol=TOL, err_msg=what)
        assert abs(got["lr"] - want["lr"]) <= TOL * want["lr"], f"{what}: lr {got['lr']} vs {want['lr']}"
        assert_close(got["grads"], want["grads"], f"{what} grads")
        assert_close(got["params"], want["params"], f"{what} params")
        assert_close(got["buffers"], want["buffers"], f"{what} BN buffers")
        assert_close(flat_state(got["optimizer_state"]), flat_state(want["optimizer_state"]),
                     f"{what} optimizer state")


def assert_loss_falls(records, label: str) -> None:
    losses = [r["loss"] for r in records]
    first, last = np.mean(losses[:4]), np.mean(losses[-4:])
    assert last < 0.8 * first, f"{label}: loss did not fall: {np.round(losses, 3).tolist()}"


# ----------------------------------------------------------------------------- strategies

@pytest.mark.parametrize("name, world", PARITY_RUNS, ids=[f"{n}-world{w}" for n, w in PARITY_RUNS])
def test_strategy_matches_single_process_reference(name, world, runs, init_state):
    config = CASES[name][1]
    records = runs(name, world)
    assert len(records) == (STEPS if world == CASES[name][0] else PARITY_STEPS)
    assert all("params" in r for r in records[:PARITY_STEPS])
    if len(records) > PARITY_STEPS:
        assert "params" not in records[-1]  # collect= kept the other steps light
    assert_matches_reference(records, reference(dict(MODEL, **config), init_state, world), f"{name} on {world}")


@pytest.mark.parametrize("name", list(CASES))
def test_strategy_trains(name, runs):
    assert_loss_falls(runs(name), name)


@pytest.mark.parametrize("fsdp, ddp", [("zero2", "ddp"), ("zero3", "ddp_adam")])
def test_gathered_fsdp_optimizer_state_equals_ddp(fsdp, ddp, runs):
    """FSDP2's DTensor optimizer states, gathered with full_tensor(), are DDP's, directly
    (zero1's consolidated state and hsdp's are checked against the reference above)."""
    want = runs(ddp)[PARITY_STEPS - 1]
    got = runs(fsdp)[PARITY_STEPS - 1]
    keys = set(next(iter(got["optimizer_state"].values())))
    assert keys == ({"momentum_buffer"} if CASES[fsdp][1]["optimizer"] == "sgd"
                    else {"exp_avg", "exp_avg_sq", "step"})
    assert_close(flat_state(got["optimizer_state"]), flat_state(want["optimizer_state"]),
                 f"{fsdp} vs {ddp} optimizer state")
    assert_close(got["params"], want["params"], f"{fsdp} vs {ddp} params")


def test_dp_falls_back_to_full_batch_on_cpu_and_says_why(init_state, capfd):
    """No process group, no launcher: dp is one process. The note must explain itself."""
    config = dict(MODEL, strategy="dp", **SGD)
    runner = build(config, init_state)
    err = capfd.readouterr().err
    assert "ONE process on the FULL batch" in err and "ReduceAdd" in err and "BatchNorm" in err
    records = [runner.step(images[0], labels[0], collect=i < PARITY_STEPS)
               for i, (images, labels) in enumerate(batches(1))]
    assert_matches_reference(records, reference(config, init_state, world=1), "dp")
    assert_loss_falls(records, "dp")


def test_powersgd_uses_the_injected_q(init_state):
    """Steps 1-2 are plain all-reduce (start_iter=2); step 3 is the first compressed one and
    must equal rank-1 PowerSGD computed by hand from the reference's per-rank gradients
    and the injected Q (which the hook orthogonalises first)."""
    world, rank = 2, 1
    model = resnet("resnet18", width=MODEL["width"], blocks=MODEL["blocks"])
    shapes = powersgd_shapes(model, rank)
    assert len({(dict(model.named_parameters())[n].shape[0],) + s for n, s in shapes.items()}) > 2
    rng = np.random.default_rng(1)
    q0 = {n: rng.normal(size=s) for n, s in shapes.items()}
    config = dict(MODEL, strategy="ddp", compress="powersgd", powersgd_rank=rank,
                  powersgd_start_iter=2, powersgd_q=q0, **SGD)
    got = run_steps(world, config, init_state, batches(world, 3), timeout_s=180)
    ref = reference(dict(MODEL, strategy="ddp", **SGD), init_state, world)
    for i in range(2):
        assert_close(got[i]["grads"], ref[i]["grads"], f"powersgd step {i + 1} (uncompressed)")
    expected = {}
    for name, avg in ref[2]["grads"].items():
        if name not in shapes:
            expected[name] = avg  # small tensors: plain average
            continue
        ms = [g[name].reshape(g[name].shape[0], -1) for g in ref[2]["local_grads"]]
        q = q0[name] / np.linalg.norm(q0[name], axis=0)
        p = sum(m @ q for m in ms)
        p = p / np.linalg.norm(p, axis=0)
        q = sum(m.T @ p for m in ms) / world
        expected[name] = (p @ q.T).reshape(avg.shape)
    assert_close(got[2]["grads"], expected, "powersgd step 3 (compressed)", tol=1e-10)


@pytest.mark.parametrize("compress, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_low_precision_hooks_divide_then_sum_in_low_precision(compress, dtype, init_state):
    """bf16/fp16_compress_hook: cast each rank's gradient, divide by N in low precision,
    sum, cast back. (bf16 runs on gloo through a renamed copy of the stock hook.)"""
    world = 2
    config = dict(MODEL, strategy="ddp", compress=compress, **SGD)
    got = run_steps(world, config, init_state, batches(world, 1), timeout_s=120)[0]
    local = reference(dict(MODEL, strategy="ddp", **SGD), init_state, world, steps=1)[0]["local_grads"]
    want = {n: sum(torch.from_numpy(g[n]).to(dtype) / world for g in local).double().numpy()
            for n in local[0]}
    assert_close(got["grads"], want, f"{compress} hook grads")


def test_bf16_mixed_precision_runs_for_ddp_and_fsdp(init_state):
    """dtype bfloat16: fp32 params, bf16 compute (autocast for ddp; FSDP2's
    MixedPrecisionPolicy for zero3, norm layers float32: strategies.mixed_precision_policies)."""
    world = 2
    sd32 = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in init_state.items()}
    base = dict(MODEL, **SGD)
    fp32 = run_steps(world, dict(base, strategy="ddp", dtype="float32"), sd32, batches(world, 2))
    for strategy in ("ddp", "zero3"):
        bf16 = run_steps(world, dict(base, strategy=strategy, dtype="bfloat16"), sd32, batches(world, 2))
        assert all(p.dtype == np.float32 for p in bf16[-1]["params"].values())
        for a, b in zip(bf16, fp32):
            assert a["loss"] != b["loss"] and abs(a["loss"] - b["loss"]) < 1e-2 * b["loss"], strategy


# ----------------------------------------------------------------------------- configuration errors

def test_options_a_strategy_does_not_take_are_refused():
    with pytest.raises(StrategyError, match="unknown config key 'lrr'"):
        resolve_config({"lrr": 0.1})
    with pytest.raises(StrategyError, match="mesh_shape.*does not apply to strategy 'ddp'"):
        strategy_options(resolve_config({"strategy": "ddp", "mesh_shape": (1, 2)}))
    with pytest.raises(StrategyError, match="allreduce.*does not apply to strategy 'ddp'"):  # jaxdp's ring
        strategy_options(resolve_config({"strategy": "ddp", "allreduce": "ring"}))
    assert resolve_config({"comm_hook": "bf16"})["compress"] == "bf16"


def test_sync_bn_is_refused_on_cpu_with_the_reason():
    with pytest.raises(StrategyError, match="needs CUDA.*SyncBatchNorm"):
        wrap("ddp", resnet(width=4, blocks=(1, 1, 1, 1)), device=torch.device("cpu"), sync_bn=True)


def test_launcher_raises_with_the_failing_ranks_traceback(init_state):
    with pytest.raises(LaunchError, match=r"(?s)rank\(s\) \[0\] failed.*rank 0 traceback.*mesh_shape"):
        run_steps(1, dict(MODEL, strategy="hsdp", mesh_shape=(3, 1)), init_state, batches(1, 1),
                  timeout_s=120)


def test_a_killed_caller_takes_its_ranks_and_temporary_directory_with_it(tmp_path):
    """The ranks are the fork server's children: SIGKILL of the process in run_ranks (an OOM
    killer, a scheduler) must end both within seconds and remove the launcher's temporary
    directory (they ran on for their 45 s timeout, and the directory stayed). Under a TMPDIR
    too long for the fork server's Unix socket, as pytest's and a scheduler's can be (CI's was
    one byte over and the ranks never started)."""
    from launch_helpers import gone_within, kill_all

    tmp = tmp_path / ("t" * max(3, 100 - len(str(tmp_path))))
    tmp.mkdir()
    script = ("import sys\n"
              "import torch_ref.launcher as launcher\n"
              "from launch_helpers import sleep_in_rank\n"
              "launcher.PRELOAD = ['torch']  # what the ranks need here: less to import\n"
              "launcher.run_ranks(2, sleep_in_rank, [(sys.argv[1],)] * 2, backend='gloo', timeout_s=60)\n")
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    caller = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "rank")], env=env, start_new_session=True)
    pids = []
    try:
        from launch_helpers import wait_for_files

        pids = [int(text) for text in wait_for_files([tmp_path / "rank0", tmp_path / "rank1"], timeout=120)]
        ours = lambda: [name for name in os.listdir(tmp) if name.startswith("torch_ref_launch_")]  # noqa: E731
        assert len(ours()) == 1  # (multiprocessing's own pymp-* is Python's, left by any SIGKILLed user)
        caller.kill()
        caller.wait()
        assert gone_within(pids, 5) == []
        assert ours() == []
    finally:
        kill_all(pids)
        if caller.poll() is None:
            caller.kill()


# ----------------------------------------------------------------------------- the trainer

def _torchrun(args, out):
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", "2",
           "-m", "torch_ref.train", "--strategy", "zero3", "--width", "4", "--blocks", "1,1,1,1",
           "--synthetic-size", "256,64", "--global-batch-size", "32", "--epochs", "1",
           "--checkpoint-every", "3", "--no-progress", "--out", str(out), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _records(path):
    with open(path) as f:
        rs = [json.loads(line) for line in f]
    for r in rs:
        r.pop("images_per_sec", None)  # timing, not math
    return rs


@pytest.mark.slow
def test_torchrun_zero3_writes_metrics_and_checkpoints_and_resumes(tmp_path):
    """torchrun, 2 ranks, 8 steps (256 images / 32). Resuming from the step-3 checkpoint
    (the later ones deleted) must replay steps 4-8 and the eval exactly."""
    out = tmp_path / "run"
    _torchrun([], out)
    full = _records(out / "metrics.jsonl")
    train = [r for r in full if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 9))
    assert set(train[0]) == {"kind", "epoch", "step", "loss", "accuracy", "lr"}
    assert full[-1]["kind"] == "eval" and full[-1]["count"] == 64 and full[-1]["step"] == 8
    assert set(full[-1]) == {"kind", "epoch", "step", "loss", "accuracy", "count"}
    ckpts = sorted(os.listdir(out / "checkpoints"))
    assert ckpts == ["step_00000003.pt", "step_00000006.pt", "step_00000008.pt"]
    assert json.loads((out / "config.json").read_text())["strategy"] == "zero3"

    for name in ckpts[1:]:
        os.remove(out / "checkpoints" / name)
    _torchrun(["--resume"], out)
    resumed = _records(out / "metrics.jsonl")
    assert resumed == full


# ----------------------------------------------------------------------------- the trainer in this process

# One epoch of 4 steps of 16 images, in a world of one (no torchrun).
TRAINER = ["--strategy", "ddp", "--width", "4", "--blocks", "1,1,1,1", "--synthetic-size", "64,32",
           "--global-batch-size", "16", "--epochs", "1", "--no-progress"]


@pytest.fixture
def world_of_one():
    """``torch_ref.train.train`` joins a process group of one; leave none behind (the dp
    test above relies on there being none)."""
    from torch_ref import dist as tdist

    yield
    tdist.shutdown()


def _state(summary) -> dict:
    return {k: v.detach().clone() for k, v in summary["runner"].parallel.module.state_dict().items()}


@pytest.mark.parametrize("how", ["raise", "sigint"])
def test_ctrl_c_checkpoints_the_step_in_hand(how, tmp_path, monkeypatch, world_of_one):
    """'raise': a KeyboardInterrupt while step 3's record is written (its loss averaged over
    ranks), 'sigint': a real Ctrl-C right after step 3's optimizer update. Either way the
    checkpoint holds step 3 under its own number, with its record, and resuming gives the
    uninterrupted run exactly."""
    from torch_ref import train as torch_train
    from torch_ref.step_api import Runner

    whole = torch_train.parse_args([*TRAINER, "--epochs", "2", "--out", str(tmp_path / "whole")])
    expected = torch_train.train(whole)
    calls = []

    def interrupt_third_call(real):
        def call(*args):
            calls.append(1)
            if len(calls) == 3 and how == "raise":
                raise KeyboardInterrupt
            out = real(*args)
            if len(calls) == 3:
                os.kill(os.getpid(), signal.SIGINT)
            return out
        return call

    if how == "raise":
        monkeypatch.setattr(torch_train.tdist, "all_reduce_sum", interrupt_third_call(torch_train.tdist.all_reduce_sum))
    else:
        monkeypatch.setattr(Runner, "update", interrupt_third_call(Runner.update))
    split = dataclasses.replace(whole, out=str(tmp_path / "split"))
    with pytest.raises(KeyboardInterrupt) as interrupt:
        torch_train.train(split)
    monkeypatch.undo()
    assert interrupt.value.checkpointed_step == 3
    assert [r["step"] for r in _records(tmp_path / "split" / "metrics.jsonl")] == [1, 2, 3]
    resumed = torch_train.train(dataclasses.replace(split, resume=True))
    assert _records(tmp_path / "split" / "metrics.jsonl") == _records(tmp_path / "whole" / "metrics.jsonl")
    want = _state(expected)
    for name, value in _state(resumed).items():
        assert torch.equal(value, want[name]), name


def _sigint_after_update(monkeypatch, n):
    """A real Ctrl-C right after the ``n``-th optimizer update."""
    from torch_ref.step_api import Runner

    real, calls = Runner.update, []

    def update(*args):
        out = real(*args)
        calls.append(1)
        if len(calls) == n:
            os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(Runner, "update", update)


def test_a_stop_during_an_epochs_last_step_evaluates_the_epoch_first(tmp_path, monkeypatch, world_of_one):
    """As jaxdp's trainer: a Ctrl-C during an epoch's last step (4 of 4) lets the epoch's evaluation
    and save come first, then stops; during the run's last step the run is simply done. torch_ref
    stopped at once, without the evaluation (and called a finished run interrupted)."""
    from torch_ref import checkpoint as ckpt
    from torch_ref import train as torch_train

    _sigint_after_update(monkeypatch, 4)
    cfg = torch_train.parse_args([*TRAINER, "--epochs", "2", "--out", str(tmp_path / "two")])
    with pytest.raises(KeyboardInterrupt) as interrupt:
        torch_train.train(cfg)
    assert interrupt.value.checkpointed_step == 4
    assert [(r["kind"], r["step"]) for r in _records(tmp_path / "two" / "metrics.jsonl")] == [
        ("train", 1), ("train", 2), ("train", 3), ("train", 4), ("eval", 4)]
    meta = torch.load(ckpt.latest(str(tmp_path / "two" / "checkpoints")), weights_only=True)["meta"]
    assert (meta["global_step"], meta["epoch"], meta["step_in_epoch"]) == (4, 1, 0)  # the next epoch's start

    monkeypatch.undo()
    _sigint_after_update(monkeypatch, 4)
    summary = torch_train.train(torch_train.parse_args([*TRAINER, "--out", str(tmp_path / "one")]))
    assert not summary["interrupted"] and summary["eval"]["count"] == 32


def test_checkpoints_are_fsynced_before_their_rename_and_a_damaged_newest_falls_back(tmp_path, monkeypatch,
                                                                                     world_of_one, capfd):
    """Each checkpoint: written to a temporary file, fsynced, renamed, its directory fsynced (torch_ref
    did neither fsync). A resume whose newest file was damaged since says so in one line and resumes
    from the one before, to the same records (it tried the newest only)."""
    from torch_ref import train as torch_train

    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(a), str(b))), real_replace(a, b))[1])
    out = tmp_path / "run"
    cfg = torch_train.parse_args([*TRAINER, "--checkpoint-every", "2", "--out", str(out)])
    torch_train.train(cfg)
    monkeypatch.undo()
    folder = str(out / "checkpoints")
    for step in (2, 4):
        path = os.path.join(folder, f"step_{step:08d}.pt")
        renames = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == path]
        assert len(renames) == 1, events
        i = renames[0]
        tmp = events[i][1]
        assert os.path.dirname(tmp) == folder and ("fsync", tmp) in events[:i]
        assert ("fsync", folder) in events[i + 1:]
    assert sorted(os.listdir(folder)) == ["step_00000002.pt", "step_00000004.pt"]  # no temporary file left
    whole = _records(out / "metrics.jsonl")

    newest = os.path.join(folder, "step_00000004.pt")
    with open(newest, "r+b") as f:
        f.truncate(os.path.getsize(newest) // 2)
    capfd.readouterr()
    torch_train.train(dataclasses.replace(cfg, resume=True))
    err = capfd.readouterr().err
    assert f"torch_ref: checkpoint {newest} cannot be read: " in err and err.count("cannot be read") == 1, err
    assert err.split(f"torch_ref: checkpoint {newest} cannot be read: ")[1].splitlines()[0].endswith(
        "; trying the one before")
    assert _records(out / "metrics.jsonl") == whole


def test_a_fresh_run_refuses_an_out_with_checkpoints_unless_told_to_overwrite(tmp_path, capsys):
    from torch_ref.train import main

    out = tmp_path / "run"
    os.makedirs(out / "checkpoints")
    (out / "checkpoints" / "step_00000007.pt").write_bytes(b"an earlier run's")
    (out / "metrics.jsonl").write_text('{"kind": "train", "step": 7, "loss": 1.0}\n')
    (out / "notes.txt").write_text("mine")
    assert main([*TRAINER, "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"torch_ref: error: {out} already holds checkpoints of an earlier run (latest step 7): pass --resume "
        "to continue it, --overwrite to start over, or another --out\n")
    assert main([*TRAINER, "--out", str(out), "--overwrite"]) == 0
    assert sorted(os.listdir(out / "checkpoints")) == ["step_00000004.pt"]
    assert [r["step"] for r in _records(out / "metrics.jsonl") if r["kind"] == "train"] == [1, 2, 3, 4]
    assert (out / "notes.txt").read_text() == "mine"


MISSING_CIFAR = ["--dataset", "cifar10", "--data-dir", "/nonexistent/cifar"]


@pytest.mark.parametrize("args, message", [
    (["--global-batch-size", "0"], "--global-batch-size must be >= 1, got 0"),
    (["--accum-steps", "0"], "--accum-steps must be >= 1, got 0"),
    (["--devices", "0"], "--devices must be >= 1 (omit it to use every device), got 0"),
    (["--synthetic-size", "64"], "--synthetic-size takes two positive counts"),
    (["--synthetic-size", "8,4", "--global-batch-size", "16"], "dataset of 8 samples is too small"),
    (["--epochs", "-1"], "--epochs must be >= 1, got -1"),
    (["--stem", "imagenet", "--global-batch-size", "1"],
     "1 image per device is too few for --stem imagenet: expected more than 1 value per channel"),
    (["--schedule", "multistep"], "--schedule multistep needs --milestones"),
    (["--powersgd-start-iter", "2"], "--powersgd-start-iter applies to --compress powersgd only"),
    ([*MISSING_CIFAR, "--strategy", "zero9"], "unknown strategy 'zero9'"),
    ([*MISSING_CIFAR, "--model", "resnet9"], "unknown model 'resnet9'"),
    ([*MISSING_CIFAR, "--optimizer", "lamb"], "unknown optimizer 'lamb'"),
    ([*MISSING_CIFAR, "--schedule", "poly"], "unknown schedule 'poly'"),
    (MISSING_CIFAR, "or pass --download"),
])
def test_bad_input_is_one_clear_line_and_writes_nothing(tmp_path, capsys, args, message):
    from torch_ref.train import main

    out = tmp_path / "run"
    assert main(["--out", str(out), "--no-progress", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("torch_ref: error: ") and err.count("\n") == 1, err
    assert message.lower() in err.lower()
    assert not out.exists()


def test_powersgd_start_iter_reaches_the_hook():
    from torch_ref.train import parse_args, runner_config

    cfg = parse_args(["--compress", "powersgd", "--powersgd-start-iter", "2"])
    assert runner_config(cfg, steps_per_epoch=4)["powersgd_start_iter"] == 2
