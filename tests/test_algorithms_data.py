"""ProgressiveResizing, SeqLengthWarmup and SelectiveBackprop: what the training forward receives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from kiln.algorithms import ProgressiveResizing, SelectiveBackprop, SeqLengthWarmup
from test_algorithms_loop import MiniLoop


class ImageNet(nn.Module):
    """Any image size: conv, global average pool, linear; records training inputs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)
        self.inputs: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.inputs.append(x.detach().clone())
        return self.fc(self.conv(x).mean((2, 3)))


def _images(n=10, size=32, seed=1, masks=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, size, size, generator=g)
    y = torch.randint(0, 3, (n, size, size) if masks else (n,), generator=g)
    return x, y


def test_progressive_resizing_follows_the_schedule():
    model = ImageNet()
    loop = MiniLoop(
        model, [ProgressiveResizing(initial_scale=0.5, finetune_fraction=0.2, delay_fraction=0.5)], max_duration="10ba"
    )
    x, y = _images()
    for _ in range(10):
        loop.train_batch((x, y))
    # scale at batch k: 0.5 until 0.5 of training, then linear to 1 at 0.8; sides rounded to multiples of 4
    assert [t.shape[-1] for t in model.inputs] == [16, 16, 16, 16, 16, 16, 20, 28, 32, 32]
    torch.testing.assert_close(model.inputs[6], F.interpolate(x, size=(20, 20), mode="bilinear", align_corners=False))
    assert torch.equal(model.inputs[9], x)


def test_progressive_resizing_crop_with_targets():
    model = ImageNet()

    def loss(outputs, masks):  # a stand-in segmentation loss: checks the masks' shape
        assert masks.shape[-1] == 16
        return outputs.sum() * 0

    resize = ProgressiveResizing(mode="crop", initial_scale=0.5, resize_targets=True, seed=4)
    loop = MiniLoop(model, [resize], criterion=loss, max_duration="10ba")
    x, masks = _images(masks=True)
    loop.train_batch((x, masks))
    g = torch.Generator().manual_seed(4)
    top, left = int(torch.randint(17, (), generator=g)), int(torch.randint(17, (), generator=g))
    assert torch.equal(model.inputs[0], x[..., top : top + 16, left : left + 16])


class TokenModel(kiln.Model):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 50)
        self.shapes: list[tuple[int, ...]] = []

    def forward(self, batch):
        self.shapes.append(tuple(batch["input_ids"].shape))
        return self.head(self.embed(batch["input_ids"]))

    def loss(self, outputs, batch):
        return F.cross_entropy(outputs.flatten(0, 1), batch["labels"].flatten())


def _tokens(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (4, 64), generator=g)
    return {"input_ids": ids, "labels": ids.roll(-1, 1)}


@pytest.mark.parametrize("truncate", [True, False])
def test_seq_length_warmup_schedule(truncate):
    model = TokenModel()
    loop = MiniLoop(
        model,
        [SeqLengthWarmup(duration=0.5, min_seq_length=8, max_seq_length=64, step_size=8, truncate=truncate)],
        max_duration="10ba",
    )
    batch = _tokens()
    for _ in range(7):
        loop.train_batch(batch)
    lengths = [8, 16, 24, 40, 48, 64, 64]  # 8 + 8 * int(min(1, k / 5) * 56 / 8)
    if truncate:
        assert model.shapes == [(4, n) for n in lengths]
    else:
        assert model.shapes == [(256 // n, n) for n in lengths[:-2]] + [(4, 64)] * 2
    assert loop.state.batch["labels"].shape == loop.state.batch["input_ids"].shape


def test_seq_length_warmup_cuts_every_sequence_tensor():
    warmup = SeqLengthWarmup(duration=1.0, min_seq_length=16, max_seq_length=64)
    state = kiln.State(nn.Linear(1, 1), max_duration=kiln.Time.from_timestring("10ba"))
    batch = _tokens()
    state.batch = {**batch, "attention_mask": torch.ones(4, 64), "id": torch.arange(4)}
    warmup.apply(kiln.Event.BEFORE_TRAIN_BATCH, state, None)
    assert state.batch["input_ids"].shape == state.batch["attention_mask"].shape == (4, 16)
    assert torch.equal(state.batch["labels"], batch["labels"][:, :16]) and state.batch["id"].shape == (4,)


def _per_sample_losses(model, x, y):
    with torch.no_grad():
        return F.cross_entropy(model(x), y, reduction="none")


@pytest.mark.parametrize("loss_kind", ["vmap", "loop", "given"])
def test_selective_backprop_keeps_the_highest_loss_fraction(loss_kind):
    model = ImageNet()
    x, y = _images(n=10, size=8)
    model.eval()
    losses = _per_sample_losses(model, x, y)
    model.train()

    def item_loss(outputs, targets):  # .item() stops vmap: scored one sample at a time
        return F.cross_entropy(outputs, targets) * (1.0 + 0 * outputs.sum().item())

    criterion = item_loss if loss_kind == "loop" else nn.CrossEntropyLoss()
    given = (lambda out, b: F.cross_entropy(out, b[1], reduction="none")) if loss_kind == "given" else None
    selective = SelectiveBackprop(start=0.0, end=1.0, keep=0.4, interrupt=0, per_sample_loss=given)
    loop = MiniLoop(model, [selective], criterion=criterion, max_duration="4ba")
    loop.train_batch((x, y))
    kept = losses.topk(4).indices.sort().values
    assert torch.equal(selective.kept_indices, kept)
    assert len(model.inputs) == 1 and torch.equal(model.inputs[0], x[kept])
    assert loop.state.batch[0].shape[0] == 4 and torch.equal(loop.state.batch[1], y[kept])


def test_selective_backprop_window_and_interrupt():
    model = ImageNet()
    x, y = _images(n=10, size=8)
    loop = MiniLoop(model, [SelectiveBackprop(start=0.25, end=0.75, keep=0.5, interrupt=2)], max_duration="8ba")
    for _ in range(8):
        loop.train_batch((x, y))
    # batches 2..5 are inside [0.25, 0.75); every second one (index 3, 5) trains on the full batch
    assert [t.shape[0] for t in model.inputs] == [10, 10, 5, 10, 5, 10, 10, 10]


def test_selective_backprop_scale_factor_scores_small_images():
    model = ImageNet()
    sizes = []
    model.conv.register_forward_pre_hook(lambda m, args: sizes.append(args[0].shape[-1]))
    x, y = _images(n=10, size=8)
    MiniLoop(model, [SelectiveBackprop(start=0, end=1, keep=0.5, scale_factor=0.5, interrupt=0)]).train_batch((x, y))
    assert sizes == [4, 8]
