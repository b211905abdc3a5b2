"""A hand-written loop that fires events as kiln.Trainer does, used by the algorithm tests, and the
tests of ``check_algorithm_compatibility``.

``MiniLoop`` follows the loop contract event by event (batch -> microbatches -> forward, loss,
backward -> AFTER_TRAIN_BATCH -> BEFORE_OPTIMIZER_STEP -> optimizer step -> timestamp -> BATCH_END), so each algorithm is
tested on its own events without the rest of the Trainer. ``checkpoint``/``restore`` round-trip
everything a resume needs through ``torch.save`` and ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch import nn

import kiln
from kiln.algorithms import (
    EMA,
    SAM,
    SWA,
    CutMix,
    GradientClipping,
    LabelSmoothing,
    MixUp,
    check_algorithm_compatibility,
)
from kiln.algorithms._batch import map_tensors, num_samples
from kiln.core.time import Time

E = kiln.Event


def _split(batch: Any, size: int) -> list[Any]:
    return [map_tensors(batch, lambda t, i=i: t[i : i + size]) for i in range(0, num_samples(batch), size)]


class MiniLoop:
    """State + Engine built by hand; ``train_batch`` fires the events of one training batch."""

    def __init__(
        self,
        model: nn.Module,
        algorithms=(),
        *,
        lr: float = 0.1,
        optimizer=None,
        criterion=None,
        max_duration: str = "10ba",
        grad_accum: int = 1,
        seed: int = 0,
        precision: str | None = None,
        momentum: float = 0.0,
    ) -> None:
        self.optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        self.criterion = criterion or nn.CrossEntropyLoss()
        self.engine = kiln.Engine(
            model,
            self.optimizer,
            None if isinstance(model, kiln.Model) else self.criterion,
            precision=precision,
            strategy="single",
        )
        self.state = state = kiln.State(
            model,
            optimizers=[self.optimizer],
            seed=seed,
            algorithms=list(algorithms),
            max_duration=Time.from_timestring(max_duration),
            precision=self.engine.precision,
        )
        state.engine = self.engine
        if isinstance(model, kiln.Model):
            state.loss_fn = model.loss
        else:
            state.loss_fn = lambda outputs, batch: self.engine.criterion(outputs, batch[1])
        self.grad_accum = grad_accum
        self.losses: list[torch.Tensor] = []
        check_algorithm_compatibility(state.algorithms)
        self.run(E.INIT)

    def run(self, event: kiln.Event) -> None:
        algorithms = self.state.algorithms
        for algorithm in reversed(algorithms) if event.is_after_event else algorithms:
            if algorithm.match(event, self.state):
                algorithm.apply(event, self.state, None)

    def forward(self, batch: Any) -> Any:
        return self.engine(batch) if isinstance(self.state.model, kiln.Model) else self.engine(batch[0])

    def train_batch(self, batch: Any) -> None:
        state, engine = self.state, self.engine
        state.batch = batch
        self.run(E.BATCH_START)
        self.run(E.BEFORE_TRAIN_BATCH)
        batch = state.batch
        size = num_samples(batch)
        micro = max(1, -(-size // self.grad_accum))
        microbatches = _split(batch, micro) if self.grad_accum > 1 else [batch]
        engine.zero_grad()
        for microbatch in microbatches:
            state.batch = microbatch
            self.run(E.BEFORE_FORWARD)
            state.outputs = self.forward(state.batch)
            self.run(E.AFTER_FORWARD)
            self.run(E.BEFORE_LOSS)
            state.loss = state.loss_fn(state.outputs, state.batch)
            self.run(E.AFTER_LOSS)
            self.run(E.BEFORE_BACKWARD)
            weight = num_samples(microbatch) / size if len(microbatches) > 1 else None
            engine.backward(state.loss, weight=weight)
            self.run(E.AFTER_BACKWARD)
            self.losses.append(state.loss.detach())
        state.batch = batch
        self.run(E.AFTER_TRAIN_BATCH)
        engine.optimizer_step(lambda: self.run(E.BEFORE_OPTIMIZER_STEP))
        state.timestamp.advance_batch(samples=size)
        self.run(E.BATCH_END)

    @torch.no_grad()
    def evaluate(self, batches: list[Any]) -> list[torch.Tensor]:
        state = self.state
        self.engine.eval()
        self.run(E.EVAL_START)
        outputs = []
        for batch in batches:
            state.batch = batch
            self.run(E.EVAL_BATCH_START)
            self.run(E.EVAL_BEFORE_FORWARD)
            state.outputs = self.forward(state.batch)
            self.run(E.EVAL_AFTER_FORWARD)
            outputs.append(state.outputs)
            self.run(E.EVAL_BATCH_END)
        self.run(E.EVAL_END)
        self.engine.train()
        return outputs

    def fit(self, epoch: list[Any], stop_after: int | None = None, eval_batches: list[Any] | None = None) -> None:
        """Train over ``epoch`` (the batches of one epoch) until max_duration, resuming mid-epoch
        where the timestamp says; ``stop_after`` interrupts after that many batches in all."""
        state, ts = self.state, self.state.timestamp
        self.run(E.FIT_START)
        while ts < state.max_duration:
            start = ts.batch_in_epoch.value
            if start == 0:
                self.run(E.EPOCH_START)
            for batch in epoch[start:]:
                self.train_batch(batch)
                if ts >= state.max_duration or (stop_after is not None and ts.batch.value >= stop_after):
                    break
            else:
                ts.advance_epoch()
                self.run(E.EPOCH_END)
                if eval_batches is not None:
                    self.evaluate(eval_batches)
                continue
            break
        self.run(E.FIT_END)

    # -- resume ----------------------------------------------------------------------------------
    def checkpoint(self) -> bytes:
        state = self.state
        saved = {
            "model": state.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "timestamp": state.timestamp.state_dict(),
            "algorithms": [a.state_dict() for a in state.algorithms],
            "rng": torch.get_rng_state(),
        }
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        return buffer.getvalue()

    def restore(self, data: bytes) -> None:
        saved = torch.load(io.BytesIO(data), weights_only=True)
        state = self.state
        state.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        state.timestamp.load_state_dict(saved["timestamp"])
        for algorithm, algorithm_state in zip(state.algorithms, saved["algorithms"]):
            algorithm.load_state_dict(algorithm_state)
        torch.set_rng_state(saved["rng"])


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), f"{name} differs"


# -- check_algorithm_compatibility -----------------------------------------------------------------
def test_one_loss_interpolating_algorithm_only():
    check_algorithm_compatibility([MixUp(interpolate_loss=True), CutMix(), LabelSmoothing()])
    with pytest.raises(ValueError, match="only one loss-interpolating algorithm.*MixUp, CutMix"):
        check_algorithm_compatibility([MixUp(interpolate_loss=True), CutMix(interpolate_loss=True)])


def test_each_algorithm_once_and_ema_excludes_swa():
    with pytest.raises(ValueError, match="LabelSmoothing appears twice"):
        check_algorithm_compatibility([LabelSmoothing(), MixUp(), LabelSmoothing(0.2)])
    with pytest.raises(ValueError, match="EMA and SWA cannot run together"):
        check_algorithm_compatibility([EMA(), SWA()])


def test_sam_rules():
    with pytest.raises(ValueError, match="SAM cannot run with MixUp"):
        check_algorithm_compatibility([MixUp(interpolate_loss=True), SAM()])
    # GradientClipping runs on BEFORE_OPTIMIZER_STEP, after SAM's second pass, in either order
    check_algorithm_compatibility([SAM(), GradientClipping("norm", 1.0)])
    check_algorithm_compatibility([GradientClipping("norm", 1.0), SAM(), MixUp()])


@pytest.mark.parametrize("order", ["clip_first", "sam_first"])
def test_gradient_clipping_clips_the_gradient_sam_leaves(order):
    # The step must use clamp(g(w + e)), the clipped gradient of SAM's second pass, in either order.
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    clip, sam = GradientClipping("value", 1e-3), SAM(rho=0.5)
    MiniLoop(model, [clip, sam] if order == "clip_first" else [sam, clip], lr=1.0).train_batch((x, y))
    reference = nn.Linear(4, 3)
    reference.load_state_dict(start)
    nn.functional.cross_entropy(reference(x), y).backward()
    grads = [p.grad for p in reference.parameters()]
    norm = torch.nn.utils.get_total_norm(grads)
    with torch.no_grad():
        for p, g in zip(reference.parameters(), grads):
            p.add_(g * (0.5 / (norm + 1e-12)))
    reference.zero_grad()
    nn.functional.cross_entropy(reference(x), y).backward()
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        expected = start[name] - p.grad.clamp(-1e-3, 1e-3)
        torch.testing.assert_close(q.detach(), expected, rtol=0, atol=1e-7)


def test_non_algorithms_are_refused():
    with pytest.raises(TypeError, match="kiln.Algorithm instances"):
        check_algorithm_compatibility([MixUp(), "EMA"])


def test_mini_loop_without_algorithms_is_plain_sgd():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    reference = nn.Linear(4, 3)
    reference.load_state_dict(model.state_dict())
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    MiniLoop(model, grad_accum=2).train_batch((x, y))
    nn.functional.cross_entropy(reference(x), y).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b)
