"""ChannelsLast, StochasticDepth and LowPrecisionLayerNorm: what they change in the model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kiln
from kiln.algorithms import ChannelsLast, LowPrecisionLayerNorm, StochasticDepth
from kiln.algorithms.low_precision_layernorm import LPLayerNorm
from test_algorithms_loop import MiniLoop


class Block(nn.Module):
    """A residual block ``x + f(x)`` that keeps the shape."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def _resnet(num_blocks: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), *[Block() for _ in range(num_blocks)], nn.Linear(6, 3))


def _without(model: nn.Sequential, x: torch.Tensor, skipped: set[int]) -> torch.Tensor:
    """The model's output with the blocks at ``skipped`` (1-based positions) left out."""
    for i, layer in enumerate(model):
        if i not in skipped:
            x = layer(x) if not isinstance(layer, Block) else Block.forward(layer, x)
    return x


def test_stochastic_depth_drops_blocks_as_drawn_in_training_only():
    model = _resnet()
    keys = list(model.state_dict())
    depth = StochasticDepth("Block", drop_rate=0.8, drop_distribution="linear", seed=11)
    loop = MiniLoop(model, [depth])
    assert list(model.state_dict()) == keys and all(type(b).__name__ == "StochasticBlock" for b in model[1:5])
    rates = [b._kiln_drop_rate for b in model[1:5]]
    assert rates == pytest.approx([0.2, 0.4, 0.6, 0.8])

    g = torch.Generator().manual_seed(11)
    x = torch.randn(5, 4)
    num_skipped = 0
    with torch.no_grad():
        for _ in range(6):
            skipped = {i + 1 for i, rate in enumerate(rates) if float(torch.rand((), generator=g)) < rate}
            num_skipped += len(skipped)
            torch.testing.assert_close(model(x), _without(model, x, skipped))
        assert num_skipped > 0
        model.eval()
        state = depth.generator().get_state()
        torch.testing.assert_close(model(x), _without(model, x, set()))  # evaluation runs every block
        assert torch.equal(depth.generator().get_state(), state), "evaluation draws nothing"
    assert loop.state.model is model


def test_stochastic_depth_per_sample_and_warmup():
    model = _resnet(1)
    depth = StochasticDepth(
        Block, stochastic_method="sample", drop_rate=0.5, drop_distribution="uniform", drop_warmup="2ba", seed=3
    )
    loop = MiniLoop(model, [depth], max_duration="4ba")
    loop.run(kiln.Event.BATCH_START)
    assert model[1]._kiln_drop_rate == 0.0  # warmup starts from zero
    loop.state.timestamp.advance_batch(samples=8)
    loop.run(kiln.Event.BATCH_START)
    assert model[1]._kiln_drop_rate == pytest.approx(0.25)
    loop.state.timestamp.advance_batch(samples=8)
    loop.run(kiln.Event.BATCH_START)
    assert model[1]._kiln_drop_rate == pytest.approx(0.5)

    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 4)
    with torch.no_grad():
        out = model(x)
        keep = torch.rand(64, generator=g) >= 0.5
        full, skipped = _without(model, x, set()), _without(model, x, {1})
    assert 0 < keep.sum() < 64
    torch.testing.assert_close(out[keep], full[keep])
    torch.testing.assert_close(out[~keep], skipped[~keep])


def test_stochastic_depth_refuses_shape_changing_blocks_and_unknown_names():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="matched no module; the model has Linear"):
        MiniLoop(nn.Sequential(nn.Linear(4, 3)), [StochasticDepth("Bottleneck")])
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    MiniLoop(model, [StochasticDepth(lambda name, m: name == "0", drop_rate=0.5)])
    with pytest.raises(ValueError, match="cannot skip Linear: it maps"):
        model(torch.randn(2, 4))


def test_channels_last_converts_weights_and_inputs_without_changing_values():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Flatten(), nn.LazyLinear(2))
    model(torch.randn(1, 3, 6, 6))
    seen = []
    model[0].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    x, y = torch.randn(4, 3, 6, 6), torch.randint(0, 2, (4,))
    with torch.no_grad():
        expected = model(x)
    loop = MiniLoop(model, [ChannelsLast()])
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert model[2].weight.is_contiguous(memory_format=torch.channels_last)
    outputs = loop.evaluate([(x, y)])
    assert seen[-1].is_contiguous(memory_format=torch.channels_last)
    assert not x.is_contiguous(memory_format=torch.channels_last), "the dataset's tensor is left alone"
    torch.testing.assert_close(outputs[0], expected)
    loop.train_batch((x, y))
    assert seen[-1].is_contiguous(memory_format=torch.channels_last)


def _ln_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 3))


def test_low_precision_layernorm_runs_in_bf16_under_autocast():
    model = _ln_model()
    reference = _ln_model()
    dtypes = []
    model[1].register_forward_hook(lambda m, args, out: dtypes.append(out.dtype))
    reference[1].register_forward_hook(lambda m, args, out: dtypes.append(out.dtype))
    loop = MiniLoop(model, [LowPrecisionLayerNorm()], precision="amp_bf16")
    assert type(model[1]) is LPLayerNorm and list(model.state_dict()) == list(reference.state_dict())
    x, h = torch.randn(4, 8), torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref = model[1](h), reference[1](h)  # a float32 input, as on GPUs where autocast upcasts for layer_norm
    assert dtypes == [torch.bfloat16, torch.float32]
    torch.testing.assert_close(out.float(), ref, atol=0.05, rtol=0.05)
    torch.testing.assert_close(model(x), reference(x))  # no autocast: exactly as before
    loop.train_batch((x, torch.randint(0, 3, (4,))))


def test_low_precision_layernorm_warns_without_autocast():
    model = _ln_model()
    with pytest.warns(UserWarning, match="needs autocast"):
        MiniLoop(model, [LowPrecisionLayerNorm()])
    assert type(model[1]) is nn.LayerNorm
