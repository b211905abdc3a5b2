"""EMA, SWA, SAM, GradientClipping and LayerFreezing: each effect against a hand computation."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from kiln.algorithms import EMA, SAM, SWA, GradientClipping, LayerFreezing
from test_algorithms_loop import MiniLoop


class Probe(kiln.Algorithm):
    """Records ``fn(state)`` on one event. Its place in the list decides whether it runs before or
    after another algorithm on that event (after-events run in reverse order)."""

    def __init__(self, event, fn):
        self.event, self.fn, self.seen = event, fn, []

    def match(self, event, state):
        return event == self.event

    def apply(self, event, state, logger):
        self.seen.append(self.fn(state))


def _weights(state):
    return {k: v.detach().clone() for k, v in state.model.state_dict().items()}


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Linear(4, 3)


def _epoch(num_batches=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(num_batches)]


@pytest.mark.parametrize("ema_start,first", [("0.0dur", 0), ("2ba", 2)])
def test_ema_weights_equal_a_hand_computed_average(ema_start, first):
    ema = EMA(half_life="2ba", ema_start=ema_start)
    probe = Probe(kiln.Event.BATCH_END, _weights)
    loop = MiniLoop(_model(), [ema, probe], max_duration="5ba")  # probe listed last: runs before EMA at BATCH_END
    initial = _weights(loop.state)
    loop.fit(_epoch())
    assert ema.smoothing == pytest.approx(2**-0.5)
    history = [initial, *probe.seen]  # weights after 0..5 steps
    average = dict(history[first])
    for weights in history[first + 1 :]:
        average = {k: ema.smoothing * average[k] + (1 - ema.smoothing) * weights[k] for k in average}
    for name, value in average.items():
        torch.testing.assert_close(ema.ema_weights[name], value)


def test_ema_evaluates_with_the_average_and_swaps_back():
    ema = EMA(smoothing=0.5)
    loop = MiniLoop(_model(), [ema], max_duration="3ba")
    loop.fit(_epoch())
    training = _weights(loop.state)
    x = torch.randn(5, 4)
    (out,) = loop.evaluate([(x, None)])
    torch.testing.assert_close(out, F.linear(x, ema.ema_weights["weight"], ema.ema_weights["bias"]))
    assert not torch.equal(ema.ema_weights["weight"], training["weight"])
    assert all(torch.equal(v, training[k]) for k, v in _weights(loop.state).items()), "training weights restored"


def test_ema_update_interval_and_units():
    assert EMA(half_life="4ba", update_interval="2ba").smoothing == pytest.approx(2**-0.5)
    ema = EMA(half_life="2ba", update_interval="2ba")
    assert ema.smoothing == pytest.approx(0.5)
    with pytest.raises(ValueError, match="same unit"):
        EMA(half_life="4ba", update_interval="1ep")
    probe = Probe(kiln.Event.BATCH_END, _weights)
    loop = MiniLoop(_model(), [ema, probe], max_duration="4ba")
    initial = _weights(loop.state)
    loop.fit(_epoch())
    expected = {k: 0.25 * initial[k] + 0.25 * probe.seen[1][k] + 0.5 * probe.seen[3][k] for k in initial}
    for name, value in expected.items():
        torch.testing.assert_close(ema.ema_weights[name], value)


def test_swa_averages_then_copies_the_average_and_anneals_the_lr():
    swa = SWA(swa_start="2ba", swa_end="5ba", update_interval="1ba", swa_lr=0.01, anneal_epochs=2)
    weights = Probe(kiln.Event.BATCH_END, _weights)
    lrs = Probe(kiln.Event.BATCH_START, lambda s: s.optimizer.param_groups[0]["lr"])
    loop = MiniLoop(_model(), [swa, weights, lrs], max_duration="6ba")
    loop.fit(_epoch(), stop_after=5)
    average = {k: torch.stack([w[k] for w in weights.seen[1:5]]).mean(0) for k in weights.seen[0]}
    for name, param in swa.swa_model.module.state_dict().items():
        torch.testing.assert_close(param, average[name])
    assert swa.completed and int(swa.swa_model.n_averaged) == 4
    for name, value in _weights(loop.state).items():
        torch.testing.assert_close(value, average[name])  # the model now holds the average
    # the first update (after batch 2) already anneals one of the two steps
    assert lrs.seen == pytest.approx([0.1, 0.1, 0.055, 0.01, 0.01])


def _sam_reference(model, x, y, rho, lr):
    w = [p.detach().clone() for p in model.parameters()]
    g1 = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
    norm = torch.sqrt(sum((g**2).sum() for g in g1))
    with torch.no_grad():
        for p, g in zip(model.parameters(), g1):
            p.add_(rho * g / norm)
    g2 = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
    return [wi - lr * gi for wi, gi in zip(w, g2)]


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_sam_takes_the_two_step_update(grad_accum):
    ((x, y),) = _epoch(1)
    expected = _sam_reference(_model(), x, y, rho=0.5, lr=0.1)
    loop = MiniLoop(_model(), [SAM(rho=0.5)], grad_accum=grad_accum)
    loop.train_batch((x, y))
    for p, e in zip(loop.state.model.parameters(), expected):
        torch.testing.assert_close(p, e)
    plain = MiniLoop(_model(), [])
    plain.train_batch((x, y))
    assert not torch.allclose(plain.state.model.weight, loop.state.model.weight)


def test_sam_interval_skips_batches():
    a, b = _epoch(2)
    loop = MiniLoop(_model(), [SAM(rho=0.5, interval=2)])
    loop.train_batch(a)
    model = copy.deepcopy(loop.state.model)
    loop.train_batch(b)  # batch index 1: a plain SGD step
    loss = F.cross_entropy(model(b[0]), b[1])
    grads = torch.autograd.grad(loss, list(model.parameters()))
    for p, q, g in zip(loop.state.model.parameters(), model.parameters(), grads):
        torch.testing.assert_close(p, q - 0.1 * g)


def _clip_run(algorithm, scale=50.0):
    raw = Probe(kiln.Event.AFTER_TRAIN_BATCH, lambda s: [p.grad.clone() for p in s.model.parameters()])
    clipped = Probe(kiln.Event.BEFORE_OPTIMIZER_STEP, lambda s: [p.grad.clone() for p in s.model.parameters()])
    model = _model()
    loop = MiniLoop(model, [raw, algorithm, clipped])  # clipping runs on BEFORE_OPTIMIZER_STEP, in list order
    x, y = _epoch(1)[0]
    loop.train_batch((x * scale, y))
    return raw.seen[0], clipped.seen[0], model


def test_gradient_clipping_by_norm():
    raw, clipped, _ = _clip_run(GradientClipping("norm", 0.5))
    norm = torch.sqrt(sum((g**2).sum() for g in raw))
    assert norm > 0.5
    for r, c in zip(raw, clipped):
        torch.testing.assert_close(c, r * 0.5 / norm, rtol=1e-5, atol=1e-6)


def test_gradient_clipping_by_value():
    raw, clipped, _ = _clip_run(GradientClipping("value", 0.05))
    assert max(g.abs().max() for g in raw) > 0.05
    for r, c in zip(raw, clipped):
        assert torch.equal(c, r.clamp(-0.05, 0.05))


def test_gradient_clipping_adaptive():
    raw, clipped, model = _clip_run(GradientClipping("adaptive", 0.1))
    weight, bias = model.weight.detach(), model.bias.detach()  # unchanged since the step below is after
    # the step already ran: recover the weights before it from the clipped gradients
    weight, bias = weight + 0.1 * clipped[0], bias + 0.1 * clipped[1]
    row_max = weight.norm(dim=1, keepdim=True).clamp(min=1e-3) * 0.1
    row_norm = raw[0].norm(dim=1, keepdim=True)
    assert (row_norm > row_max).any()
    torch.testing.assert_close(clipped[0], torch.where(row_norm > row_max, raw[0] * row_max / row_norm, raw[0]))
    bias_max = bias.norm().clamp(min=1e-3) * 0.1
    expected_bias = raw[1] * bias_max / raw[1].norm() if raw[1].norm() > bias_max else raw[1]
    torch.testing.assert_close(clipped[1], expected_bias)


def test_layer_freezing_freezes_the_first_layers_on_schedule_and_never_unfreezes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3))
    layers = [model[0], model[2], model[3], model[4]]
    freezing = LayerFreezing(freeze_start=0.5, freeze_level=1.0)
    frozen_counts = Probe(kiln.Event.BATCH_END, lambda s: sum(not l.weight.requires_grad for l in layers))
    loop = MiniLoop(model, [freezing, frozen_counts], max_duration="8ba")  # probe runs before LayerFreezing
    snapshots = []
    for batch in _epoch(8):
        loop.train_batch(batch)
        snapshots.append([layer.weight.detach().clone() for layer in layers])
        for layer in layers:  # the optimizer must not move a frozen layer
            assert layer.weight.requires_grad or layer.weight.grad is None
    assert frozen_counts.seen == [0, 0, 0, 0, 0, 1, 2, 3]  # before each BATCH_END's freezing
    assert freezing.num_frozen == 4 and freezing.frozen_layers == ["0", "2", "3", "4"]
    for step in range(4, 8):  # after batch k (1-based), int((k/8 - 0.5) / 0.5 * 4) layers are frozen
        for i in range(step - 4):
            assert torch.equal(snapshots[step][i], snapshots[step - 1][i]), f"layer {i} moved after freezing"
    assert not torch.equal(snapshots[6][3], snapshots[5][3])


def test_layer_freezing_refreezes_after_resume():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    freezing = LayerFreezing(freeze_start=0.0, freeze_level=0.5)
    freezing.load_state_dict({"num_frozen": 1})
    MiniLoop(model, [freezing], max_duration="2ba").fit(_epoch(), stop_after=0)
    assert not model[0].weight.requires_grad and model[1].weight.requires_grad
