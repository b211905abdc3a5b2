"""Colossal-AI hooks on the Trainer: order by priority, LR stepping, metric values, the Colossal form.

All in this process; their walkthrough on 2 processes is in tests/test_examples.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kiln
from kiln import hooks


def _setup(accum=1, batches=4, bs=8):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batches * bs, 6, generator=g)
    y = (x[:, 0] > 0).long()
    ds = torch.utils.data.TensorDataset(x, y)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    engine, train_dl, test_dl, _ = kiln.initialize(
        model,
        opt,
        nn.CrossEntropyLoss(),
        torch.utils.data.DataLoader(ds, batch_size=bs),
        torch.utils.data.DataLoader(ds, batch_size=bs),
        config={"gradient_accumulation": accum},
    )
    return engine, train_dl, test_dl, ds


class Tracer(hooks.BaseHook):
    def __init__(self, name, log, priority):
        super().__init__(priority)
        self.name, self.log = name, log

    def before_train(self, trainer):
        self.log.append((self.name, "before_train"))

    def after_train_iter(self, trainer, output, label, loss):
        self.log.append((self.name, "after_train_iter"))

    def after_test(self, trainer):
        self.log.append((self.name, "after_test"))


def test_priorities_order_calls_lower_first():
    engine, train_dl, test_dl, _ = _setup(batches=1)
    log = []
    trainer = kiln.Trainer(engine=engine, logger=kiln.get_dist_logger())
    trainer.fit(
        train_dataloader=train_dl,
        epochs=1,
        test_dataloader=test_dl,
        hooks=[Tracer("late", log, 20), Tracer("early", log, 0), Tracer("mid", log, 5)],
        display_progress=False,
    )
    assert log == [(n, e) for e in ("before_train", "after_train_iter", "after_test") for n in ("early", "mid", "late")]


@pytest.mark.parametrize("by_epoch,expected_steps", [(True, 3), (False, 12)])
def test_lr_scheduler_hook_by_epoch_and_by_step(by_epoch, expected_steps):
    engine, train_dl, _, _ = _setup()
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
    trainer = kiln.Trainer(engine=engine)
    hook = hooks.LRSchedulerHook(sched, by_epoch=by_epoch)
    trainer.fit(train_dataloader=train_dl, epochs=3, hooks=[hook], display_progress=False)
    assert sched.last_epoch == expected_steps
    assert trainer.states["metrics"]["train"]["LR"].get_accumulated_value() == pytest.approx(0.2 * 0.5**expected_steps)


def test_accuracy_and_loss_hooks_equal_hand_computation():
    engine, train_dl, test_dl, ds = _setup()
    trainer = kiln.Trainer(engine=engine)

    def count_correct(output, label):  # Colossal-AI's Accuracy returns the number correct
        return (output.argmax(-1) == label).sum()

    hook_list = [hooks.LossHook(), hooks.AccuracyHook(accuracy_func=count_correct)]
    trainer.fit(train_dataloader=train_dl, epochs=2, test_dataloader=test_dl, hooks=hook_list, display_progress=False)
    x, y = ds.tensors
    with torch.no_grad():
        out = engine.module(x)
    expected_acc = (out.argmax(-1) == y).float().mean().item()
    per_batch = [nn.functional.cross_entropy(out[i : i + 8], y[i : i + 8]).item() for i in range(0, 32, 8)]
    test = trainer.states["metrics"]["test"]
    assert test["Accuracy"].get_accumulated_value() == pytest.approx(expected_acc, abs=1e-7)
    assert test["Loss"].get_accumulated_value() == pytest.approx(sum(per_batch) / 4, rel=1e-5)


def test_accuracy_hook_with_torchmetrics_accuracy():
    engine, train_dl, test_dl, ds = _setup()
    trainer = kiln.Trainer(engine=engine)
    hook = hooks.AccuracyHook(accuracy_func=kiln.metrics.Accuracy())
    trainer.fit(train_dataloader=train_dl, epochs=1, test_dataloader=test_dl, hooks=[hook], display_progress=False)
    x, y = ds.tensors
    with torch.no_grad():
        expected = (engine.module(x).argmax(-1) == y).float().mean().item()
    assert hook.metric.get_accumulated_value() == pytest.approx(expected, abs=1e-7)


def test_engine_gradient_accumulation_is_honoured_by_the_trainer():
    engine, train_dl, _, _ = _setup(accum=2)
    trainer = kiln.Trainer(engine=engine)
    before = [p.detach().clone() for p in engine.module.parameters()]
    trainer.fit(train_dataloader=train_dl, duration="1ba", display_progress=False)
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))  # 1 of 2 micro-steps
    trainer.fit(duration="1ba")
    assert not all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))


def test_log_metric_by_epoch_hook_output(capsys):
    engine, train_dl, test_dl, _ = _setup()
    logger = kiln.get_dist_logger()
    trainer = kiln.Trainer(engine=engine, logger=logger)
    trainer.fit(
        train_dataloader=train_dl,
        epochs=1,
        test_dataloader=test_dl,
        hooks=[hooks.LossHook(), hooks.LogMetricByEpochHook(logger)],
        display_progress=False,
    )
    out = capsys.readouterr().out
    assert "[Epoch 1 / Train]: Loss = " in out and "[Epoch 1 / Test]: Loss = " in out


def test_tensorboard_hook_writes_event_files(tmp_path):
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    engine, train_dl, test_dl, _ = _setup()
    trainer = kiln.Trainer(engine=engine)
    trainer.fit(
        train_dataloader=train_dl,
        epochs=2,
        test_dataloader=test_dl,
        hooks=[hooks.LossHook(), hooks.TensorboardHook(str(tmp_path))],
        display_progress=False,
    )
    acc = ea.EventAccumulator(str(tmp_path / "rank0"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("Loss/train")] == [1, 2]
    assert len(acc.Scalars("Loss/train_step")) == 8


# The trainer walkthrough (examples/trainer_digits.py: these hooks on 2 processes, to 95%) runs in
# tests/test_examples.py, in the one job of the walkthroughs.
