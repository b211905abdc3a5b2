"""``Trainer(device=...)`` decides where the model and batches go (issue 13).

CUDA is faked (``torch.cuda.is_available`` monkeypatched to True): no test here touches a GPU.
A test that would train on the faked GPU stops at the Engine's construction and looks at the
Context it was given, before any ``.to``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import kiln
from kiln.launch.context import Context, _set_context, resolve_device

CUDA0, CUDA1, CPU = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")


@pytest.fixture
def fake_cuda(monkeypatch):
    """A machine that says it has two GPUs; nothing may actually use them."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    _set_context(None)  # the next kiln.context() sees the "GPUs": device cuda:0
    yield
    _set_context(None)


def _loader(n=16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return DataLoader(TensorDataset(x, x[:, :2].argmax(1)), batch_size=8)


def _model():
    torch.manual_seed(0)
    return nn.Linear(4, 2)


class _BatchDevices(kiln.Callback):
    def __init__(self):
        self.devices = []

    def before_forward(self, state, logger):
        self.devices.extend(t.device for t in state.batch)


class _EngineBuilt(Exception):
    pass


def _capture_engine_ctx(monkeypatch):
    """Replace the Engine the Trainer builds with one that records its Context and stops."""
    seen = {}

    def fake_engine(model, optimizer, criterion, *, ctx, **kwargs):
        seen["ctx"] = ctx
        raise _EngineBuilt

    monkeypatch.setattr("kiln.trainer.building.Engine", fake_engine)
    return seen


def test_device_cpu_keeps_model_and_batches_on_cpu_where_cuda_is(fake_cuda):
    assert kiln.context().device == CUDA0  # without device=, this run would go to the GPU
    devices = _BatchDevices()
    model = _model()
    trainer = kiln.Trainer(
        model,
        criterion=nn.CrossEntropyLoss(),
        device="cpu",
        train_dataloader=_loader(),
        max_duration="1ep",
        callbacks=devices,
        progress_bar=False,
    )
    assert trainer.engine.device == CPU and trainer.state.device == CPU
    assert all(p.device == CPU for p in model.parameters())
    trainer.fit()
    assert devices.devices and set(devices.devices) == {CPU}
    assert trainer.engine.device == CPU and all(p.device == CPU for p in model.parameters())


def test_device_none_would_choose_the_gpu(fake_cuda, monkeypatch):
    seen = _capture_engine_ctx(monkeypatch)
    with pytest.raises(_EngineBuilt):
        kiln.Trainer(_model(), criterion=nn.CrossEntropyLoss(), device=None, max_duration=1, progress_bar=False)
    assert seen["ctx"].device == CUDA0
    assert resolve_device(None) == CUDA0


def test_device_cpu_reaches_the_engine(fake_cuda, monkeypatch):
    seen = _capture_engine_ctx(monkeypatch)
    with pytest.raises(_EngineBuilt):
        kiln.Trainer(_model(), criterion=nn.CrossEntropyLoss(), device="cpu", max_duration=1, progress_bar=False)
    assert seen["ctx"].device == CPU
    assert kiln.context().device == CUDA0  # the launch's context itself is left as it was


@pytest.mark.parametrize(
    "device, expected",
    [
        ("cpu", CPU),
        (CPU, CPU),
        ("gpu", CUDA0),
        ("cuda", CUDA0),
        ("cuda:1", CUDA1),
        (CUDA1, CUDA1),
        (None, CUDA0),
        ("GPU", CUDA0),
        ("CPU", CPU),
    ],
)
def test_resolve_device_with_cuda(fake_cuda, device, expected):
    assert resolve_device(device) == expected


def test_gpu_means_this_ranks_gpu(fake_cuda):
    ctx = Context(rank=3, world_size=4, local_rank=3, device=CUDA1, backend="nccl")
    assert resolve_device("gpu", ctx) == CUDA1 and resolve_device("cuda", ctx) == CUDA1


@pytest.mark.parametrize("device", ["gpu", "cuda", "cuda:0", CUDA0])
def test_gpu_without_cuda_is_a_clear_error(monkeypatch, device):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device=.*(gpu|cuda).*CUDA is not available"):
        kiln.Trainer(_model(), criterion=nn.CrossEntropyLoss(), device=device, max_duration=1, progress_bar=False)


@pytest.mark.parametrize(
    "device, message",
    [
        ("tpu", "device='tpu' is not a device"),
        ("meta", "device='meta' is not supported"),
        (3, "device=3 is not a device"),
        ("cuda:7", "names GPU 7, but this machine has 2"),
    ],
)
def test_bad_devices(fake_cuda, device, message):
    with pytest.raises(ValueError, match=message):
        resolve_device(device)


def test_cpu_under_an_nccl_group_is_refused(fake_cuda):
    _set_context(Context(rank=1, world_size=2, local_rank=1, device=CUDA1, backend="nccl"))
    with pytest.raises(ValueError, match="device='cpu' trains on the CPU, but the process group's backend is nccl"):
        kiln.Trainer(_model(), criterion=nn.CrossEntropyLoss(), device="cpu", max_duration=1, progress_bar=False)


def test_cpu_under_a_gloo_group_is_fine(fake_cuda):
    ctx = Context(rank=1, world_size=2, local_rank=1, device=CUDA1, backend="gloo")
    assert resolve_device("cpu", ctx) == CPU
    assert resolve_device(None, ctx) == CUDA1


def test_engine_form_refuses_a_different_device(fake_cuda):
    _set_context(Context(device=CPU))
    model = _model()
    engine = kiln.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match=r"device='cuda' differs from the device of the engine= given \(cpu\)"):
        kiln.Trainer(engine=engine, device="cuda", max_duration=1, progress_bar=False)
    assert kiln.Trainer(engine=engine, device="cpu", max_duration=1, progress_bar=False).engine is engine


def test_device_cpu_gives_the_same_losses_as_before():
    """On a CPU machine, device='cpu' and device=None are the same run, bit for bit."""

    def losses(device):
        seen = []

        class Record(kiln.Callback):
            def batch_end(self, state, logger):
                seen.append(state.loss.item())

        model = _model()
        kiln.Trainer(
            model,
            criterion=nn.CrossEntropyLoss(),
            device=device,
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            train_dataloader=_loader(),
            max_duration="2ep",
            callbacks=Record(),
            progress_bar=False,
        ).fit()
        return seen

    if torch.cuda.is_available():
        pytest.skip("device=None trains on the GPU here")
    assert losses("cpu") == losses(None)
