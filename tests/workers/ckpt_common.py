"""Small builders shared by the checkpoint tests: a State + Engine by hand, a loop, comparisons."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn

import kiln
from kiln.launch.data import ResumableSampler


class Counter(kiln.Callback):
    """A callback with state that must survive a resume."""

    def __init__(self):
        self.seen = 0

    def batch_checkpoint(self, state, logger):
        self.seen += 1

    def state_dict(self):
        return {"seen": self.seen, "history": [self.seen] * 2}

    def load_state_dict(self, sd):
        self.seen = sd["seen"]


class Noise(kiln.Algorithm):
    """Draws from python's, numpy's and torch's global RNGs, as careless user code does."""

    def __init__(self):
        self.calls = 0

    def match(self, event, state):
        return event == kiln.Event.AFTER_DATALOADER

    def apply(self, event, state, logger):
        self.calls += 1
        x, y = state.batch
        state.batch = (x + (0.01 * random.random() + 0.01 * float(np.random.rand())) * torch.randn_like(x), y)

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, sd):
        self.calls = sd["calls"]


def build_state(seed: int = 0, precision: str | None = None, callbacks=(), strategy="auto", width: int = 16):
    """A State with model (dropout), AdamW, a LambdaLR, a Noise algorithm and a shuffled resumable loader."""
    kiln.seed_everything(seed)  # python and numpy too: Noise draws from all three
    model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Dropout(0.2), nn.Linear(width, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    engine = kiln.Engine(model, optimizer, nn.CrossEntropyLoss(), precision=precision, strategy=strategy)
    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randn(48, 8, generator=g), torch.randint(0, 4, (48,), generator=g))
    loader = kiln.ResumableLoader(
        torch.utils.data.DataLoader(data, batch_size=8, sampler=ResumableSampler(data, 1, 0, shuffle=True, seed=3))
    )
    state = kiln.State(
        model, optimizers=[optimizer], schedulers=[scheduler], algorithms=[Noise()], callbacks=list(callbacks)
    )
    state.engine, state.dataloader = engine, loader
    return state


def train(state, num_batches: int, on_batch=None) -> None:
    """Train ``num_batches`` more batches the way the Trainer does, firing the checkpoint events."""
    ts, engine = state.timestamp, state.engine
    target = ts.batch.value + num_batches
    while ts.batch.value < target:
        finished = True
        for batch in state.dataloader:  # sets the epoch, continues a resumed one, restores the RNG
            state.batch = batch
            state.algorithms[0].apply(kiln.Event.AFTER_DATALOADER, state, None)
            x, y = state.batch
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x), y))
            engine.optimizer_step()
            state.schedulers[0].step()
            ts.advance_batch(len(x))
            for cb in state.callbacks:
                cb.run_event(kiln.Event.BATCH_CHECKPOINT, state, None)
            if on_batch is not None:
                on_batch(state)
            if ts.batch.value >= target:
                finished = False
                break
        if finished:
            ts.advance_epoch()
            for cb in state.callbacks:
                cb.run_event(kiln.Event.EPOCH_CHECKPOINT, state, None)


def snapshot(state) -> dict:
    """Everything that must match after an exact resume."""
    from kiln.parallel.state.dcp_state import get_state_dict

    full = get_state_dict(state.engine.model, state.engine.optimizer, full=True)
    return {
        **full,
        "ts": state.timestamp.state_dict(),
        "sched": state.schedulers[0].state_dict(),
        "torch_rng": torch.get_rng_state(),
        "py_rng": random.getstate(),
        "np_rng": np.random.get_state()[1].copy(),
        "calls": state.algorithms[0].calls,
    }


def assert_same(a: dict, b: dict) -> None:
    for section in ("model", "optimizer"):
        assert a[section].keys() == b[section].keys(), section
        for key, value in a[section].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, b[section][key]), f"{section}.{key} differs"
            else:
                assert value == b[section][key], f"{section}.{key} differs"
    wall = ("total_wct", "epoch_wct", "batch_wct")
    assert {k: v for k, v in a["ts"].items() if k not in wall} == {k: v for k, v in b["ts"].items() if k not in wall}
    assert a["sched"] == b["sched"]
    assert torch.equal(a["torch_rng"], b["torch_rng"]) and a["py_rng"] == b["py_rng"]
    assert (a["np_rng"] == b["np_rng"]).all() and a["calls"] == b["calls"]
