"""Every algorithm resumes bit-exactly through the real Trainer and ``kiln.checkpoint``.

A run with the algorithm on is interrupted (an exception from a callback, so the checkpoint of that
batch is never written) in the middle of its second epoch, while the algorithm's state is live: EMA
averaging, SWA averaging started and not finished, LayerFreezing part-way, StochasticDepth,
ProgressiveResizing and SeqLengthWarmup mid-schedule. A new Trainer built from scratch with
``autoresume=True`` loads ``last`` (saved mid-epoch by the Trainer's ``save_folder``) and finishes.
Each batch after the resume must have the uninterrupted run's loss and batch shape, and at the end
the weights, the optimizer state and every algorithm's ``state_dict`` must be equal, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from kiln.algorithms import (
    EMA,
    SAM,
    SWA,
    ChannelsLast,
    CutMix,
    GradientClipping,
    LabelSmoothing,
    LayerFreezing,
    LowPrecisionLayerNorm,
    MixUp,
    ProgressiveResizing,
    SelectiveBackprop,
    SeqLengthWarmup,
    StochasticDepth,
)
from kiln.parallel import full_model_state_dict
from test_resume_full import assert_equal

STOP_AFTER = 7  # of 12 batches (3 epochs of 4): checkpoints after batches 2, 6 and 10; resumes from ep1-ba6


class ResBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(F.relu(self.conv(x)))


class SmallResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 6, 3, padding=1)
        self.blocks = nn.Sequential(ResBlock(6), ResBlock(6))
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(F.relu(self.stem(x))).mean((2, 3))))


class TokenModel(kiln.Model):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(30, 8)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(8, 30)

    def forward(self, batch):
        return self.head(self.drop(self.embed(batch["input_ids"])))

    def loss(self, outputs, batch):
        return F.cross_entropy(outputs.flatten(0, 1), batch["labels"].flatten())


class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 30, (32, 32), generator=torch.Generator().manual_seed(2))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i].roll(-1)}


def _images():
    g = torch.Generator().manual_seed(2)
    return torch.utils.data.TensorDataset(
        torch.randn(32, 3, 6, 6, generator=g), torch.randint(0, 4, (32,), generator=g)
    )


# One case per model and precision the algorithms need (SWA replaces the schedule, SeqLengthWarmup
# needs tokens, LowPrecisionLayerNorm amp_bf16), and the others together: "many" with their
# defaults, "variants" with the other code paths of the ones that have some (CutMix's interpolated
# loss, adaptive clipping, StochasticDepth's block drop with warmup, ProgressiveResizing's crop).
# Each algorithm's state (state_dict, generator) is restored or the combined run's losses differ.
CASES = {
    "swa": lambda: [SWA(swa_start="0.25dur", swa_end="0.75dur", update_interval="1ba", swa_lr=0.05, anneal_epochs=2)],
    "low_precision_layernorm": lambda: [LowPrecisionLayerNorm()],
    "seq_length_warmup": lambda: [SeqLengthWarmup(duration=0.6, min_seq_length=8, max_seq_length=32)],
    "many": lambda: [
        SelectiveBackprop(start=0.2, end=0.8, keep=0.5),
        ProgressiveResizing(initial_scale=0.5),
        GradientClipping("norm", 1.0),
        SAM(rho=0.1),
        MixUp(alpha=0.3),
        CutMix(),
        LabelSmoothing(0.1),
        EMA(half_life="3ba"),
        StochasticDepth("ResBlock", stochastic_method="sample", drop_rate=0.3),
        LayerFreezing(freeze_start=0.1, freeze_level=0.8),
        ChannelsLast(),
    ],
    "variants": lambda: [
        CutMix(alpha=1.0, interpolate_loss=True),
        GradientClipping("adaptive", 0.05),
        StochasticDepth("ResBlock", drop_rate=0.5, drop_warmup="2ba"),
        ProgressiveResizing("crop", initial_scale=0.5, delay_fraction=0.0, finetune_fraction=0.3),
        EMA(half_life="2ba"),
    ],
}


def _live(name: str, algorithms) -> None:
    """The checkpoint the resume starts from holds the algorithm part-way through its work."""
    state = {type(a).__name__: a.state_dict() for a in algorithms}
    if "LayerFreezing" in state:
        # max_duration is in epochs, so the elapsed fraction is 1/3 at the checkpoint: 1 of 5 layers
        assert state["LayerFreezing"]["num_frozen"] == 1, state["LayerFreezing"]
    if "EMA" in state:
        assert state["EMA"]["started"] and state["EMA"]["ema_weights"] is not None
    if name == "swa":
        average = state["SWA"]["swa_model"]
        assert not state["SWA"]["completed"] and 0 < int(average["n_averaged"]) < 12
    for name in ("StochasticDepth", "MixUp", "CutMix"):  # their generators have drawn
        if name in state:
            assert "rng" in state[name], f"{name} has drawn nothing: {state[name]}"


class _Interrupt(Exception):
    pass


class _Record(kiln.Callback):
    """Each batch's loss and (post-algorithm) batch shape; raises after ``stop_after`` batches."""

    def __init__(self, stop_after: int = 0) -> None:
        self.stop_after, self.batches = stop_after, {}

    def batch_end(self, state, logger):
        batch = state.batch[0] if isinstance(state.batch, (tuple, list)) else state.batch["input_ids"]
        self.batches[state.timestamp.batch.value] = (state.loss.detach().clone(), tuple(batch.shape))
        if state.timestamp.batch.value == self.stop_after:
            raise _Interrupt  # a crash: this batch's checkpoint is never written


def _trainer(name: str, folder, stop_after: int = 0, autoresume: bool = False):
    tokens = name == "seq_length_warmup"
    data = _Tokens() if tokens else _images()
    model = TokenModel() if tokens else SmallResNet()
    record = _Record(stop_after)
    trainer = kiln.Trainer(
        model,
        train_dataloader=torch.utils.data.DataLoader(data, batch_size=8, shuffle=True),
        eval_dataloader=None if tokens else torch.utils.data.DataLoader(data, batch_size=16),
        max_duration="3ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        schedulers=kiln.optim.CosineAnnealingWithWarmupScheduler(t_warmup="2ba"),
        criterion=None if tokens else nn.CrossEntropyLoss(),
        grad_accum=2,
        seed=5,
        precision="amp_bf16" if name == "low_precision_layernorm" else None,
        algorithms=CASES[name](),
        callbacks=[record],
        save_folder=folder,
        save_interval=lambda state, event: state.timestamp.batch_in_epoch.value == 2,
        autoresume=autoresume,
        progress_bar=False,
    )
    return trainer, record


@pytest.mark.parametrize("name", list(CASES))
def test_resume_through_the_trainer_is_bit_exact(tmp_path, name):
    straight, reference = _trainer(name, tmp_path / "straight")
    straight.fit()
    assert sorted(reference.batches) == list(range(1, 13))

    crashed, _ = _trainer(name, tmp_path / "run", stop_after=STOP_AFTER)
    with pytest.raises(_Interrupt):
        crashed.fit()
    assert (tmp_path / "run/last").resolve().name == "ep1-ba6"  # mid-epoch: batch 2 of epoch 1
    del crashed

    resumed, record = _trainer(name, tmp_path / "run", autoresume=True)
    assert resumed.state.timestamp.batch.value == 6 and resumed.state.timestamp.batch_in_epoch.value == 2
    _live(name, resumed.state.algorithms)
    resumed.fit()

    assert sorted(record.batches) == list(range(7, 13))
    for batch, (loss, shape) in record.batches.items():
        assert shape == reference.batches[batch][1], f"batch {batch}: shape {shape} != {reference.batches[batch][1]}"
        assert torch.equal(loss, reference.batches[batch][0]), f"batch {batch}: loss differs after the resume"
    a, b = straight.state, resumed.state
    assert_equal(full_model_state_dict(b.model), full_model_state_dict(a.model), "model")
    assert_equal(b.optimizers[0].state_dict(), a.optimizers[0].state_dict(), "optimizer")
    for x, y in zip(a.algorithms, b.algorithms):
        assert_equal(y.state_dict(), x.state_dict(), type(x).__name__)
