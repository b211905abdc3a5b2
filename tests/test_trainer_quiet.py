"""The Trainer's quiet loop: batches that no one listens to inside run without the event checks
(``Trainer._quiet_batches``), and must leave every number where the evented loop leaves it.

Each case trains twice from the same seed: once with no per-batch listener (the quiet loop), once
with a callback that listens to ``AFTER_DATALOADER`` and does nothing (the evented loop), and
compares weights, optimizer state, loss, timestamp counts, the loader's position, the Engine's
step count and what the loggers wrote.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import kiln
from kiln import Event
from kiln.loggers import LoggerDestination
from kiln.trainer.trainer import Trainer


class Listen(kiln.Callback):
    """Listens to one event inside each batch, so the Trainer takes its evented loop."""

    def after_dataloader(self, state, logger):
        pass


class Written(LoggerDestination):
    def __init__(self):
        super().__init__()
        self.rows: list[tuple[int, str, float]] = []

    def log_metrics(self, metrics, step=None):
        self.rows += [(step, name, float(value)) for name, value in sorted(metrics.items())]


class Pairs(kiln.Model):
    """A kiln.Model on dict batches with input_ids, so the timestamp counts tokens too."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, batch):
        return self.head(self.embed(batch["input_ids"]).mean(1))

    def loss(self, outputs, batch):
        return nn.functional.cross_entropy(outputs, batch["label"])


def _pairs(n: int = 10) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        {"input_ids": torch.randint(0, 11, (4, 6), generator=g), "label": torch.randint(0, 3, (4,), generator=g)}
        for _ in range(n)
    ]


def _tuples(n: int = 10, batch: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(batch, 5, generator=g), torch.randint(0, 3, (batch,), generator=g)) for _ in range(n)]


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 5, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long()), batch_size=6)


class OwnLoader(kiln.ResumableLoader):
    """A ResumableLoader of the user's own class: the quiet loop lets it count its batches."""


def _run(evented: bool, data: Any, model: str = "mlp", fits: tuple[Any, ...] = (None,), **kwargs: Any) -> dict:
    data = data() if callable(data) else data
    torch.manual_seed(0)
    net: nn.Module = Pairs() if model == "pairs" else nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    schedulers = kwargs.pop("schedulers", None)
    written = Written()
    trainer = kiln.Trainer(
        net,
        train_dataloader=data,
        optimizers=optimizer,
        schedulers=schedulers(optimizer) if schedulers else None,
        criterion=None if model == "pairs" else nn.CrossEntropyLoss(),
        progress_bar=False,
        callbacks=[Listen()] if evented else [],
        loggers=[written],
        **kwargs,
    )
    for duration in fits:
        trainer.fit(duration=duration)
    state = trainer.state
    counts = {k: v for k, v in state.timestamp.state_dict().items() if not k.endswith("_wct")}
    assert state.timestamp.total_wct > 0 and state.timestamp.total_wct >= state.timestamp.epoch_wct >= 0
    loader = state.dataloader.state_dict()
    return {
        "weights": [p.detach().clone() for p in net.parameters()],
        "momentum": [optimizer.state[p]["momentum_buffer"].clone() for p in net.parameters()],
        "loss": state.loss.detach().clone(),
        "train/loss": state.metrics["train/loss"].clone(),
        "counts": counts,
        "loader": (loader["epoch"], loader["batch_in_epoch"], loader["sample_in_epoch"]),
        "engine": (trainer.engine._num_steps, trainer.engine._last_call),
        "written": written.rows,
        "lr": optimizer.param_groups[0]["lr"],
    }


def _same(a: dict, b: dict) -> None:
    for key in a:
        if isinstance(a[key], list) and a[key] and isinstance(a[key][0], torch.Tensor):
            assert all(torch.equal(x, y) for x, y in zip(a[key], b[key])), key
        elif isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


CASES = {
    "tuples": dict(data=_tuples(), max_duration="2ep"),
    "dataloader": dict(data=_loader(), max_duration="2ep", log_interval="3ba"),
    "batches, then more mid-epoch": dict(data=_tuples(), max_duration="7ba", fits=(None, "5ba", "1ep")),
    "samples": dict(data=_tuples(), max_duration="45sp"),
    "subset": dict(data=_tuples(), max_duration="3ep", train_subset_num_batches=4),
    # a factory: the loader holds its position, so each run needs its own
    "own ResumableLoader": dict(data=lambda: OwnLoader(_tuples()), max_duration="15ba", fits=(None, "1ep")),
    "kiln.Model, tokens": dict(data=_pairs(), model="pairs", max_duration="2ep"),
    "grad_accum": dict(data=_tuples(), max_duration="2ep", grad_accum=2),
    "clipping": dict(data=_tuples(), max_duration="2ep", clip_grad_norm=0.05),
    "per-batch scheduler": dict(
        data=_tuples(),
        max_duration="2ep",
        schedulers=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)),
        step_schedulers_every_batch=True,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_quiet_loop_matches_the_evented_loop(case, monkeypatch):
    kwargs = CASES[case]
    quiet_calls = []
    original = Trainer._quiet_batches

    def spy(self, *args):
        quiet_calls.append(1)
        return original(self, *args)

    monkeypatch.setattr(Trainer, "_quiet_batches", spy)
    evented = _run(True, **kwargs)
    assert not quiet_calls
    quiet = _run(False, **kwargs)
    assert quiet_calls  # the case ran the quiet loop
    _same(quiet, evented)


def test_direct_step_only_where_the_engine_step_is_plain():
    def trainer(**kw):
        torch.manual_seed(0)
        net = nn.Linear(5, 3)
        return kiln.Trainer(
            net,
            train_dataloader=_tuples(),
            optimizers=torch.optim.SGD(net.parameters(), lr=0.1),
            criterion=nn.CrossEntropyLoss(),
            progress_bar=False,
            max_duration="1ep",
            **kw,
        )

    assert trainer()._direct_step() is not None
    assert trainer(grad_accum=2)._direct_step() is None
    assert trainer(clip_grad_norm=1.0)._direct_step() is None
    assert trainer(device_train_microbatch_size=2)._direct_step() is None
    replaced = trainer()
    replaced.loss_fn = lambda outputs, batch: outputs.sum()
    assert replaced._direct_step() is None


class Added(kiln.Callback):
    def __init__(self, state):
        self.state, self.seen = state, []

    def run_event(self, event, state, logger):
        self.seen.append((event, state.timestamp.batch.value))


def _listener_added_in_forward(evented: bool) -> tuple[list, dict]:
    """A model whose third forward adds a callback: it runs from the next event on, in both loops."""
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
        train_dataloader=_tuples(),
        optimizers=torch.optim.SGD(net.parameters(), lr=0.1),
        criterion=nn.CrossEntropyLoss(),
        progress_bar=False,
        callbacks=[Listen()] if evented else [],
        max_duration="2ep",
    )
    holder["trainer"], holder["added"] = trainer, Added(trainer.state)
    trainer.fit()
    counts = {k: v for k, v in trainer.state.timestamp.state_dict().items() if not k.endswith("_wct")}
    return holder["added"].seen, {"counts": counts, "weights": [p.detach().clone() for p in net.parameters()]}


def test_a_listener_added_in_a_quiet_step_hears_that_batch_end_and_stop_holds():
    seen_evented, evented = _listener_added_in_forward(True)
    seen_quiet, quiet = _listener_added_in_forward(False)
    assert seen_quiet == seen_evented
    assert seen_quiet[:2] == [(Event.BATCH_END, 3), (Event.BATCH_CHECKPOINT, 3)]
    assert (Event.BEFORE_FORWARD, 3) in seen_quiet and seen_quiet[-1] == (Event.FIT_END, 6)
    _same(quiet, evented)
    assert quiet["counts"]["batch"] == 6
