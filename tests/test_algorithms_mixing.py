"""MixUp, CutMix and LabelSmoothing: what the model and the loss see, and resume."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln.algorithms import CutMix, LabelSmoothing, MixUp
from kiln.algorithms._random import sample_beta
from test_algorithms_loop import MiniLoop, assert_same_weights

NUM_CLASSES = 5


class Recorder(nn.Module):
    """A linear classifier over flattened inputs that records what its forward and loss receive."""

    def __init__(self, in_features: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(in_features, NUM_CLASSES)
        self.inputs: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs.append(x.detach().clone())
        return self.fc(x.flatten(1))


class RecordingLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.targets: list[torch.Tensor] = []

    def forward(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.targets.append(targets.detach().clone())
        return F.cross_entropy(outputs, targets)


def _data(shape=(8, 6), seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g), torch.randint(0, NUM_CLASSES, (shape[0],), generator=g)


def _expected_draw(seed: int, n: int, alpha: float) -> tuple[torch.Tensor, float]:
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g)
    return perm, sample_beta(alpha, g)


def test_mixup_mixes_inputs_and_targets_with_the_drawn_lambda():
    x, y = _data()
    model, loss = Recorder(6), RecordingLoss()
    mixup = MixUp(alpha=0.4, seed=7)
    loop = MiniLoop(model, [mixup], criterion=loss)
    batch = (x, y)
    loop.train_batch(batch)

    perm, lam = _expected_draw(7, 8, 0.4)
    assert torch.equal(mixup.permutation, perm) and mixup.mixing == lam and 0 < lam < 1
    torch.testing.assert_close(model.inputs[0], lam * x + (1 - lam) * x[perm])
    onehot = F.one_hot(y, NUM_CLASSES).float()
    torch.testing.assert_close(loss.targets[0], lam * onehot + (1 - lam) * onehot[perm])
    assert loop.state.batch[1] is y, "the dataset's targets are back after the backward pass"


def test_mixup_interpolate_loss_keeps_targets_and_mixes_losses():
    x, y = _data()
    model, loss = Recorder(6), RecordingLoss()
    mixup = MixUp(alpha=0.4, interpolate_loss=True, seed=7)
    loop = MiniLoop(model, [mixup], criterion=loss)
    loop.train_batch((x, y))
    perm, lam = _expected_draw(7, 8, 0.4)
    assert torch.equal(loss.targets[0], y) and torch.equal(loss.targets[1], y[perm])
    with torch.no_grad():
        outputs = Recorder(6)(lam * x + (1 - lam) * x[perm])  # the initial weights
    expected = lam * F.cross_entropy(outputs, y) + (1 - lam) * F.cross_entropy(outputs, y[perm])
    torch.testing.assert_close(loop.losses[0], expected)
    assert mixup.interpolates_loss


def test_cutmix_pastes_a_box_and_mixes_targets_by_area():
    x, y = _data((8, 3, 10, 12))
    model, loss = Recorder(3 * 10 * 12), RecordingLoss()
    cutmix = CutMix(alpha=1.0, seed=3)
    MiniLoop(model, [cutmix], criterion=loss).train_batch((x, y))
    perm, lam = _expected_draw(3, 8, 1.0)
    assert torch.equal(cutmix.permutation, perm)
    top, bottom, left, right = cutmix.box
    area = (bottom - top) * (right - left)
    assert 0 < area < 120 and cutmix.mixing == pytest.approx(1 - area / 120)
    assert abs(area / 120 - (1 - lam)) < 0.25, "the box's area follows the drawn lambda"
    expected = x.clone()
    expected[..., top:bottom, left:right] = x[perm][..., top:bottom, left:right]
    assert torch.equal(model.inputs[0], expected)
    onehot = F.one_hot(y, NUM_CLASSES).float()
    torch.testing.assert_close(loss.targets[0], cutmix.mixing * onehot + (1 - cutmix.mixing) * onehot[perm])


def test_label_smoothing_targets_and_restore():
    x, y = _data()
    model, loss = Recorder(6), RecordingLoss()
    loop = MiniLoop(model, [LabelSmoothing(smoothing=0.2)], criterion=loss)
    loop.train_batch((x, y))
    expected = F.one_hot(y, NUM_CLASSES).float() * 0.8 + 0.2 / NUM_CLASSES
    torch.testing.assert_close(loss.targets[0], expected)
    assert loop.state.batch[1] is y
    # the same as torch's own label smoothing
    with torch.no_grad():
        reference = F.cross_entropy(Recorder(6)(x), y, label_smoothing=0.2)
    torch.testing.assert_close(loop.losses[0], reference)


@pytest.mark.parametrize("interpolate", [False, True])
def test_label_smoothing_and_mixup_in_either_order_give_the_same_loss(interpolate):
    x, y = _data()
    losses = []
    for order in ("smooth_first", "mix_first"):
        smoothing, mixup = LabelSmoothing(0.1), MixUp(alpha=0.5, interpolate_loss=interpolate, seed=5)
        algorithms = [smoothing, mixup] if order == "smooth_first" else [mixup, smoothing]
        loop = MiniLoop(Recorder(6), algorithms)
        loop.train_batch((x, y))
        assert loop.state.batch[1] is y
        losses.append(loop.losses[0])
    torch.testing.assert_close(losses[0], losses[1])
    perm, lam = _expected_draw(5, 8, 0.5)
    with torch.no_grad():
        outputs = Recorder(6)(lam * x + (1 - lam) * x[perm])
    smooth = F.one_hot(y, NUM_CLASSES).float() * 0.9 + 0.1 / NUM_CLASSES
    expected = lam * F.cross_entropy(outputs, smooth) + (1 - lam) * F.cross_entropy(outputs, smooth[perm])
    torch.testing.assert_close(losses[0], expected)


def test_mixup_per_microbatch_and_class_count_from_outputs():
    x, y = _data((12, 6))
    loss = RecordingLoss()
    MiniLoop(Recorder(6), [MixUp(alpha=1.0)], criterion=loss, grad_accum=3).train_batch((x, y))
    assert [t.shape for t in loss.targets] == [torch.Size([4, NUM_CLASSES])] * 3
    assert all(torch.allclose(t.sum(1), torch.ones(4)) for t in loss.targets)


@pytest.mark.parametrize(
    "make",
    [lambda: [MixUp(alpha=0.3)], lambda: [CutMix(interpolate_loss=True)], lambda: [LabelSmoothing(0.1), CutMix()]],
    ids=["mixup", "cutmix", "smooth+cutmix"],
)
def test_resume_is_bit_exact(make):
    g = torch.Generator().manual_seed(0)
    epoch = [(torch.randn(8, 3, 4, 4, generator=g), torch.randint(0, NUM_CLASSES, (8,), generator=g)) for _ in range(4)]

    straight = MiniLoop(Recorder(48), make(), max_duration="6ba", momentum=0.9)
    straight.fit(epoch)
    first = MiniLoop(Recorder(48), make(), max_duration="6ba", momentum=0.9)
    first.fit(epoch, stop_after=3)
    data = first.checkpoint()
    second = MiniLoop(Recorder(48), make(), max_duration="6ba", momentum=0.9)
    second.restore(data)
    second.fit(epoch)
    assert_same_weights(straight.state.model, second.state.model)
    assert straight.state.algorithms[-1].mixing == second.state.algorithms[-1].mixing


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="alpha must be > 0"):
        MixUp(alpha=0)
    with pytest.raises(ValueError, match=r"smoothing must be in \[0, 1\)"):
        LabelSmoothing(1.0)
    with pytest.raises(ValueError, match="CutMix needs images"):
        MiniLoop(Recorder(6), [CutMix()]).train_batch(_data())
