"""The evaluation loss's mean (kiln.trainer.loss_mean.LossMean) is torchmetrics' MeanMetric in float64,
bit for bit, and an evaluation that reports only the loss imports no torchmetrics."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from distributed import base_env
from kiln.trainer.loss_mean import LossMean


def test_the_mean_is_meanmetric_s_in_float64_bit_for_bit():
    from torchmetrics import MeanMetric

    torch.manual_seed(0)
    ours, theirs = LossMean(), MeanMetric().set_dtype(torch.float64)
    for _ in range(50):  # float32 losses of ragged batches, as an evaluation gives
        loss, n = torch.rand(()) * 10, int(torch.randint(1, 9, ()))
        ours.update(loss, weight=n)
        theirs.update(loss, weight=n)
    assert ours.compute().dtype == torch.float64
    assert ours.compute().item() == theirs.compute().item()  # exact, not approximate
    ours.reset()
    ours.update(torch.tensor(2.5), weight=4)
    assert ours.compute().item() == 2.5


def test_a_nan_loss_is_left_out_with_a_warning():
    mean = LossMean()
    mean.update(torch.tensor(1.0), weight=2)
    with pytest.warns(UserWarning, match="nan"):
        mean.update(torch.tensor(float("nan")), weight=3)
    mean.update(torch.tensor(4.0), weight=1)
    assert mean.compute().item() == 2.0  # (1 x 2 + 4 x 1) / 3


def test_an_evaluation_of_the_loss_alone_imports_no_torchmetrics():
    code = """
import sys, torch, kiln
from torch import nn
model = nn.Linear(4, 2)
data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
loader = torch.utils.data.DataLoader(data, batch_size=8)
trainer = kiln.Trainer(model, train_dataloader=loader, eval_dataloader=loader, max_duration="1ep",
    optimizers=torch.optim.SGD(model.parameters(), lr=0.1), criterion=nn.CrossEntropyLoss(), progress_bar=False)
trainer.fit()
assert "eval/loss" in trainer.state.metrics, trainer.state.metrics
assert "torchmetrics" not in sys.modules, "torchmetrics imported"
"""
    done = subprocess.run([sys.executable, "-c", code], env=base_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
