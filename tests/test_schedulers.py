"""Tests for kiln.optim.schedulers: each multiplier against its closed form, warmup, ssr, torch glue."""

import io
import math
import types

import pytest
import torch

from kiln.core.time import Time, Timestamp
from kiln.optim.lr_scheduler import ComposerLRScheduler, compile_composer_scheduler
from kiln.optim.schedulers import (
    ComposerScheduler,
    ConstantScheduler,
    ConstantWithWarmupScheduler,
    CosineAnnealingScheduler,
    CosineAnnealingWarmRestartsScheduler,
    CosineAnnealingWithWarmupScheduler,
    ExponentialScheduler,
    LinearScheduler,
    LinearWithWarmupScheduler,
    MultiStepScheduler,
    MultiStepWithWarmupScheduler,
    PolynomialScheduler,
    PolynomialWithWarmupScheduler,
    StepScheduler,
)


def make_state(max_duration, dataloader_len=None):
    state = types.SimpleNamespace(timestamp=Timestamp(), max_duration=Time.from_timestring(max_duration))
    if dataloader_len is not None:
        state.dataloader_len = dataloader_len
    return state


def run_to(state, batch, per_epoch=None, samples=4):
    """Advance state.timestamp from its current batch to ``batch``, rolling epochs every ``per_epoch``."""
    ts = state.timestamp
    while ts.batch.value < batch:
        ts.advance_batch(samples=samples)
        if per_epoch is not None and ts.batch_in_epoch.value == per_epoch:
            ts.advance_epoch()
    return state


def curve(scheduler, state, batches, per_epoch=None, ssr=1.0):
    out = []
    for b in batches:
        run_to(state, b, per_epoch)
        out.append(scheduler(state, ssr))
    return out


BATCHES = list(range(0, 121, 3))


def cos_anneal(frac, alpha_f=0.0):
    return alpha_f + (1 - alpha_f) * (1 + math.cos(math.pi * frac)) / 2


# ---- plain schedulers --------------------------------------------------------------------------


@pytest.mark.parametrize(("ssr", "end"), [(1.0, 4), (0.5, 2), (2.0, 8)])
def test_constant(ssr, end):
    got = curve(ConstantScheduler(alpha=0.5, t_max="4ba"), make_state("10ba"), range(12), ssr=ssr)
    assert got == [0.5 if b < end else 1.0 for b in range(12)]


def test_constant_default_is_one():
    assert curve(ConstantScheduler(), make_state("10ba"), [0, 5, 10, 11]) == [1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize(("ssr", "step_epochs"), [(1.0, 3), (0.5, 1.5), (2.0, 6)])
def test_step_in_epochs(ssr, step_epochs):
    per_epoch = 5
    got = curve(StepScheduler(step_size="3ep", gamma=0.5), make_state("10ep"), range(0, 60), per_epoch, ssr)
    assert got == [0.5 ** math.floor((b // per_epoch) / step_epochs) for b in range(0, 60)]


def test_step_in_batches_with_dur_step():
    got = curve(StepScheduler(step_size="0.25dur", gamma=0.1), make_state("100ba"), BATCHES)
    assert got == [0.1 ** (b // 25) for b in BATCHES]


# The Trainer scales max_duration by ssr (10ep -> 20ep / 5ep); `dur` is a fraction of that scaled
# run and is not scaled again (Composer): whole epochs, rounded down.
@pytest.mark.parametrize(("ssr", "milestones"), [(1.0, [3, 5, 9]), (2.0, [6, 10, 18]), (0.5, [1, 2, 4])])
def test_multistep_dur_milestones_in_epochs(ssr, milestones):
    per_epoch = 4
    sched = MultiStepScheduler(milestones=["0.3dur", "0.5dur", "0.9dur"], gamma=0.1)
    batches = range(0, 80)
    got = curve(sched, make_state(f"{int(10 * ssr)}ep"), batches, per_epoch, ssr)
    assert got == [0.1 ** sum((b // per_epoch) >= m for m in milestones) for b in batches]


def test_multistep_dur_milestones_in_batches():
    sched = MultiStepScheduler(milestones=["0.3dur", "0.5dur", "0.9dur"], gamma=0.1)
    got = curve(sched, make_state("1000ba"), [0, 299, 300, 499, 500, 899, 900, 1000])
    assert got == [1.0, 1.0, 0.1, 0.1, 0.1**2, 0.1**2, 0.1**3, 0.1**3]


def test_multistep_mixed_units():
    sched = MultiStepScheduler(milestones=["2ep", "15ba"], gamma=0.5)
    got = curve(sched, make_state("10ep"), range(30), per_epoch=4)
    assert got == [0.5 ** (((b // 4) >= 2) + (b >= 15)) for b in range(30)]


@pytest.mark.parametrize("ssr", [1.0, 0.5, 2.0])
def test_exponential(ssr):
    got = curve(ExponentialScheduler(gamma=0.9, decay_period="10ba"), make_state("100ba"), BATCHES, ssr=ssr)
    assert got == [0.9 ** (b / (10 * ssr)) for b in BATCHES]


def test_exponential_default_period_is_one_epoch():
    got = curve(ExponentialScheduler(gamma=0.5), make_state("10ep"), range(40), per_epoch=8)
    assert got == [0.5 ** float(b // 8) for b in range(40)]


@pytest.mark.parametrize("ssr", [1.0, 0.5, 2.0])
def test_linear(ssr):
    got = curve(
        LinearScheduler(alpha_i=1.0, alpha_f=0.1, t_max="1dur"), make_state(f"{int(100 * ssr)}ba"), BATCHES, ssr=ssr
    )
    assert got == [1.0 + min(1.0, b / (100 * ssr)) * (0.1 - 1.0) for b in BATCHES]


@pytest.mark.parametrize("ssr", [1.0, 0.5, 2.0])
def test_cosine_in_batches(ssr):
    got = curve(
        CosineAnnealingScheduler(t_max="1dur", alpha_f=0.05), make_state(f"{int(100 * ssr)}ba"), BATCHES, ssr=ssr
    )
    assert got == [cos_anneal(min(1.0, b / (100 * ssr)), 0.05) for b in BATCHES]


def test_cosine_in_epochs_moves_per_epoch_without_dataloader_len():
    batches = range(0, 44)
    got = curve(CosineAnnealingScheduler(), make_state("10ep"), batches, per_epoch=4)
    assert got == [cos_anneal((b // 4) / 10) for b in batches]


def test_cosine_in_epochs_moves_per_batch_with_dataloader_len():
    batches = range(0, 44)
    for length in (4, Time(4, "ba")):
        got = curve(CosineAnnealingScheduler(), make_state("10ep", dataloader_len=length), batches, per_epoch=4)
        assert got == [cos_anneal(min(1.0, b / 40)) for b in batches]


def test_cosine_on_wall_clock():
    state = make_state("1h")
    out = []
    for _ in range(5):
        state.timestamp.advance_batch(samples=1, duration=900.0)
        out.append(CosineAnnealingScheduler()(state))
    assert out == [cos_anneal(min(1.0, k * 900.0 / 3600.0)) for k in range(1, 6)]


@pytest.mark.parametrize(
    ("t_mult", "ssr", "cycles"),
    [
        (1.0, 1.0, [10] * 20),
        (2.0, 1.0, [10, 20, 40, 80]),
        (2.0, 2.0, [20, 40, 80]),
        (1.5, 0.5, [5, 7, 10, 15, 22, 33]),
    ],
)
def test_cosine_warm_restarts(t_mult, ssr, cycles):
    def expected(b):
        start = 0.0
        for length in cycles:
            if b < start + length:
                return cos_anneal((b - start) / length, 0.1)
            start += length
        raise AssertionError("test cycles too short")

    sched = CosineAnnealingWarmRestartsScheduler(t_0="10ba", t_mult=t_mult, alpha_f=0.1)
    got = curve(sched, make_state("200ba"), range(0, 65), ssr=ssr)
    assert got == pytest.approx([expected(b) for b in range(0, 65)], rel=0, abs=1e-12)
    assert got[0] == 1.0


@pytest.mark.parametrize("ssr", [1.0, 0.5, 2.0])
def test_polynomial(ssr):
    got = curve(PolynomialScheduler(power=2.0, alpha_f=0.1), make_state(f"{int(100 * ssr)}ba"), BATCHES, ssr=ssr)
    assert got == [0.1 + 0.9 * (1 - min(1.0, b / (100 * ssr))) ** 2.0 for b in BATCHES]


# ---- warmup forms ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ssr", "scale_warmup", "warm", "t_max"),
    [
        (1.0, False, 10, 100),
        (2.0, False, 10, 200),
        (0.5, False, 10, 50),
        (2.0, True, 20, 200),
        (0.5, True, 5, 50),
    ],
)
def test_linear_with_warmup(ssr, scale_warmup, warm, t_max):
    sched = LinearWithWarmupScheduler(t_warmup="10ba", alpha_i=1.0, alpha_f=0.2, scale_warmup=scale_warmup)
    got = curve(sched, make_state(f"{t_max}ba"), BATCHES, ssr=ssr)  # the Trainer's max_duration: 100ba * ssr
    assert got == [b / warm if b < warm else 1.0 + min(1.0, (b - warm) / (t_max - warm)) * (0.2 - 1.0) for b in BATCHES]


def test_linear_with_warmup_ramps_to_alpha_i():
    got = curve(LinearWithWarmupScheduler(t_warmup="4ba", alpha_i=0.5, alpha_f=0.0), make_state("20ba"), range(21))
    assert got == [b / 4 * 0.5 if b < 4 else 0.5 + min(1.0, (b - 4) / 16) * (0.0 - 0.5) for b in range(21)]


@pytest.mark.parametrize("ssr", [1.0, 2.0])
def test_constant_with_warmup(ssr):
    got = curve(
        ConstantWithWarmupScheduler(t_warmup="4ba", alpha=0.5), make_state(f"{int(20 * ssr)}ba"), range(30), ssr=ssr
    )
    assert got == [b / 4 * 0.5 if b < 4 else 0.5 for b in range(30)]


@pytest.mark.parametrize(
    ("ssr", "scale_warmup", "warm", "t_max"),
    [
        (1.0, False, 10, 100),
        (2.0, False, 20, 200),
        (0.5, False, 5, 50),
        (2.0, True, 20, 200),
    ],
)
def test_cosine_with_warmup_dur_warmup_epoch_run(ssr, scale_warmup, warm, t_max):
    # 0.1dur of the scaled run (10ep * ssr, 10 batches per epoch): a `dur` warmup is a fraction of
    # the run the Trainer scaled, so it follows the ratio whatever scale_warmup says (Composer).
    sched = CosineAnnealingWithWarmupScheduler(t_warmup="0.1dur", alpha_f=0.1, scale_warmup=scale_warmup)
    state = make_state(f"{int(10 * ssr)}ep", dataloader_len=10)
    got = curve(sched, state, BATCHES, per_epoch=10, ssr=ssr)
    assert got == [b / warm if b < warm else cos_anneal(min(1.0, (b - warm) / (t_max - warm)), 0.1) for b in BATCHES]


def test_cosine_with_warmup_in_epochs():
    sched = CosineAnnealingWithWarmupScheduler(t_warmup="1ep")
    got = curve(sched, make_state("10ep"), range(0, 40), per_epoch=3)
    assert got == [0.0 if b < 3 else cos_anneal(min(1.0, (b // 3 - 1) / 9)) for b in range(0, 40)]


@pytest.mark.parametrize(
    ("ssr", "scale_warmup", "warm", "t_max"),
    [
        (1.0, False, 100, 1000),
        (2.0, False, 100, 2000),
        (0.5, True, 50, 500),
    ],
)
def test_polynomial_with_warmup(ssr, scale_warmup, warm, t_max):
    sched = PolynomialWithWarmupScheduler(t_warmup="100ba", power=2.0, alpha_f=0.0, scale_warmup=scale_warmup)
    batches = list(range(0, 2101, 50)) + [1, 49, 99, 101]
    got = curve(sched, make_state(f"{t_max}ba"), sorted(batches), ssr=ssr)
    assert got == [
        b / warm if b < warm else (1 - min(1.0, (b - warm) / (t_max - warm))) ** 2.0 for b in sorted(batches)
    ]


@pytest.mark.parametrize(("ssr", "milestones"), [(1.0, [4, 8]), (2.0, [8, 16]), (0.5, [2, 4])])
def test_multistep_with_warmup(ssr, milestones):
    sched = MultiStepWithWarmupScheduler(t_warmup="2ep", milestones=["4ep", "0.8dur"], gamma=0.1)
    got = curve(sched, make_state(f"{int(10 * ssr)}ep"), range(0, 60), per_epoch=3, ssr=ssr)
    assert got == [(b // 3) / 2 if b // 3 < 2 else 0.1 ** sum((b // 3) >= m for m in milestones) for b in range(0, 60)]


def test_zero_warmup_is_skipped():
    got = curve(CosineAnnealingWithWarmupScheduler(t_warmup="0ba"), make_state("10ba"), range(11))
    assert got == [cos_anneal(b / 10) for b in range(11)]


def test_warmup_and_t_max_in_different_units_need_dataloader_len():
    sched = LinearWithWarmupScheduler(t_warmup="5ba")
    state = run_to(make_state("10ep"), 7)
    with pytest.raises(ValueError, match="dataloader_len"):
        sched(state)
    state.dataloader_len = 10
    assert sched(state) == 1.0 - (7 - 5) / 95


# ---- contract ----------------------------------------------------------------------------------


def test_stateless_resume_gives_the_same_multiplier():
    sched = CosineAnnealingWithWarmupScheduler(t_warmup="0.1dur")
    state = run_to(make_state("100ba"), 37)
    resumed = make_state("100ba")
    resumed.timestamp.load_state_dict(state.timestamp.state_dict())
    assert sched(resumed) == sched(state) == cos_anneal(27 / 90)


def test_bad_arguments():
    with pytest.raises(ValueError, match="'10epochs'"):
        CosineAnnealingScheduler(t_max="10epochs")
    with pytest.raises(TypeError, match="list of times"):
        MultiStepScheduler(milestones="10ep")
    with pytest.raises(ValueError, match="t_mult"):
        CosineAnnealingWarmRestartsScheduler(t_0="1ep", t_mult=0.5)
    with pytest.raises(ValueError, match="max_duration"):
        LinearScheduler()(types.SimpleNamespace(timestamp=Timestamp(), max_duration=None))
    with pytest.raises(NotImplementedError):
        ComposerScheduler()(make_state("1ep"))


def test_repr_names_arguments():
    assert repr(StepScheduler("30ep", gamma=0.5)) == "StepScheduler(step_size=Time(30, TimeUnit.EPOCH), gamma=0.5)"


def _sgd(lr=0.1):
    return torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=lr)


@pytest.mark.parametrize("ssr", [1.0, 2.0])
def test_compile_composer_scheduler_sets_lr_every_batch(ssr):
    sched = CosineAnnealingWithWarmupScheduler(t_warmup="5ba", alpha_f=0.1)
    state = make_state(f"{int(50 * ssr)}ba")
    opt = _sgd(0.1)
    lr_sched = compile_composer_scheduler(sched, state, opt, ssr=ssr)
    assert isinstance(lr_sched, torch.optim.lr_scheduler.LRScheduler)
    assert opt.param_groups[0]["lr"] == 0.0  # built at batch 0, inside warmup
    for b in range(1, 120):
        state.timestamp.advance_batch(samples=8)
        opt.step()
        lr_sched.step()
        mult = b / 5 if b < 5 else cos_anneal(min(1.0, (b - 5) / (50 * ssr - 5)), 0.1)
        assert opt.param_groups[0]["lr"] == 0.1 * mult
        assert lr_sched.get_last_lr() == [0.1 * mult]


def test_compiled_scheduler_state_dict_is_plain_and_resumes():
    state = make_state("20ba")
    opt = _sgd(0.5)
    lr_sched = compile_composer_scheduler(LinearScheduler(alpha_f=0.0), state, opt)
    for _ in range(6):
        state.timestamp.advance_batch(samples=1)
        opt.step()
        lr_sched.step()
    sd = lr_sched.state_dict()
    assert "_schedule" not in sd and "_state" not in sd and "optimizer" not in sd
    buffer = io.BytesIO()
    torch.save({"sched": sd, "opt": opt.state_dict(), "ts": state.timestamp.state_dict()}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)

    state2 = make_state("20ba")
    state2.timestamp.load_state_dict(loaded["ts"])
    opt2 = _sgd(0.5)
    opt2.load_state_dict(loaded["opt"])
    lr_sched2 = ComposerLRScheduler(opt2, LinearScheduler(alpha_f=0.0), state2)
    lr_sched2.load_state_dict(loaded["sched"])
    assert lr_sched2.last_epoch == lr_sched.last_epoch == 6
    assert opt2.param_groups[0]["lr"] == 0.5 * (1 - 6 / 20)
    state2.timestamp.advance_batch(samples=1)
    opt2.step()
    lr_sched2.step()
    assert opt2.param_groups[0]["lr"] == 0.5 * (1 - 7 / 20)


def test_compile_uses_state_optimizers_and_multiple_groups():
    p1, p2 = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([{"params": [p1], "lr": 0.1}, {"params": [p2], "lr": 0.02}])
    state = make_state("10ba")
    state.optimizers = [opt]
    lr_sched = compile_composer_scheduler(LinearScheduler(), state)
    run_to(state, 4)
    opt.step()
    lr_sched.step()
    assert [g["lr"] for g in opt.param_groups] == [0.1 * (1 - 4 / 10), 0.02 * (1 - 4 / 10)]
    state.optimizers = []
    with pytest.raises(ValueError, match="optimizer="):
        compile_composer_scheduler(LinearScheduler(), state)
