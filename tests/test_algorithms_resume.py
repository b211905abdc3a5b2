"""Resume with each algorithm on is bit-exact: stopping mid-epoch, saving everything through
``torch.save``/``torch.load(weights_only=True)`` and going on gives the weights of an
uninterrupted run, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from kiln.algorithms import (EMA, SAM, SWA, ChannelsLast, CutMix, GradientClipping, LabelSmoothing, LayerFreezing,
                             LowPrecisionLayerNorm, MixUp, ProgressiveResizing, SelectiveBackprop, SeqLengthWarmup,
                             StochasticDepth)
from test_algorithms_loop import MiniLoop, assert_same_weights


class ResBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.conv(x))


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
        self.head = nn.Linear(8, 30)

    def forward(self, batch):
        return self.head(self.embed(batch["input_ids"]))

    def loss(self, outputs, batch):
        return F.cross_entropy(outputs.flatten(0, 1), batch["labels"].flatten())


def _image_epoch():
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(2)]


def _token_epoch():
    g = torch.Generator().manual_seed(2)
    ids = [torch.randint(0, 30, (4, 32), generator=g) for _ in range(2)]
    return [{"input_ids": i, "labels": i.roll(-1, 1)} for i in ids]


CASES = {
    "layer_freezing": lambda: [LayerFreezing(freeze_start=0.3, freeze_level=0.8)],
    "mixup": lambda: [MixUp(alpha=0.5)],
    "cutmix_interpolate": lambda: [CutMix(alpha=1.0, interpolate_loss=True)],
    "label_smoothing": lambda: [LabelSmoothing(0.1)],
    "ema": lambda: [EMA(half_life="2ba")],
    "swa": lambda: [SWA(swa_start="0.25dur", swa_end="0.75dur", update_interval="1ba", swa_lr=0.05, anneal_epochs=2)],
    "sam": lambda: [SAM(rho=0.1)],
    "gradient_clipping": lambda: [GradientClipping("adaptive", 0.05)],
    "channels_last": lambda: [ChannelsLast()],
    "stochastic_depth": lambda: [StochasticDepth("ResBlock", drop_rate=0.5, drop_warmup="2ba")],
    "progressive_resizing": lambda: [ProgressiveResizing("crop", initial_scale=0.5, delay_fraction=0.0,
                                                         finetune_fraction=0.3)],
    "selective_backprop": lambda: [SelectiveBackprop(start=0.2, end=0.8, keep=0.5)],
    "low_precision_layernorm": lambda: [LowPrecisionLayerNorm()],
    "seq_length_warmup": lambda: [SeqLengthWarmup(duration=0.6, min_seq_length=8, max_seq_length=32)],
    "many": lambda: [SelectiveBackprop(start=0.2, end=0.8, keep=0.5), ProgressiveResizing(initial_scale=0.5),
                     GradientClipping("norm", 1.0), SAM(rho=0.1), MixUp(alpha=0.3), CutMix(), LabelSmoothing(0.1),
                     EMA(half_life="3ba"), StochasticDepth("ResBlock", stochastic_method="sample", drop_rate=0.3),
                     LayerFreezing(freeze_start=0.5, freeze_level=0.5), ChannelsLast()],
}


def _assert_same_state(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same_state(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.parametrize("name", list(CASES))
def test_resume_is_bit_exact(name):
    tokens = name == "seq_length_warmup"
    epoch = _token_epoch() if tokens else _image_epoch()
    evaluation = None if tokens else [epoch[0]]
    precision = "amp_bf16" if name == "low_precision_layernorm" else None

    def loop():
        model = TokenModel() if tokens else SmallResNet()
        return MiniLoop(model, CASES[name](), max_duration="6ba", grad_accum=2, momentum=0.9, seed=5,
                        precision=precision)

    straight = loop()
    straight.fit(epoch, eval_batches=evaluation)
    first = loop()
    first.fit(epoch, stop_after=3, eval_batches=evaluation)  # stops in the middle of the second epoch
    data = first.checkpoint()
    second = loop()
    second.restore(data)
    second.fit(epoch, eval_batches=evaluation)
    assert second.state.timestamp.batch.value == 6
    assert_same_weights(straight.state.model, second.state.model)
    for a, b in zip(straight.state.algorithms, second.state.algorithms):
        _assert_same_state(a.state_dict(), b.state_dict(), type(a).__name__)
    assert [t.shape for t in straight.losses[-6:]] == [t.shape for t in second.losses[-6:]]
