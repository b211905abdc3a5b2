"""Tests for kiln.callbacks on a hand-built State and a real Logger over a recording destination."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
from torch import nn

import kiln.callbacks as C
from kiln.callbacks.device_flops import device_family, peak_flops_per_sec
from kiln.core.event import Event
from kiln.core.state import State
from kiln.loggers.destination import LoggerDestination
from kiln.loggers.logger import Logger


class Recorder(LoggerDestination):
    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[dict[str, Any], int | None]] = []
        self.texts: list[str] = []

    def log_metrics(self, metrics, step=None):
        self.metrics.append((metrics, step))

    def log_text(self, text, step=None):
        self.texts.append(text)

    def last(self, key):
        return [m[key] for m, _ in self.metrics if key in m][-1]


def make(**kwargs: Any) -> tuple[State, Logger, Recorder]:
    model = kwargs.pop("model", None) or nn.Linear(2, 2)
    state = State(model, optimizers=kwargs.pop("optimizers", [torch.optim.SGD(model.parameters(), lr=0.1)]), **kwargs)
    recorder = Recorder()
    return state, Logger(recorder, rank=0, state=state), recorder


def fire(callback, event, state, logger):
    callback.run_event(event, state, logger)


def train_batch(callbacks, state, logger, samples=4, tokens=0, duration=0.5, loss=1.0):
    """One batch as the loop runs it: AFTER_LOSS, count the batch, BATCH_END."""
    state.loss = torch.tensor(loss) if not isinstance(loss, torch.Tensor) else loss
    for cb in callbacks:
        fire(cb, Event.AFTER_LOSS, state, logger)
    state.timestamp.advance_batch(samples=samples, tokens=tokens, duration=duration)
    for cb in callbacks:
        fire(cb, Event.BATCH_END, state, logger)


def test_package_surface():
    assert set(C.__all__) >= {
        "SpeedMonitor",
        "MemoryMonitor",
        "LRMonitor",
        "EarlyStopper",
        "ThresholdStopper",
        "NaNMonitor",
        "CheckpointSaver",
    }
    import kiln.checkpoint as checkpoint

    assert C.CheckpointSaver is checkpoint.CheckpointSaver


# --- SpeedMonitor --------------------------------------------------------------------------------


def test_speed_monitor_rates_over_the_window():
    state, logger, rec = make(world_size=2)
    speed = C.SpeedMonitor(window_size=2)
    fire(speed, Event.FIT_START, state, logger)
    for duration in (1.0, 0.5, 0.25, 0.25):  # the timestamp counts both ranks' 8 samples
        train_batch([speed], state, logger, samples=16, tokens=160, duration=duration)
    # The last two batches took 0.5 s together: 4 batches/s, 32 samples/s, 320 tokens/s on this rank.
    assert rec.last("throughput/batches_per_sec") == pytest.approx(4.0)
    assert rec.last("throughput/device/samples_per_sec") == pytest.approx(32.0)
    assert rec.last("throughput/device/tokens_per_sec") == pytest.approx(320.0)
    assert rec.last("throughput/samples_per_sec") == pytest.approx(64.0)  # both ranks: the run's rate
    assert rec.last("throughput/tokens_per_sec") == pytest.approx(640.0)
    assert rec.metrics[0][0]["throughput/batches_per_sec"] == pytest.approx(1.0)  # logged from the first batch
    assert [step for _, step in rec.metrics] == [1, 2, 3, 4]
    assert all("throughput/mfu" not in m for m, _ in rec.metrics)  # no flops_per_batch: no MFU


def test_speed_monitor_mfu_from_flops_per_batch():
    model = nn.Linear(2, 2)
    model.flops_per_batch = lambda batch: 6 * batch.shape[0]  # callable(batch)
    state, logger, rec = make(model=model)
    speed = C.SpeedMonitor(window_size=10, peak_flops_per_sec=100.0)
    fire(speed, Event.FIT_START, state, logger)
    state.batch = torch.zeros(5, 2)
    train_batch([speed], state, logger, duration=0.5)
    assert rec.last("throughput/device/flops_per_sec") == pytest.approx(60.0)
    assert rec.last("throughput/mfu") == pytest.approx(0.6)
    model.flops_per_batch = 20  # an int works as well
    train_batch([speed], state, logger, duration=0.5)
    assert rec.last("throughput/device/flops_per_sec") == pytest.approx(50.0)
    # CPU: peak unknown, so FLOP/s but no MFU.
    state2, logger2, rec2 = make(model=model)
    speed2 = C.SpeedMonitor()
    fire(speed2, Event.FIT_START, state2, logger2)
    train_batch([speed2], state2, logger2)
    assert "throughput/device/flops_per_sec" in rec2.metrics[-1][0] and "throughput/mfu" not in rec2.metrics[-1][0]


def test_speed_monitor_without_fit_start_and_bad_window():
    state, logger, rec = make()
    speed = C.SpeedMonitor()
    train_batch([speed], state, logger)  # opens the window only
    train_batch([speed], state, logger, samples=2, duration=0.25)
    assert rec.metrics == [
        (
            {
                "throughput/batches_per_sec": 4.0,
                "throughput/samples_per_sec": 8.0,
                "throughput/device/samples_per_sec": 8.0,
            },
            2,
        )
    ]
    with pytest.raises(ValueError, match="window_size"):
        C.SpeedMonitor(window_size=0)


@pytest.mark.parametrize(
    "name, family",
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA GH200 480GB", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA A100 80GB PCIe", "a100"),
        ("NVIDIA A10G", "a10"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA L4", "l4"),
        ("Tesla V100-SXM2-16GB", "v100-sxm"),
        ("Tesla V100-PCIE-32GB", "v100-pcie"),
        ("Tesla T4", "t4"),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_device_family(name, family):
    assert device_family(name) == family


def test_peak_flops_unknown_on_cpu():
    assert peak_flops_per_sec("cpu", torch.bfloat16) is None


# --- MemoryMonitor, LRMonitor ----------------------------------------------------------------------


def test_memory_monitor_reports_rss_on_cpu_every_interval():
    state, logger, rec = make()
    memory = C.MemoryMonitor(interval=2)
    for _ in range(4):
        train_batch([memory], state, logger)
    assert [step for _, step in rec.metrics] == [2, 4]
    report = rec.metrics[-1][0]
    # Both in GB (a Python process with torch holds 0.1-10 GB); the kernel's high-water mark lags a little.
    assert 0.01 < report["memory/current_rss_mem"] < 100 and 0.01 < report["memory/peak_rss_mem"] < 100
    with pytest.raises(ValueError, match="interval"):
        C.MemoryMonitor(interval=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_memory_monitor_reports_cuda_allocator_stats():
    state, logger, rec = make(device=torch.device("cuda"))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    keep = torch.empty(2**20, device="cuda")  # 4 MiB: a multiple of the allocator's 512-byte blocks
    train_batch([C.MemoryMonitor()], state, logger)
    report = rec.metrics[-1][0]
    # The allocator's own numbers, in GB: nothing was allocated or freed since the monitor read them.
    assert report["memory/current_allocated_mem"] * 1e9 == pytest.approx(before + 2**22, abs=1)
    assert report["memory/current_allocated_mem"] * 1e9 == pytest.approx(torch.cuda.memory_allocated(), abs=1)
    assert report["memory/peak_allocated_mem"] * 1e9 == pytest.approx(torch.cuda.max_memory_allocated(), abs=1)
    assert report["memory/current_reserved_mem"] * 1e9 == pytest.approx(torch.cuda.memory_reserved(), abs=1)
    assert report["memory/peak_reserved_mem"] * 1e9 == pytest.approx(torch.cuda.max_memory_reserved(), abs=1)
    assert report["memory/peak_allocated_mem"] * 1e9 == pytest.approx(before + 2**22, abs=1)  # peak reset above
    assert report["memory/alloc_retries"] == torch.cuda.memory_stats()["num_alloc_retries"]
    del keep


def test_lr_monitor_names_every_group():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    sgd = torch.optim.SGD([{"params": a.weight}, {"params": a.bias, "lr": 0.5}], lr=0.1)
    adam1, adam2 = torch.optim.Adam(b.parameters(), lr=0.01), torch.optim.Adam([b.weight], lr=0.02)
    state, logger, rec = make(optimizers=[sgd, adam1, adam2])
    train_batch([C.LRMonitor()], state, logger)
    assert rec.metrics == [
        (
            {
                "lr-SGD/group0": 0.1,
                "lr-SGD/group1": 0.5,
                "lr-Adam/group0": 0.01,
                "lr-Adam-1/group0": 0.02,
                "train/lr": 0.1,
            },
            1,
        )
    ]


# --- EarlyStopper, ThresholdStopper --------------------------------------------------------------


def run_epochs(callbacks, values, key="eval/Accuracy", max_epochs=20):
    """Epochs with an eval after each; values[i] is the metric after epoch i+1 (the last repeats)."""
    state, logger, _ = make()
    for epoch in range(max_epochs):
        train_batch(callbacks, state, logger)
        state.timestamp.advance_epoch()
        for cb in callbacks:
            fire(cb, Event.EPOCH_END, state, logger)
        state.metrics[key] = values[min(epoch, len(values) - 1)]
        for cb in callbacks:
            fire(cb, Event.EVAL_END, state, logger)
        if state.stopped:
            break
    return state


@pytest.mark.parametrize(
    "values, patience, stop_epoch",
    [
        ([0.5, 0.6], 1, 4),  # best at epoch 2; epochs 3 and 4 do not improve; 4 - 2 > 1
        ([0.5, 0.6], 3, 6),
        ([0.5, 0.6, 0.7, 0.7, 0.8, 0.8], 2, 8),
        ([0.5, 0.6], "2ep", 5),
    ],
)
def test_early_stopper_stops_at_the_expected_epoch(values, patience, stop_epoch):
    state = run_epochs([C.EarlyStopper("Accuracy", patience=patience)], values)
    assert state.stopped and state.timestamp.epoch.value == stop_epoch
    assert "eval/Accuracy" in state.stop_reason and f"epoch {stop_epoch}" in state.stop_reason


def test_early_stopper_modes_and_min_delta():
    # "loss" means lower is better: 0.9 -> 0.5 improves, then it rises.
    assert run_epochs([C.EarlyStopper("loss")], [0.9, 0.5, 0.6], key="eval/loss").timestamp.epoch.value == 4
    # mode="min" on an accuracy: the first value is the best, so stop at epoch 3.
    assert run_epochs([C.EarlyStopper("Accuracy", mode="min")], [0.5, 0.6, 0.7]).timestamp.epoch.value == 3
    # Improvements of 0.01 are below min_delta=0.05: best stays at epoch 1.
    values = [0.50, 0.51, 0.52, 0.53]
    assert run_epochs([C.EarlyStopper("eval/Accuracy", min_delta=0.05)], values).timestamp.epoch.value == 3
    assert run_epochs([C.EarlyStopper("Accuracy", comp="lt")], [0.5, 0.6]).timestamp.epoch.value == 3
    with pytest.raises(ValueError, match="mode"):
        C.EarlyStopper("Accuracy", mode="up")
    with pytest.raises(ValueError, match="epochs or batches"):
        C.EarlyStopper("Accuracy", patience="100sp")


def test_early_stopper_batch_patience_on_train_metric_and_resume():
    state, logger, _ = make()
    stopper = C.EarlyStopper("loss", dataloader_label="train", patience="3ba")
    losses = [1.0, 0.8, 0.7, 0.75, 0.71, 0.72, 0.9]
    for value in losses:
        state.metrics["train/loss"] = value
        train_batch([stopper], state, logger)
        if state.stopped:
            break
    assert state.timestamp.batch.value == 7  # best at batch 3; 7 - 3 > 3
    # The checkpointed state carries over: a new stopper picks up the best value and when it was.
    saved = stopper.state_dict()
    assert saved == {"best": 0.7, "best_epoch": 0, "best_batch": 3}
    resumed = C.EarlyStopper("loss", dataloader_label="train", patience="3ba")
    resumed.load_state_dict(saved)
    assert resumed.state_dict() == saved


def test_early_stopper_missing_metric_names_what_is_there():
    state, logger, _ = make()
    state.metrics = {"eval/loss": 0.3}
    with pytest.raises(KeyError, match=r"'eval/Accuracy'.*eval/loss"):
        fire(C.EarlyStopper("Accuracy"), Event.EVAL_END, state, logger)


def test_early_stopper_nan_never_improves_but_is_replaced():
    assert run_epochs([C.EarlyStopper("Accuracy")], [0.5, math.nan]).timestamp.epoch.value == 3
    assert run_epochs([C.EarlyStopper("Accuracy")], [math.nan, 0.5, 0.6]).timestamp.epoch.value == 5


def test_threshold_stopper():
    state = run_epochs([C.ThresholdStopper("Accuracy", "eval", threshold=0.9)], [0.5, 0.8, 0.95, 0.97])
    assert state.timestamp.epoch.value == 3 and "0.95" in state.stop_reason
    assert (
        run_epochs([C.ThresholdStopper("loss", "eval", 0.2)], [0.5, 0.3, 0.1], key="eval/loss").timestamp.epoch.value
        == 3
    )
    # Strict by default: reaching 1.0 is not passing it; comp="ge" stops there.
    assert not run_epochs([C.ThresholdStopper("Accuracy", "eval", 1.0)], [0.5, 1.0], max_epochs=4).stopped
    assert run_epochs([C.ThresholdStopper("Accuracy", "eval", 1.0, comp="ge")], [0.5, 1.0]).timestamp.epoch.value == 2
    state, logger, _ = make()
    stopper = C.ThresholdStopper("loss", "train", 0.5, stop_on_batch=True)
    for value in (0.9, 0.7, 0.4, 0.3):
        state.metrics["train/loss"] = value
        train_batch([stopper], state, logger)
        if state.stopped:
            break
    assert state.timestamp.batch.value == 3
    with pytest.raises(ValueError, match="unknown comparison"):
        C.ThresholdStopper("loss", "train", 0.5, comp="bigger")


# --- NaNMonitor -------------------------------------------------------------------------------


def test_nan_monitor_names_the_batch():
    state, logger, _ = make()
    monitor = C.NaNMonitor()
    train_batch([monitor], state, logger, loss=1.0)
    train_batch([monitor], state, logger, loss=0.5)
    with pytest.raises(C.NonFiniteLossError, match=r"not finite \(nan\) at batch 3 \(batch 3 of epoch 1\)"):
        train_batch([monitor], state, logger, loss=math.nan)


def test_nan_monitor_deferred_check_still_names_the_first_bad_batch():
    state, logger, _ = make()
    monitor = C.NaNMonitor(check_interval=4)
    for loss in (1.0, math.inf, math.nan):  # batches 1-3: nothing read back yet
        train_batch([monitor], state, logger, loss=loss)
    with pytest.raises(C.NonFiniteLossError, match=r"\(inf\) at batch 2 "):
        train_batch([monitor], state, logger, loss=1.0)


def test_nan_monitor_records_without_host_syncs(monkeypatch):
    """AFTER_LOSS must not read a tensor back: that would be a host sync every step on a GPU."""
    state, logger, _ = make()
    monitor = C.NaNMonitor(check_interval=100)
    state.loss = torch.tensor(math.nan)

    def refuse(*args, **kwargs):
        raise AssertionError("host sync in AFTER_LOSS")

    with monkeypatch.context() as m:
        for name in ("item", "__bool__", "tolist", "__float__", "__int__"):
            m.setattr(torch.Tensor, name, refuse)
        fire(monitor, Event.AFTER_LOSS, state, logger)
    state.timestamp.advance_batch(samples=1)
    with pytest.raises(C.NonFiniteLossError, match="batch 1"):
        fire(monitor, Event.FIT_END, state, logger)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nan_monitor_does_not_synchronise_cuda_in_after_loss():
    state, logger, _ = make(device=torch.device("cuda"))
    monitor = C.NaNMonitor()
    losses = [torch.tensor(v, device="cuda") for v in (1.0, math.nan, 2.0)]
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
    try:
        for loss in losses:
            state.loss = loss
            fire(monitor, Event.AFTER_LOSS, state, logger)
            state.timestamp.advance_batch(samples=1)
            fire(monitor, Event.BATCH_END, state, logger)  # interval 10 on CUDA: no read yet
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(C.NonFiniteLossError, match=r"\(nan\) at batch 2 "):
        fire(monitor, Event.FIT_END, state, logger)


def test_nan_monitor_microbatches_dict_losses_and_numbers():
    state, logger, _ = make()
    monitor = C.NaNMonitor()
    train_batch([monitor], state, logger)
    for loss in (torch.tensor(1.0), {"ce": torch.tensor(0.5), "aux": torch.tensor([1.0, math.inf])}):
        state.loss = loss  # two microbatches of batch 2
        fire(monitor, Event.AFTER_LOSS, state, logger)
    state.timestamp.advance_batch(samples=4)
    with pytest.raises(C.NonFiniteLossError, match="batch 2"):
        fire(monitor, Event.BATCH_END, state, logger)
    state, logger, _ = make()
    state.loss = float("nan")
    fire(monitor := C.NaNMonitor(), Event.AFTER_LOSS, state, logger)
    state.timestamp.advance_batch(samples=4)
    with pytest.raises(C.NonFiniteLossError, match="batch 1"):
        fire(monitor, Event.BATCH_END, state, logger)


def test_nan_monitor_can_stop_instead_of_raising():
    state, logger, rec = make()
    monitor = C.NaNMonitor(raise_error=False)
    train_batch([monitor], state, logger)
    train_batch([monitor], state, logger, loss=math.nan)
    assert state.stopped and "batch 2" in state.stop_reason
    assert rec.texts == [state.stop_reason]
    fire(monitor, Event.FIT_END, state, logger)  # reported once only
    assert len(rec.texts) == 1
    with pytest.raises(ValueError, match="check_interval"):
        C.NaNMonitor(check_interval=0)


# --- end to end through kiln.Trainer -----------------------------------------------------------


def digits_like(n=64, seed=0):
    """A small linearly separable 4-class problem standing in for digits (64 samples, 16 features)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return torch.utils.data.TensorDataset(x, x[:, :4].argmax(1))


def fit(callbacks, max_duration="6ep", dataset=None, batch_size=64, loggers=(), lr=0.1, **kwargs):
    import kiln
    from kiln import metrics

    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    dataset = dataset or digits_like()
    loader = lambda: torch.utils.data.DataLoader(dataset, batch_size=batch_size)  # noqa: E731
    trainer = kiln.Trainer(
        model,
        train_dataloader=loader(),
        eval_dataloader=loader(),
        max_duration=max_duration,
        optimizers=torch.optim.SGD(model.parameters(), lr=lr),
        criterion=nn.CrossEntropyLoss(),
        eval_metrics={"Accuracy": metrics.Accuracy()},
        progress_bar=False,
        callbacks=callbacks,
        loggers=list(loggers),
        **kwargs,
    )
    trainer.fit()
    return trainer


def test_trainer_early_stopper_stops_at_the_expected_epoch():
    # Full-batch gradient descent on a convex loss: eval loss (on the training set) falls every epoch...
    improving = fit([C.EarlyStopper("loss", patience=1)])
    assert not improving.state.stopped and improving.state.timestamp.epoch.value == 6
    # ...but never by 10, so with min_delta=10 the best stays at epoch 1 and patience 2 ends epoch 4.
    stopped = fit([C.EarlyStopper("loss", patience=2, min_delta=10.0)], max_duration="20ep")
    assert stopped.state.stopped and stopped.state.timestamp.epoch.value == 4
    assert "eval/loss has not improved" in stopped.state.stop_reason
    # A constant kiln.metrics.Accuracy (lr=0: the weights never change): best at epoch 1, stop at 3.
    frozen = fit([C.EarlyStopper("Accuracy", patience=1)], max_duration="20ep", lr=0.0)
    assert frozen.state.timestamp.epoch.value == 3 and "eval/Accuracy" in frozen.state.stop_reason


def test_trainer_nan_monitor_names_the_batch():
    dataset = digits_like()
    dataset.tensors[0][32:40] = math.nan  # batch 5 of 8 samples
    with pytest.raises(C.NonFiniteLossError, match=r"at batch 5 \(batch 5 of epoch 1\)"):
        fit([C.NaNMonitor()], dataset=dataset, batch_size=8)
    with pytest.raises(C.NonFiniteLossError, match=r"at batch 5 "):  # microbatches: AFTER_LOSS twice a batch
        fit([C.NaNMonitor()], dataset=dataset, batch_size=8, grad_accum=2)


def test_trainer_threshold_stopper_and_monitors_log():
    rec = Recorder()
    trainer = fit(
        [C.ThresholdStopper("Accuracy", "eval", 0.5), C.SpeedMonitor(window_size=2), C.LRMonitor(), C.MemoryMonitor()],
        max_duration="30ep",
        loggers=[rec],
    )
    accuracy = trainer.state.metrics["eval/Accuracy"]
    assert trainer.state.stopped and accuracy > 0.5 and trainer.state.timestamp.epoch.value < 30
    keys = {key for metrics, _ in rec.metrics for key in metrics}
    assert {
        "throughput/batches_per_sec",
        "throughput/samples_per_sec",
        "lr-SGD/group0",
        "train/lr",
        "memory/current_rss_mem",
        "eval/Accuracy",
    } <= keys
    assert rec.last("throughput/samples_per_sec") == pytest.approx(64 * rec.last("throughput/batches_per_sec"))


@pytest.mark.world_size(2)
def test_trainer_two_ranks_metrics_and_nan_monitor(tmp_path):
    import json

    import kiln
    from distributed import WORKERS, check, fork_run
    from workers.metrics_trainer import data, eval_trainer, model

    check(fork_run(WORKERS / "metrics_trainer.py", str(tmp_path)))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    single = eval_trainer(model()).eval(torch.utils.data.DataLoader(data(), batch_size=8))
    for result in ranks:
        assert result["eval"] == pytest.approx(single, abs=1e-6)
        assert result["batch"] == 3 and "at batch 3 " in result["stop_reason"]  # both ranks stopped together
    assert "(nan)" in ranks[1]["stop_reason"] and "on another rank" in ranks[0]["stop_reason"]
    assert kiln.context().world_size == 1


@pytest.mark.world_size(2)
def test_stoppers_read_one_train_value_on_every_rank(tmp_path):
    # train/loss is each rank's own loss: a stopper reading it raw would stop ranks at different
    # batches and leave the others waiting in a collective. It reads the mean over ranks.
    from distributed import WORKERS, check, fork_run

    check(fork_run(WORKERS / "stopper_metric.py", str(tmp_path)))
    values = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert values == [{"train": 1.5, "eval": 0.25}] * 2
