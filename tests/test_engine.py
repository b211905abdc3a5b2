"""Engine: accumulation, clipping, precision, strategy selection, DDP with 2 real processes."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import kiln
from distributed import WORKERS, check, fork_run


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def test_four_accumulated_steps_equal_one_big_batch():
    x, y = _data(32)
    big = _model()
    small = copy.deepcopy(big)
    eng_big, *_ = kiln.initialize(big, torch.optim.SGD(big.parameters(), lr=0.5), nn.CrossEntropyLoss())
    eng_big.zero_grad()
    eng_big.backward(eng_big.criterion(eng_big(x), y))
    eng_big.step()

    eng, *_ = kiln.initialize(
        small, torch.optim.SGD(small.parameters(), lr=0.5), nn.CrossEntropyLoss(), config={"gradient_accumulation": 4}
    )
    before = copy.deepcopy(small.state_dict())
    for i in range(4):
        eng.zero_grad()
        eng.backward(eng.criterion(eng(x[i * 8 : (i + 1) * 8]), y[i * 8 : (i + 1) * 8]))
        stepped = eng.step()
        assert stepped == (i == 3)
        if i < 3:
            assert all(torch.equal(before[k], v) for k, v in small.state_dict().items()), f"weights moved at call {i}"
    for (k, a), b in zip(big.state_dict().items(), small.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), k


class _DoublingBackward(kiln.parallel.SingleDevice):
    """A strategy that overrides only backward: counts the calls and doubles the loss."""

    name = "doubling-backward"

    def __init__(self):
        self.calls: list[float | None] = []

    def backward(self, model, loss, scale, scaler):
        self.calls.append(scale)
        super().backward(model, loss * 2, scale, scaler)


def test_a_strategy_overriding_only_backward_runs_under_the_engine():
    # The Engine hands backward to the strategy under every strategy; one that overrides only
    # backward keeps the Engine's accumulation scale, clipping and optimizer step.
    x, y = _data(16)
    plain, custom = _model(), _model()
    strategy = _DoublingBackward()
    engines = [
        kiln.Engine(
            m,
            torch.optim.SGD(m.parameters(), lr=0.5),
            nn.CrossEntropyLoss(),
            strategy=s,
            gradient_accumulation=2,
            clip_grad_norm=1e6,
        )
        for m, s in ((plain, "single"), (custom, strategy))
    ]
    grads = []
    for eng in engines:
        for i in range(2):
            eng.zero_grad()
            eng.backward(eng.criterion(eng(x[i * 8 : (i + 1) * 8]), y[i * 8 : (i + 1) * 8]))
            if i == 1:  # the accumulated gradients, before the optimizer step
                grads.append([p.grad.clone() for p in eng.model.parameters()])
            assert eng.step() == (i == 1)
    assert strategy.calls == [0.5, 0.5]  # 1/gradient_accumulation, as the Engine computes it
    for a, b in zip(*grads):
        assert torch.equal(a * 2, b)
    plain_eng, custom_eng = engines
    assert torch.equal(custom_eng.last_grad_norm, plain_eng.last_grad_norm * 2)  # clipped by the Engine
    assert not torch.equal(custom.state_dict()["0.weight"], _model().state_dict()["0.weight"])  # and stepped


def test_scheduler_steps_once_per_accumulation_cycle():
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _, _, _, wrapped = kiln.initialize(m, opt, nn.MSELoss(), lr_scheduler=sched, config={"gradient_accumulation": 3})
    for _ in range(5):
        wrapped.step()
    assert opt.param_groups[0]["lr"] == 0.5 and wrapped.get_last_lr() == [0.5]
    wrapped.step()
    assert opt.param_groups[0]["lr"] == 0.25


def test_clipping_bounds_the_global_norm():
    m = _model()
    eng, *_ = kiln.initialize(
        m, torch.optim.SGD(m.parameters(), lr=0.0), nn.CrossEntropyLoss(), config={"clip_grad_norm": 0.05}
    )
    x, y = _data(16)
    eng.zero_grad()
    eng.backward(eng.criterion(eng(x), y) * 100)
    eng.step()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in m.parameters()]))
    assert eng.last_grad_norm > 0.05 and norm <= 0.05 * (1 + 1e-5)


def test_amp_fp16_skips_step_on_inf_and_lowers_scale():
    m = _model()
    eng, *_ = kiln.initialize(
        m,
        torch.optim.SGD(m.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        config={"fp16": {"mode": kiln.AMP_TYPE.TORCH}, "clip_grad_norm": 1.0},
    )
    assert eng.precision.name == "amp_fp16" and eng.scaler is not None
    x, y = _data(8)
    before = copy.deepcopy(m.state_dict())
    scale = eng.scaler.get_scale()
    eng.zero_grad()
    out = eng(x)
    assert out.dtype == torch.float16  # the forward ran under autocast
    eng.backward(eng.criterion(out, y))
    m[0].weight.grad[0, 0] = float("inf")
    eng.step()
    assert eng.scaler.get_scale() == scale * 0.5
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    # a clean step goes through
    eng.zero_grad()
    eng.backward(eng.criterion(eng(x), y))
    eng.step()
    assert not torch.equal(before["0.weight"], m[0].weight)


@pytest.mark.parametrize("name,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_low_precision_params_and_inputs(name, dtype):
    m = _model()
    eng, *_ = kiln.initialize(
        m, torch.optim.SGD(m.parameters(), lr=0.1), nn.CrossEntropyLoss(), config={"precision": name}
    )
    assert all(p.dtype == dtype for p in m.parameters())
    x, y = _data(8)
    eng.zero_grad()
    out = eng(x)
    assert out.dtype == dtype
    eng.backward(eng.criterion(out.float(), y))
    w = m[0].weight.detach().clone()
    eng.step()
    assert not torch.equal(w, m[0].weight)


def test_amp_bf16_autocasts_forward():
    m = _model()
    eng, *_ = kiln.initialize(
        m, torch.optim.SGD(m.parameters(), lr=0.1), nn.CrossEntropyLoss(), config={"precision": "amp_bf16"}
    )
    out = eng(_data(4)[0])
    assert out.dtype == torch.bfloat16 and m[0].weight.dtype == torch.float32 and eng.scaler is None


def test_per_tensor_type_precision():
    m = nn.BatchNorm1d(8)
    eng, *_ = kiln.initialize(
        m,
        torch.optim.SGD(m.parameters(), lr=0.1),
        config={"precision": {"param": "bf16", "buffer": "fp32", "input": "bf16"}},
    )
    assert m.weight.dtype == torch.bfloat16 and m.running_mean.dtype == torch.float32
    assert eng.precision.cast_input(torch.ones(2)).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "config,message",
    [
        ({"strategy": "zero9"}, "strategy='zero9' is not known; expected one of"),
        ({"precision": "fp8"}, "precision='fp8' is not known; expected one of fp32, amp_bf16"),
        ({"fp16": {"mode": "weird"}}, "fp16.mode='weird' is not known"),
        ({"gradient_accumulation": 0}, "gradient_accumulation=0 must be an integer >= 1"),
        ({"clip_grad_norm": -1}, "clip_grad_norm=-1 must be a positive number"),
        ({"precision": {"param": "fp64"}}, "precision\\['param'\\]='fp64' is not a dtype name"),
    ],
)
def test_bad_config_names_the_key(config, message):
    m = _model()
    with pytest.raises(ValueError, match=message):
        kiln.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), config=config)


def test_state_dict_round_trip():
    m = _model()
    eng, *_ = kiln.initialize(
        m, torch.optim.Adam(m.parameters(), lr=0.1), nn.CrossEntropyLoss(), config={"precision": "amp_fp16"}
    )
    x, y = _data(8)
    eng.zero_grad()
    eng.backward(eng.criterion(eng(x), y))
    eng.step()  # noqa: E702
    sd = copy.deepcopy(eng.state_dict())
    m2 = _model(seed=5)
    eng2, *_ = kiln.initialize(
        m2, torch.optim.Adam(m2.parameters(), lr=0.1), nn.CrossEntropyLoss(), config={"precision": "amp_fp16"}
    )
    eng2.load_state_dict(sd)
    for e in (eng, eng2):
        e.zero_grad()
        e.backward(e.criterion(e(x), y))
        e.step()  # noqa: E702
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values()))
    assert eng2.scaler.get_scale() == eng.scaler.get_scale()


def test_full_model_state_dict_single():
    m = _model()
    eng, *_ = kiln.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1))
    sd = kiln.parallel.full_model_state_dict(eng.model)
    assert list(sd) == ["0.weight", "0.bias", "2.weight", "2.bias"]


@pytest.mark.parametrize("accum", [1, 2])
def test_ddp_two_processes(tmp_path, accum):
    check(fork_run(WORKERS / "ddp_worker.py", str(tmp_path), str(accum)))
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["identical"] and r1["identical"]
    assert r0["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert r0["len"] == 8  # 64 samples / 2 ranks / batch 4: the sampler split the data
    if accum > 1:
        assert r0["unsynced_differs"] == [True] * 4  # no all-reduce on non-final micro-steps


@pytest.mark.parametrize(
    "parallel, named",
    [
        (dict(pipeline=2), "pipeline=2, tensor=1"),
        (dict(tensor=dict(size=2, mode="1d")), "pipeline=1, tensor=2"),
    ],
)
def test_colossal_parallel_sizes_are_refused_not_ignored(parallel, named):
    # Colossal-AI's parallel section: kiln does not read it, so a size above 1 must stop the run
    # rather than train on data parallelism alone.
    model = _model()
    with pytest.raises(ValueError) as exc:
        kiln.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), config={"parallel": parallel}
        )
    assert named in str(exc.value) and "strategy=dict(name='hybrid'" in str(exc.value)


def test_colossal_parallel_data_only_or_with_a_strategy_runs():
    model = _model()
    for config in (
        {"parallel": dict(data=1, tensor=dict(size=1))},
        {"parallel": dict(pipeline=2), "strategy": "single"},
    ):
        engine, *_ = kiln.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), config=config
        )
        assert type(engine.strategy).__name__ == "SingleDevice"
