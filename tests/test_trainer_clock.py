"""The Trainer's wall-clock fields and the loop's reaction to listeners that change mid-step.

The clock test runs the loop against a fake ``time.perf_counter`` that moves only where the test
says: a batch's fetch costs 0.25 s, a training forward 1 s; an evaluation forward (10 s) and a
``BATCH_END`` callback (100 s) happen outside any batch. So every wall-clock field has one exact
value, and a batch timed twice, a fetch left out or an evaluation counted into a batch fails.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

import kiln
from kiln import Event

FETCH, FORWARD, EVAL_FORWARD, CALLBACK = 0.25, 1.0, 10.0, 100.0
BATCH = FETCH + FORWARD  # what one batch costs on the fake clock


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Timed(nn.Module):
    """A linear layer whose forward costs FORWARD in training and EVAL_FORWARD in evaluation."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.layer, self.clock = nn.Linear(5, 3), clock

    def forward(self, x):
        self.clock.now += FORWARD if self.training else EVAL_FORWARD
        return self.layer(x)


class SlowFetch:
    """An iterable of batches, each fetch costing FETCH on the clock."""

    def __init__(self, batches: list[Any], clock: Clock) -> None:
        self.batches, self.clock = batches, clock

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        for batch in self.batches:
            self.clock.now += FETCH
            yield batch


class Record(kiln.Callback):
    """Records the clocks at each batch end, then spends CALLBACK seconds (outside the batch)."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.seen = clock, []

    def batch_end(self, state, logger):
        ts = state.timestamp
        self.seen.append((ts.epoch.value, ts.batch_in_epoch.value, ts.batch_wct, ts.epoch_wct, ts.total_wct))
        self.clock.now += CALLBACK


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(4, 5, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("listening", [True, False], ids=["callback", "no-listener"])
def test_wall_clock_fields_count_each_batch_from_fetch_to_step_once(listening, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    torch.manual_seed(0)
    net = Timed(clock)
    record = Record(clock)
    trainer = kiln.Trainer(
        net,
        train_dataloader=SlowFetch(_batches(3), clock),
        eval_dataloader=SlowFetch(_batches(2), clock),
        optimizers=torch.optim.SGD(net.parameters(), lr=0.1),
        criterion=nn.CrossEntropyLoss(),
        progress_bar=False,
        callbacks=[record] if listening else [],
        max_duration="2ep",
    )
    trainer.fit()
    ts = trainer.state.timestamp
    assert ts.total_wct == 6 * BATCH  # 2 epochs of 3 batches; evaluation and callbacks outside
    assert ts.epoch_wct == 0.0 and ts.batch_wct == 0.0  # the epoch ended: both start again
    if listening:
        assert record.seen == [
            (epoch, j, BATCH, j * BATCH, (3 * epoch + j) * BATCH) for epoch in range(2) for j in range(1, 4)
        ]
    # A run stopped mid-epoch keeps the epoch's time and the last batch's.
    trainer.fit(duration="2ba")
    ts = trainer.state.timestamp
    assert (ts.batch_wct, ts.epoch_wct, ts.total_wct) == (BATCH, 2 * BATCH, 8 * BATCH)


class Added(kiln.Callback):
    def __init__(self):
        self.seen = []

    def run_event(self, event, state, logger):
        self.seen.append((event, state.timestamp.batch.value))


def test_a_listener_added_in_a_step_hears_that_batch_end_and_a_stop_in_a_step_holds():
    """A model whose third forward adds a callback and whose sixth stops the run: the callback hears
    that batch's end (its forward's events had passed), and the run stops after the sixth batch."""
    torch.manual_seed(0)
    holder: dict[str, Any] = {}

    class Adds(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer, self.calls = nn.Linear(5, 3), 0

        def forward(self, x):
            self.calls += 1
            if self.calls == 3:
                holder["trainer"].events.add(holder["added"])
            if self.calls == 6:
                holder["trainer"].state.stop_training("enough")
            return self.layer(x)

    net = Adds()
    trainer = kiln.Trainer(
        net,
        train_dataloader=_batches(10),
        optimizers=torch.optim.SGD(net.parameters(), lr=0.1),
        criterion=nn.CrossEntropyLoss(),
        progress_bar=False,
        max_duration="2ep",
    )
    holder["trainer"], holder["added"] = trainer, Added()
    trainer.fit()
    seen = holder["added"].seen
    assert seen[:2] == [(Event.BATCH_END, 3), (Event.BATCH_CHECKPOINT, 3)]
    assert (Event.BEFORE_FORWARD, 2) not in seen  # the third batch's forward had begun
    assert (Event.AFTER_DATALOADER, 3) in seen and (Event.BEFORE_FORWARD, 3) in seen  # the fourth batch's
    assert seen[-1] == (Event.FIT_END, 6)
    assert trainer.state.timestamp.batch.value == 6
    assert trainer.engine._num_steps == 6


class MoveTime(kiln.Callback):
    """Composer's scale-schedule check: at ``FIT_START`` it advances ``state.timestamp`` batch by
    batch (Composer's immutable ``to_next_batch``) and steps the scheduler at each milestone."""

    def __init__(self, ssr: float) -> None:
        self.ssr, self.lrs = ssr, []

    def fit_start(self, state, logger):
        scheduler, step = state.schedulers[0], 0
        for target in (int(20 * self.ssr), int(40 * self.ssr), int(60 * self.ssr)):
            while step < target:
                state.timestamp = state.timestamp.to_next_batch()
                step += 1
            scheduler.step()
            self.lrs.append(scheduler.get_last_lr()[0])


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")
@pytest.mark.parametrize("ssr", [0.5, 1.0])
def test_a_timestamp_a_callback_sets_at_fit_start_is_where_training_continues(ssr):
    torch.manual_seed(0)
    net = nn.Linear(5, 3)
    trainer = kiln.Trainer(
        net,
        train_dataloader=_batches(8),
        optimizers=torch.optim.SGD(net.parameters(), lr=1.0),
        criterion=nn.CrossEntropyLoss(),
        schedulers=[kiln.optim.MultiStepScheduler(milestones=["30ba", "50ba"], gamma=0.1)],
        scale_schedule_ratio=ssr,
        max_duration="10ep",
        progress_bar=False,
    )
    moved = MoveTime(ssr)
    trainer.state.callbacks.append(moved)  # as Composer's test adds it, after construction
    trainer.fit()
    assert moved.lrs == pytest.approx([1.0, 0.1, 0.01])
    ts, epochs = trainer.state.timestamp, int(10 * ssr)
    moved_by = int(60 * ssr)
    # the moved clock goes on: the first epoch's batches count from there, then whole epochs
    assert (ts.epoch.value, ts.batch.value) == (epochs, moved_by + 8 * epochs)
    assert trainer.engine._num_steps == 8 * epochs
    assert ts.sample.value == 4 * 8 * epochs  # to_next_batch() moved no samples
