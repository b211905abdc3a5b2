"""CUDA paths: NCCL collectives on the right device, autocast precisions, FSDP2 mixed precision, compile.

The Trainer and hook tests run in this process on a one-rank group: NCCL on cuda:0 where CUDA is
there (one GPU is enough, and NCCL refuses a tensor on the wrong device, "No backend type
associated with device type cpu", which gloo silently accepts, so a collective kiln issues on a CPU
tensor fails there), gloo on the CPU elsewhere, which checks the same runs end to end. The Engine
precision and compile tests are marked ``gpu`` and need CUDA (CI has none).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import kiln

CUDA = torch.cuda.is_available()
needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]


@pytest.fixture
def one_rank_group():
    """A one-rank process group that kiln.context() describes: nccl on cuda:0, else gloo on the CPU."""
    from kiln.launch.context import _set_context

    backend, device = ("nccl", torch.device("cuda", 0)) if CUDA else ("gloo", torch.device("cpu"))
    if CUDA:
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device if CUDA else None)
    _set_context(None)
    ctx = kiln.context()
    assert ctx.backend == backend and ctx.device == device
    yield ctx
    dist.destroy_process_group()
    _set_context(None)


def _data(n=96, dim=16, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    return TensorDataset(x, (x[:, :classes].argmax(1)))


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


class Net(kiln.Model):
    def __init__(self):
        super().__init__()
        self.net = _model()

    def forward(self, batch):
        return self.net(batch[0])

    def loss(self, outputs, batch):
        return nn.functional.cross_entropy(outputs, batch[1])

    def get_metrics(self, is_train=False):
        return {"Accuracy": kiln.metrics.Accuracy()}


def _fit_eval(strategy: str, precision: str) -> tuple[kiln.Trainer, dict[str, float]]:
    model = Net()
    trainer = kiln.Trainer(
        model,
        train_dataloader=DataLoader(_data(), batch_size=16),
        eval_dataloader=DataLoader(_data(seed=1), batch_size=16),
        max_duration="3ep",
        optimizers=torch.optim.AdamW(model.parameters(), lr=3e-3),
        strategy=strategy,
        precision=precision,
        progress_bar=False,
        callbacks=[kiln.callbacks.NaNMonitor(), kiln.callbacks.SpeedMonitor(window_size=2)],
    )
    trainer.fit()
    return trainer, trainer.eval()


# eval/loss of a strategy against the same run under "single", relative: fp32 differs only in
# reduction order; under amp_bf16, zero2/zero3 run the forward in FSDP2's bf16 parameters where
# "single" autocasts op by op (bf16 keeps 8 bits: 2**-8 = 0.4% per rounding, a few of them)
_STRATEGY_TOLERANCE = {"fp32": 1e-5, "amp_bf16": 2e-2}
_single: dict[str, dict[str, float]] = {}


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
@pytest.mark.parametrize("precision", ["fp32", "amp_bf16"])
def test_trainer_fit_eval_predict_on_one_rank_group(one_rank_group, strategy, precision):
    # fit + eval + predict issue every collective the Trainer has (loss averaging, the metric sync,
    # the even-forward count, predict's gather) on NCCL
    if precision not in _single:
        _single[precision] = _fit_eval("single", precision)[1]
    trainer, metrics = _fit_eval(strategy, precision)
    assert next(trainer.state.model.parameters()).device.type == one_rank_group.device.type
    # The evaluation's synced metrics are the evaluated model's: its gathered predictions on the
    # same data give the same accuracy, and their cross entropy the same loss.
    outputs = trainer.predict(DataLoader(_data(seed=1), batch_size=16), gather=True)
    logits, labels = torch.cat(outputs), _data(seed=1).tensors[1].to(one_rank_group.device)
    assert logits.shape == (96, 4)
    assert metrics["eval/Accuracy"] == pytest.approx((logits.argmax(1) == labels).float().mean().item(), abs=1e-6)
    # Their loss as the evaluation computes it: on the device, under the run's autocast. CUDA's
    # autocast cross entropy of bf16 logits keeps bf16's rounding in the log-softmax, so a float32
    # cross entropy of the same logits is ~1e-4 away (read on an H200: 1.15464 against 1.15449).
    with torch.autocast(logits.device.type, torch.bfloat16, enabled=precision == "amp_bf16"):
        expected = nn.functional.cross_entropy(logits, labels).item()
    assert metrics["eval/loss"] == pytest.approx(expected, rel=1e-5)
    # ... and the run is the "single" run's, up to the strategy's numerics; it learnt (chance: ln 4)
    assert metrics["eval/loss"] == pytest.approx(_single[precision]["eval/loss"], rel=_STRATEGY_TOLERANCE[precision])
    assert metrics["eval/loss"] < 0.9 * math.log(4)


def test_colossal_hooks_on_one_rank_group(one_rank_group):
    from kiln import hooks

    model, criterion = _model(), nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, train_dl, test_dl, _ = kiln.initialize(
        model,
        optimizer,
        criterion,
        DataLoader(_data(), batch_size=16),
        DataLoader(_data(seed=1), batch_size=32),
        config=dict(fp16=dict(mode=kiln.AMP_TYPE.TORCH)),
    )
    trainer = kiln.Trainer(engine=engine, logger=kiln.get_dist_logger())
    accuracy = kiln.metrics.Accuracy()
    trainer.fit(
        train_dataloader=train_dl,
        epochs=2,
        test_dataloader=test_dl,
        test_interval=1,
        hooks=[
            hooks.LossHook(),
            hooks.AccuracyHook(accuracy_func=accuracy),
            hooks.ThroughputHook(),
            hooks.LogMetricByEpochHook(kiln.get_dist_logger()),
        ],
        display_progress=False,
    )
    value = trainer.states["metrics"]["test"]["Accuracy"].get_accumulated_value()
    # The hook's accuracy (the last test epoch, after the last step) is the trained model's on the
    # test set, counted here directly
    x, y = _data(seed=1).tensors
    with torch.no_grad(), engine.precision.autocast(one_rank_group.device):
        predicted = engine.model(x.to(one_rank_group.device)).argmax(1).cpu()
    assert float(value) == pytest.approx((predicted == y).float().mean().item(), abs=1e-6)


def _engine_losses(precision: str, device: str, steps: int = 30) -> list[float]:
    model = _model()
    engine = kiln.Engine(
        model.to(device),
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        nn.CrossEntropyLoss(),
        precision=precision,
        clip_grad_norm=1.0,
    )
    x, y = _data().tensors
    x, y = x.to(device), y.to(device)
    losses = []
    for _ in range(steps):
        engine.zero_grad()
        loss = engine.criterion(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


# Each step's loss against the fp32 run's, relative. Autocast keeps fp32 weights and accumulates
# matmuls in fp32: the CPU gives 1e-4 for both over these 30 steps, and these bounds leave a
# factor of 10 (fp16's 11 bits) and 40 (bf16's 8). bf16 stores the weights and the loss itself in
# bf16, whose spacing at 1.0 is 2**-7 = 0.8%: the CPU gives 1.5% (2 spacings), the bound is 4.
_PRECISION_TOLERANCE = {"amp_fp16": 1e-3, "amp_bf16": 5e-3, "bf16": 4 * 2**-7}


@pytest.mark.parametrize("precision", ["amp_fp16", "amp_bf16", "bf16"])
@needs_cuda[0]
@needs_cuda[1]
def test_engine_precisions_train_on_cuda(precision):
    reference = _engine_losses("fp32", "cuda")
    losses = _engine_losses(precision, "cuda")
    worst = max(abs(a - b) / b for a, b in zip(losses, reference))
    assert worst <= _PRECISION_TOLERANCE[precision], (worst, losses, reference)
    assert losses[-1] < 0.8 * losses[0], losses  # and it learnt (the fp32 run: 1.39 -> 1.03)


@needs_cuda[0]
@needs_cuda[1]
def test_user_compiled_model_under_the_engine_matches_eager():
    # Trainer(compile=...) is a later lever; a model the user compiled must already train the same
    def run(compile_):
        model = _model().cuda()
        engine = kiln.Engine(
            torch.compile(model) if compile_ else model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            nn.CrossEntropyLoss(),
        )
        x, y = _data().tensors
        for _ in range(5):
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x.cuda()), y.cuda()))
            engine.step()
        return torch.cat([p.detach().flatten().cpu() for p in model.parameters()])

    assert torch.allclose(run(True), run(False), atol=1e-5)
