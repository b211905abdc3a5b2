"""MFU without a hand-written FLOP count: SpeedMonitor counts the first batch with torch's
FlopCounterMode (kiln.callbacks.speed_monitor), against the peak table (kiln.callbacks.device_flops)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import kiln
from kiln.callbacks import device_flops
from kiln.callbacks.device_flops import describe_peak, device_family, peak_flops_per_sec
from kiln.callbacks.speed_monitor import SpeedMonitor, TrainingFlopCounter
from kiln.loggers.destination import LoggerDestination

DIMS = (32, 64, 48, 8)
BATCH = 16


class Recorder(LoggerDestination):
    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, Any]] = []

    def log_metrics(self, metrics, step=None):
        if any(key.startswith("throughput/") for key in metrics):
            self.metrics.append(dict(metrics))


class Stack(nn.Module):
    """Linear layers with tanh between; ``checkpointed`` recomputes the middle ones in the backward."""

    def __init__(self, checkpointed: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(DIMS, DIMS[1:]))
        self.checkpointed, self.dropout = checkpointed, nn.Dropout(dropout)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if self.checkpointed and 0 < i < len(self.layers) - 1:
                x = checkpoint(lambda t, f=layer: torch.tanh(f(t)), x, use_reentrant=False)
            else:
                x = self.dropout(torch.tanh(layer(x)))
        return x


def closed_form(batch: int = BATCH) -> int:
    """Forward 2*B*in*out per layer; backward the same for the weight's gradient and, except for the
    first layer (its input needs no gradient), again for the input's."""
    return sum(2 * batch * a * b * (2 if i == 0 else 3) for i, (a, b) in enumerate(zip(DIMS, DIMS[1:])))


def _data(num_batches: int = 3, batch: int = BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(batch, DIMS[0], generator=g), torch.randn(batch, DIMS[-1], generator=g))
        for _ in range(num_batches)
    ]


def _fit(model: nn.Module, callbacks=(), grad_accum: int = 1, num_batches: int = 3) -> tuple[list[float], Recorder]:
    torch.manual_seed(1)
    rec = Recorder()
    losses: list[float] = []

    class Losses(kiln.Callback):
        def batch_end(self, state, logger):
            losses.append(float(state.loss.detach()))

    trainer = kiln.Trainer(
        model,
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=nn.MSELoss(),
        train_dataloader=_data(num_batches),
        max_duration=f"{num_batches}ba",
        grad_accum=grad_accum,
        callbacks=[*callbacks, Losses()],
        loggers=[rec],
        progress_bar=False,
    )
    trainer.fit()
    trainer.close()
    return losses, rec


def test_flop_count_of_a_linear_stack_equals_the_closed_form():
    torch.manual_seed(0)
    speed = SpeedMonitor(window_size=10, peak_flops_per_sec=1e12)
    _, rec = _fit(Stack(), [speed])
    assert speed.flops_per_sample * BATCH == closed_form()
    last = rec.metrics[-1]
    # three batches counted at the same FLOPs; the rate and MFU over the window are finite and agree
    assert math.isfinite(last["throughput/mfu"]) and last["throughput/mfu"] > 0
    assert last["throughput/device/flops_per_sec"] == pytest.approx(last["throughput/mfu"] * 1e12)
    assert last["throughput/device/flops_per_sec"] == pytest.approx(
        closed_form() * last["throughput/batches_per_sec"], rel=1e-9
    )


def test_microbatches_count_the_whole_batch():
    torch.manual_seed(0)
    speed = SpeedMonitor(peak_flops_per_sec=1e12)
    _fit(Stack(), [speed], grad_accum=2)
    assert speed.flops_per_sample * BATCH == closed_form()


def test_recomputed_forward_is_not_model_flops():
    torch.manual_seed(0)
    model = Stack(checkpointed=True)
    x = torch.randn(BATCH, DIMS[0])
    with TrainingFlopCounter() as counter:
        model(x).square().mean().backward()
    assert counter.get_total_flops() == closed_form()
    middle = 2 * BATCH * DIMS[1] * DIMS[2]  # the one checkpointed layer's forward, run again in the backward
    assert counter.recomputed_flops == middle


def test_counting_leaves_the_training_alone():
    """The count runs on the real first batch: no extra forward, step or random draw (dropout)."""
    torch.manual_seed(0)
    plain, _ = _fit(Stack(dropout=0.2))
    torch.manual_seed(0)
    counted, _ = _fit(Stack(dropout=0.2), [SpeedMonitor(peak_flops_per_sec=1e12)])
    assert counted == plain


def test_the_models_own_count_wins_and_a_resume_does_not_recount():
    torch.manual_seed(0)
    model = Stack()
    model.flops_per_batch = 1000
    speed = SpeedMonitor(peak_flops_per_sec=1e12)
    _, rec = _fit(model, [speed])
    assert speed.flops_per_sample is None  # nothing counted
    assert rec.metrics[-1]["throughput/device/flops_per_sec"] == pytest.approx(
        1000 * rec.metrics[-1]["throughput/batches_per_sec"]
    )
    saved = SpeedMonitor()
    _fit(Stack(), [saved])
    assert saved.state_dict() == {"flops_per_sample": closed_form() / BATCH}
    resumed = SpeedMonitor(peak_flops_per_sec=1e12)
    resumed.load_state_dict({"flops_per_sample": 123.0})  # as a checkpoint restores it: not counted again
    _, rec = _fit(Stack(), [resumed])
    assert resumed.flops_per_sample == 123.0
    assert rec.metrics[-1]["throughput/device/flops_per_sec"] == pytest.approx(
        123.0 * BATCH * rec.metrics[-1]["throughput/batches_per_sec"]
    )


def test_cpu_reports_flops_and_says_why_there_is_no_mfu():
    torch.manual_seed(0)
    speed = SpeedMonitor()
    _, rec = _fit(Stack(), [speed])
    assert "throughput/mfu" not in rec.metrics[-1] and rec.metrics[-1]["throughput/device/flops_per_sec"] > 0
    assert "unknown device" in speed.peak_note and "peak_flops_per_sec" in speed.peak_note


def test_dtensor_ops_count_this_ranks_shard():
    """Tensor parallel: each rank multiplies its shard; the global shapes would count the group's work."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)  # the conftest destroys it
    mesh = init_device_mesh("cpu", (2,))
    weight = DTensor.from_local(torch.randn(8, 16), mesh, [Shard(0)])  # 16 x 16, colwise
    x = DTensor.from_local(torch.randn(4, 16), mesh, [Replicate()])
    with TrainingFlopCounter() as counter:
        torch.mm(x, weight.t())
    assert counter.get_total_flops() == 2 * 4 * 16 * 8


@pytest.mark.parametrize(
    "name, dtype, peak",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4e12),
        ("NVIDIA H100 80GB HBM3", torch.float16, 989.4e12),
        ("NVIDIA H100 80GB HBM3", torch.float8_e4m3fn, 1978.9e12),
        ("NVIDIA H100 PCIe", torch.float16, 756.5e12),
        ("NVIDIA H200", torch.bfloat16, 989.4e12),
        ("NVIDIA H200", torch.float16, 989.4e12),
        ("NVIDIA H200", torch.float8_e4m3fn, 1978.9e12),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312e12),
        ("NVIDIA A100-SXM4-80GB", torch.float16, 312e12),
        ("NVIDIA A100-PCIE-40GB", torch.bfloat16, 312e12),
        ("NVIDIA A100-SXM4-80GB", torch.float8_e4m3fn, None),  # no FP8 tensor cores
        ("NVIDIA L4", torch.float8_e4m3fn, 242.5e12),
        ("NVIDIA L40S", torch.bfloat16, 362e12),
        ("NVIDIA B200", torch.bfloat16, 2250e12),
        ("NVIDIA B200", torch.float16, 2250e12),
        ("NVIDIA B200", torch.float8_e5m2, 4500e12),
        ("NVIDIA GeForce RTX 4090", torch.bfloat16, None),
    ],
)
def test_peak_table(monkeypatch, name, dtype, peak):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops_per_sec("cuda:0", dtype) == peak
    line = describe_peak("cuda:0", dtype)
    assert ("TFLOP/s" in line) if peak else ("no peak" in line and "peak_flops_per_sec" in line)
    if device_family(name) is None:
        assert "unknown device" in line


@pytest.mark.parametrize(
    "name, given, mfu_peak",
    [
        ("NVIDIA H100 80GB HBM3", None, 989.4e12),  # the table's dense bf16 peak (amp_bf16 below)
        ("NVIDIA GeForce RTX 4090", None, None),  # unknown: no MFU rather than one against a guess
        ("NVIDIA GeForce RTX 4090", 165e12, 165e12),  # ... unless the user gives the peak
    ],
)
def test_mfu_on_a_cuda_device_needs_its_peak(monkeypatch, name, given, mfu_peak):
    from kiln.core.event import Event
    from kiln.core.state import State
    from kiln.loggers.logger import Logger

    kiln.context()  # this process's (CPU) context, made before CUDA is faked: SpeedMonitor logs through it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    model = Stack()
    model.flops_per_batch = 4e12
    state = State(model, precision="amp_bf16", device=torch.device("cuda", 0))
    rec = Recorder()
    logger = Logger(rec, rank=0, state=state)
    speed = SpeedMonitor(peak_flops_per_sec=given)
    speed.run_event(Event.FIT_START, state, logger)
    for _ in range(2):
        state.timestamp.advance_batch(samples=BATCH, duration=0.5)
        speed.run_event(Event.BATCH_END, state, logger)
    last = rec.metrics[-1]
    assert last["throughput/device/flops_per_sec"] == pytest.approx(8e12)  # 4e12 per batch, 2 per second
    if mfu_peak is None:
        assert "throughput/mfu" not in last
        assert "unknown device" in speed.peak_note and "peak_flops_per_sec" in speed.peak_note
    else:
        assert last["throughput/mfu"] == pytest.approx(8e12 / mfu_peak)


def test_every_family_has_bf16_or_fp16():
    assert all({"fp16"} & set(peaks) for peaks in device_flops._PEAK.values())
    assert describe_peak("cpu").startswith("no peak FLOP/s for CPUs")
