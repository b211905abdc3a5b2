"""Algorithms inside kiln.Trainer: a digits run with MixUp + LabelSmoothing + EMA + cosine-with-warmup
reaches 95%, and a run resumed from a mid-epoch checkpoint ends bit-exact with an uninterrupted one."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import kiln
from kiln.algorithms import EMA, SAM, GradientClipping, LabelSmoothing, MixUp, StochasticDepth

pytest.importorskip("sklearn")


def _digits() -> tuple[TensorDataset, TensorDataset]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = order[:360], order[360:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def test_digits_with_mixup_label_smoothing_ema_and_cosine_warmup_reaches_95_percent():
    train, test = _digits()
    model = _mlp()
    ema = EMA(half_life="10ba")
    loader = DataLoader(train, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    trainer = kiln.Trainer(
        model,
        train_dataloader=loader,
        eval_dataloader=DataLoader(test, batch_size=256),
        max_duration="8ep",
        criterion=nn.CrossEntropyLoss(),
        optimizers=torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9, nesterov=True),
        schedulers=kiln.optim.CosineAnnealingWithWarmupScheduler(t_warmup="0.1dur"),
        algorithms=[MixUp(alpha=0.2), LabelSmoothing(0.1), ema],
        eval_metrics={"Accuracy": kiln.metrics.Accuracy(task="multiclass", num_classes=10)},
        eval_interval="4ep",
        seed=0,
        progress_bar=False,
    )
    trainer.fit()
    training_weights = {k: v.clone() for k, v in model.state_dict().items()}
    accuracy = trainer.eval()["eval/Accuracy"]
    assert accuracy >= 0.95, f"test accuracy {accuracy:.3f} with MixUp + LabelSmoothing + EMA"
    assert all(torch.equal(v, training_weights[k]) for k, v in model.state_dict().items()), "EMA swapped back"
    assert not torch.equal(ema.ema_weights["0.weight"], training_weights["0.weight"])


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(x))


def _resnet_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), Block(), Block(), nn.Linear(32, 10))


class StopAt(kiln.Callback):
    def __init__(self, batch: int | None = None) -> None:
        self.batch = batch
        self.started_at: int | None = None

    def fit_start(self, state, logger):
        self.started_at = state.timestamp.batch.value

    def batch_end(self, state, logger):
        if state.timestamp.batch.value == self.batch:
            state.stop_training()


def test_trainer_resume_from_a_mid_epoch_checkpoint_is_bit_exact(tmp_path):
    train, _ = _digits()
    subset = TensorDataset(*train[:256])

    def run(folder, load_path=None, callbacks=()):
        model = _resnet_mlp()
        algorithms = [
            GradientClipping("norm", 1.0),
            SAM(rho=0.05),
            MixUp(alpha=0.4),
            LabelSmoothing(0.1),
            EMA(half_life="3ba"),
            StochasticDepth("Block", drop_rate=0.5),
        ]
        trainer = kiln.Trainer(
            model,
            train_dataloader=DataLoader(subset, batch_size=32, shuffle=True),
            max_duration="2ep",
            criterion=nn.CrossEntropyLoss(),
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            schedulers=kiln.optim.CosineAnnealingWithWarmupScheduler(t_warmup="3ba"),
            algorithms=algorithms,
            save_folder=str(folder) if folder else None,
            save_interval="1ep",
            load_path=load_path,
            callbacks=list(callbacks),
            seed=7,
            progress_bar=False,
        )
        trainer.fit()
        return trainer, algorithms

    straight, straight_algorithms = run(None)
    run(tmp_path / "ck", callbacks=[StopAt(11)])  # stops after 11 of 16 batches, in the second epoch
    probe = StopAt()
    resumed, resumed_algorithms = run(tmp_path / "ck2", load_path=str(tmp_path / "ck" / "last"), callbacks=[probe])
    assert probe.started_at == 11 and resumed.state.timestamp.batch.value == 16
    for (name, a), b in zip(straight.state.model.state_dict().items(), resumed.state.model.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs after resume"
    ema_a, ema_b = straight_algorithms[4].ema_weights, resumed_algorithms[4].ema_weights
    assert all(torch.equal(ema_a[k], ema_b[k]) for k in ema_a)
    assert torch.equal(straight_algorithms[2].permutation, resumed_algorithms[2].permutation)
