"""``strategy="auto"`` under the Trainer measures activations on the training loader's first
microbatch, read without moving the loader: the plan counts activations, and the run's losses,
data order and random draws are those of the same run under the strategy ``auto`` picks.

One process: an ``Auto`` object plans on a world of 1 as it does on more (``"auto"`` by name is
``single`` there, with nothing to plan).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import kiln
from kiln.cost.auto import Auto, peek_first_batch


class NoisyDigits(Dataset):
    """64 samples of 16 features; each read adds fresh noise from torch's generator (an augmentation)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(16), self.y[i]


class Net(kiln.Model):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 4)])
        self.drop = nn.Dropout(0.3)

    def forward(self, batch: Any) -> torch.Tensor:
        h = batch[0]
        for layer in self.layers[:-1]:
            h = self.drop(torch.relu(layer(h)))
        return self.layers[-1](h)

    def loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        return nn.functional.cross_entropy(outputs, batch[1])


class Losses(kiln.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def batch_end(self, state: Any, logger: Any) -> None:
        self.values.append(state.loss.item())


def _run(strategy: Any, model: nn.Module | None = None, **kwargs: Any) -> tuple[kiln.Trainer, list[float]]:
    torch.manual_seed(0)
    model = model or Net()
    losses = Losses()
    loader = DataLoader(NoisyDigits(), batch_size=8, shuffle=True)
    trainer = kiln.Trainer(
        model,
        train_dataloader=loader,
        max_duration="6ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        strategy=strategy,
        callbacks=[losses],
        progress_bar=False,
        seed=0,
        **kwargs,
    )
    trainer.fit()
    return trainer, losses.values


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_auto_counts_the_first_microbatchs_activations_and_leaves_the_run_as_it_was(grad_accum):
    auto = Auto(memory_budget=1e12)
    trainer, losses = _run(auto, grad_accum=grad_accum)
    assert auto.chosen is not None and auto.chosen.name == "single"
    assert auto.example_input is not None and auto.example_input[0].shape == (8 // grad_accum, 16)
    assert auto.table and all(row.activations > 0 for row in auto.table), auto.table
    # the same run under the strategy auto picked: the peek drew nothing and moved nothing
    _, plain = _run("single", grad_accum=grad_accum)
    assert losses == plain


def test_a_plain_module_gets_the_inputs_of_its_batch():
    auto = Auto(memory_budget=1e12)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    _, losses = _run(auto, model=model, criterion=nn.CrossEntropyLoss())
    (inputs,) = auto.example_input  # (inputs,): the forward takes the inputs alone
    assert inputs.shape == (8, 16) and all(row.activations > 0 for row in auto.table)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    assert losses == _run("single", model=model, criterion=nn.CrossEntropyLoss())[1]


def test_an_example_the_user_gave_is_kept():
    mine = (torch.randn(3, 16), torch.zeros(3, dtype=torch.long))
    auto = Auto(memory_budget=1e12, example_input=mine)
    _run(auto)
    assert auto.example_input is mine


def test_peeking_leaves_the_loader_and_the_generators_alone():
    import random

    loader = DataLoader(NoisyDigits(), batch_size=8, shuffle=True)
    torch.manual_seed(1)
    random.seed(1)
    state, py_state = torch.get_rng_state(), random.getstate()
    x, y = peek_first_batch(loader)
    assert x.shape == (8, 16) and y.shape == (8,)
    assert torch.equal(torch.get_rng_state(), state) and random.getstate() == py_state
    batches = [[torch.ones(2, 3)], [torch.zeros(2, 3)]]
    assert peek_first_batch(batches) is batches[0]
    assert peek_first_batch(iter(batches)) is None  # an iterator cannot be peeked without moving it


@pytest.mark.world_size(2)
def test_auto_by_name_on_two_ranks(tmp_path):
    """``strategy="auto"`` (a name: on one rank it is ``single``) plans with activations, and trains
    as the strategy it chose does, loss for loss."""
    import json

    from distributed import WORKERS, check, fork_run

    check(fork_run(WORKERS / "auto_example_worker.py", str(tmp_path), nproc=2, timeout=240))
    result = json.loads((tmp_path / "auto.json").read_text())
    assert result["table"] and all(row["activations"] > 0 for row in result["table"]), result
    assert result["auto"] == result["plain"] and len(result["auto"]) == 6


def test_an_estimate_that_cannot_run_on_the_loaders_batch_does_not_stop_the_run(monkeypatch, caplog):
    import kiln.cost.auto as auto_module

    def fails(*args, **kwargs):
        if args[4] is not None:  # only with an example: the estimate's forward
            raise RuntimeError("this forward wants something else")
        return real(*args, **kwargs)

    real = auto_module.plan_table
    monkeypatch.setattr(auto_module, "plan_table", fails)
    auto = Auto(memory_budget=1e12)
    _, losses = _run(auto)
    assert len(losses) == 6 and all(row.activations == 0 for row in auto.table)
    mine = Auto(memory_budget=1e12, example_input=(torch.randn(3, 16), torch.zeros(3, dtype=torch.long)))
    with pytest.raises(RuntimeError, match="wants something else"):  # the user's own example: their error to see
        _run(mine)
