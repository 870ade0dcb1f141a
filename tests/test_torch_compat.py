"""torch_ref across torch releases: each ``torch_ref.compat`` shim against both API shapes (the
older one faked by a subclass of today's class with yesterday's constructor), and FSDP2's bf16
policies around BatchNorm (``strategies.mixed_precision_policies``).

CPU, gloo; a world of one in this process, or two ranks from the launcher where the point is
what crosses ranks.
"""

import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import ScheduleGPipe
from torch.nn.parallel import DistributedDataParallel

from torch_ref import compat
from torch_ref import dist as tdist


@pytest.fixture
def world_of_one():
    tdist.init(backend="gloo")
    yield
    tdist.shutdown()


# ----------------------------------------------------------------------------- DDP's buffer sync

class DDPWithoutForwardSync(DistributedDataParallel):
    """DDP as torch 2.6 to 2.12 constructs it: ``broadcast_buffers``, no ``forward_sync_buffers``
    (today's class underneath, which maps ``broadcast_buffers`` as those releases meant it)."""

    def __init__(self, module, device_ids=None, bucket_cap_mb=None, broadcast_buffers=True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # today's torch deprecates the name
            super().__init__(module, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb,
                             broadcast_buffers=broadcast_buffers)


class DDPWithBothNames:
    """Only a signature: torch >= 2.13's constructor keywords."""

    def __init__(self, module, *, broadcast_buffers=None, forward_sync_buffers=None):
        pass


class AnyKeyword:
    def __init__(self, module, **kwargs):
        pass


def test_ddp_buffer_sync_names_the_keyword_the_constructor_has():
    assert compat.ddp_buffer_sync(DDPWithBothNames) == {"forward_sync_buffers": True}
    assert compat.ddp_buffer_sync(DDPWithoutForwardSync) == {"broadcast_buffers": True}
    # A bare **kwargs proves nothing: the keyword every release knows.
    assert compat.ddp_buffer_sync(AnyKeyword) == {"broadcast_buffers": True}
    # This torch: whichever it names.
    assert set(compat.ddp_buffer_sync()) <= {"forward_sync_buffers", "broadcast_buffers"}


def _buffers_synced(old_constructor: bool):
    """One rank: a BatchNorm whose running mean differs per rank, wrapped by ``strategies.ddp``
    (through torch < 2.13's constructor if asked). Returns the running mean right after the
    wrap, and after one training forward of the same input on every rank whose running mean
    this rank had changed again just before."""
    import torch.nn.parallel

    from torch_ref import strategies

    if old_constructor:  # this rank's process only
        torch.nn.parallel.DistributedDataParallel = DDPWithoutForwardSync
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).double()
    model[1].running_mean.fill_(rank + 1.0)
    wrapped, _ = strategies.ddp(model, device=torch.device("cpu"))
    at_init = model[1].running_mean.clone().numpy()
    model[1].running_mean.fill_(10.0 * (rank + 1))
    wrapped(torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(4, 3)).sum().backward()
    return type(wrapped).__name__, at_init, model[1].running_mean.clone().numpy()


@pytest.mark.parametrize("old_constructor", [False, True], ids=["torch>=2.13", "torch<2.13"])
def test_ddp_syncs_rank0_buffers_at_init_and_before_each_forward_on_either_constructor(old_constructor):
    from torch_ref.launcher import run_ranks

    ranks = run_ranks(2, _buffers_synced, [(old_constructor,)] * 2, backend="gloo", timeout_s=120)
    want_class = "DDPWithoutForwardSync" if old_constructor else "DistributedDataParallel"
    assert [name for name, _, _ in ranks] == [want_class] * 2
    for _, at_init, _ in ranks:  # rank 0's 1.0, not rank 1's 2.0
        np.testing.assert_array_equal(at_init, np.ones(4))
    # Rank 0's 10.0 on both ranks before the forward, then the same batch's statistics:
    # 0.9 * 10 + 0.1 * batch mean. Without the sync rank 1 would start from 20.
    x = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(4, 3)
    torch.manual_seed(0)
    batch_mean = nn.Linear(3, 4).double()(x).mean(0).detach().numpy()
    for _, _, after in ranks:
        np.testing.assert_allclose(after, 0.9 * 10.0 + 0.1 * batch_mean, rtol=1e-15)


# ----------------------------------------------------------------------------- GPipe's gradient scaling

class GPipeWithoutScaleGrads(ScheduleGPipe):
    """ScheduleGPipe as torch 2.6 constructs and runs it: no ``scale_grads``, the micro-batches'
    gradients summed."""

    def __init__(self, stage, n_microbatches, loss_fn=None):
        super().__init__(stage, n_microbatches, loss_fn=loss_fn, scale_grads=False)


class Recorder:
    def __init__(self, stage, n_microbatches, loss_fn=None, scale_grads=True):
        self.scale_grads = scale_grads


def test_gpipe_leaves_the_micro_batch_division_to_the_caller_only_where_torch_does_not_do_it():
    schedule, divisor = compat.gpipe("stage", 4, F.cross_entropy, Recorder)
    assert (schedule.scale_grads, divisor) == (True, 1)

    class OldRecorder:
        def __init__(self, stage, n_microbatches, loss_fn=None):
            self.n = n_microbatches

    schedule, divisor = compat.gpipe("stage", 4, F.cross_entropy, OldRecorder)
    assert (schedule.n, divisor) == (4, 4)


def _toy_pipeline_grads():
    from torch_ref.pipeline import ToyMpModel, pipeline_rank_steps

    torch.manual_seed(0)
    state = {k: v.numpy() for k, v in ToyMpModel().double().state_dict().items()}
    rng = np.random.default_rng(0)
    batch = (rng.normal(size=(1, 8, 10)), rng.integers(0, 5, size=(1, 8)))
    cfg = {"family": "toy", "dp": 1, "pp": 1, "microbatches": 4, "dtype": "float64", "bounds": [(0, 2)],
           "optimizer": "sgd", "lr": 0.1, "momentum": 0.0, "weight_decay": 0.0}
    return pipeline_rank_steps(cfg, state, [batch])[0]["grads"]


def test_pipeline_grads_are_the_micro_batch_mean_on_either_gpipe(world_of_one, monkeypatch):
    import torch.distributed.pipelining as pipelining

    from torch_ref.pipeline import ToyMpModel

    today = _toy_pipeline_grads()
    monkeypatch.setattr(pipelining, "ScheduleGPipe", GPipeWithoutScaleGrads)
    summed = _toy_pipeline_grads()
    # The reference: the whole batch's mean loss in one pass (4 equal micro-batches).
    torch.manual_seed(0)
    model = ToyMpModel().double()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(1, 8, 10)), rng.integers(0, 5, size=(1, 8))
    F.cross_entropy(model(torch.from_numpy(x[0])), torch.from_numpy(y[0])).backward()
    for name, p in model.named_parameters():
        np.testing.assert_allclose(today[name], p.grad.numpy(), rtol=1e-13, atol=1e-15)
        np.testing.assert_allclose(summed[name], p.grad.numpy(), rtol=1e-13, atol=1e-15)


# ----------------------------------------------------------------------------- FSDP2 on CPU

class CPUStreamOfTorch26:
    """torch 2.6's ``torch.cpu.Stream``: no ``record_event``."""

    def wait_stream(self, stream):
        pass


def test_fsdp_on_cpu_is_refused_in_one_line_where_cpu_streams_cannot_record_events(monkeypatch):
    from torch_ref.models import resnet
    from torch_ref.strategies import StrategyError, wrap

    assert compat.fsdp_cpu_problem(torch.cpu.Stream) is None  # this torch: FSDP2 runs on CPU
    assert "needs torch >= 2.7" in compat.fsdp_cpu_problem(CPUStreamOfTorch26)
    monkeypatch.setattr(torch.cpu, "Stream", CPUStreamOfTorch26)
    with pytest.raises(StrategyError, match=r"FSDP2 \(zero2, zero3, hsdp\) on CPU needs torch >= 2.7"):
        wrap("zero3", resnet("resnet18", width=4, blocks=(1, 1, 1, 1)), device=torch.device("cpu"))


# ----------------------------------------------------------------------------- FSDP2 bf16 with BatchNorm

def _bf16_twin(model: nn.Module) -> nn.Module:
    """What FSDP2's policies should compute, without FSDP: every param in bf16 but the norm
    layers' (float32, as their running stats)."""
    import copy

    from torch_ref.strategies import NORM_LAYERS

    twin = copy.deepcopy(model)
    for m in twin.modules():
        if not isinstance(m, NORM_LAYERS):
            for p in m.parameters(recurse=False):
                p.data = p.data.to(torch.bfloat16)
    return twin


def test_fsdp_bf16_computes_bf16_around_float32_batchnorm(world_of_one):
    """The policy that used to crash cuDNN's BatchNorm backward (bf16 weight, fp32 running
    stats) is gone: BatchNorm keeps fp32 params, convolutions run in bf16, logits come out
    fp32, gradients are reduced in fp32. The numbers are those of the same model computed
    without FSDP in those dtypes, exactly (one rank: the reduction is the identity)."""
    from torch_ref.models import resnet
    from torch_ref.strategies import full_grads, wrap

    torch.manual_seed(0)
    model = resnet("resnet18", width=4, blocks=(1, 1, 1, 1), stem="cifar")
    twin = _bf16_twin(model)
    x, y = torch.randn(4, 3, 8, 8), torch.arange(4)
    seen = {}

    def record(name):
        def hook(module, args, out):
            seen[name] = (module.weight.dtype, args[0].dtype, out.dtype)
        return hook

    parallel = wrap("zero3", model, device=torch.device("cpu"), mixed_precision=True)
    model.conv1.register_forward_hook(record("conv"))
    model.layer1[0].bn1.register_forward_hook(record("bn"))
    logits = parallel.model(x)
    loss = F.cross_entropy(logits, y)
    loss.backward()
    assert seen == {"conv": (torch.bfloat16, torch.bfloat16, torch.bfloat16),
                    "bn": (torch.float32, torch.bfloat16, torch.bfloat16)}
    assert logits.dtype == torch.float32
    assert {b.dtype for b in model.buffers() if b.is_floating_point()} == {torch.float32}

    want_logits = twin(x.to(torch.bfloat16)).float()
    want = F.cross_entropy(want_logits, y)
    want.backward()
    assert loss.item() == want.item()
    grads = full_grads(parallel)
    assert {g.dtype for g in grads.values()} == {torch.float32}
    for name, p in twin.named_parameters():
        torch.testing.assert_close(grads[name], p.grad.float(), rtol=0, atol=0, msg=name)
    for (name, b), want_b in zip(model.named_buffers(), twin.buffers()):
        torch.testing.assert_close(b, want_b, rtol=0, atol=0, msg=name)
