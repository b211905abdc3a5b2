"""Colossal-AI step-counted schedulers: closed forms at every step, exact resume, argument errors.

The expected learning rates below are written out independently of the implementation, from the
formulas in the `kiln.optim.colossal` docstrings (which follow Colossal-AI's ``colossalai.nn.lr_scheduler``).
Every schedule is checked a few steps past ``total_steps`` too, where it must hold its final value.
"""

import doctest
import io
import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch.optim import lr_scheduler as torch_sched

from kiln.optim import colossal, colossal_plain, colossal_warmup
from kiln.optim.colossal import (
    CosineAnnealingLR,
    CosineAnnealingWarmupLR,
    ExponentialLR,
    FlatAnnealingLR,
    FlatAnnealingWarmupLR,
    LinearWarmupLR,
    MultiStepLR,
    MultiStepWarmupLR,
    OneCycleLR,
    PolynomialLR,
    PolynomialWarmupLR,
)

BASE_LRS = (0.1, 0.03)  # two param groups, so per-group base_lrs are exercised
EXTRA_STEPS = 3  # steps checked past total_steps


def _optimizer() -> torch.optim.SGD:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in BASE_LRS]
    return torch.optim.SGD(groups, lr=BASE_LRS[0], momentum=0.9)


def _warm(base: float, step: int, warmup: int) -> float:
    return base * (step + 1) / warmup


def _cos(start: float, end: float, t: float, span: float) -> float:
    return end + (start - end) * (1 + math.cos(math.pi * t / span)) / 2


def _one_cycle(total: int, pct: float, strategy: str, div: float, final_div: float):
    """torch's two-phase 1cycle (lr and momentum) as a function of (base, step)."""
    if strategy == "cos":
        anneal = lambda a, b, x: b + (a - b) * (1 + math.cos(math.pi * x)) / 2  # noqa: E731
    else:
        anneal = lambda a, b, x: a + (b - a) * x  # noqa: E731
    peak_end = pct * total - 1

    def pct_of(step: int) -> tuple[bool, float]:
        step = min(step, total - 1)  # held after the last step
        if step <= peak_end:
            return True, step / peak_end
        return False, (step - peak_end) / (total - 1 - peak_end)

    def lr(base: float, step: int) -> float:
        rising, x = pct_of(step)
        low = base / div
        return anneal(low, base, x) if rising else anneal(base, low / final_div, x)

    def momentum(step: int) -> float:
        rising, x = pct_of(step)
        return anneal(0.95, 0.85, x) if rising else anneal(0.85, 0.95, x)

    return lr, momentum


@dataclass
class Case:
    name: str
    build: Callable[[torch.optim.Optimizer], torch_sched.LRScheduler]
    total_steps: int
    expected: Callable[[float, int], float]  # (base_lr, step clamped to total_steps) -> lr
    momentum: Callable[[int], float] | None = None


def _cases() -> list[Case]:
    cases: list[Case] = []
    add = cases.append

    add(Case("cosine", lambda o: CosineAnnealingLR(o, 20, eta_min=0.001), 20, lambda b, s: _cos(b, 0.001, s, 20)))

    def cosine_warmup(b: float, s: int) -> float:
        return _warm(b, s, 5) if s < 5 else _cos(b, 0.001, s - 5, 15)

    add(Case("cosine_warmup", lambda o: CosineAnnealingWarmupLR(o, 20, 5, eta_min=0.001), 20, cosine_warmup))
    add(Case("cosine_warmup_0", lambda o: CosineAnnealingWarmupLR(o, 20), 20, lambda b, s: _cos(b, 0.0, s, 20)))

    flat = int(20 * 0.72)  # Colossal-AI's flat length: 14 of 20 steps

    def flat_annealing(b: float, s: int) -> float:
        return b if s < flat else _cos(b, 0.0, s - flat, 20 - flat)

    add(Case("flat", lambda o: FlatAnnealingLR(o, 20), 20, flat_annealing))

    def flat_warmup(b: float, s: int) -> float:  # W=4, F=int(20 * 0.5)=10, anneal over 10
        if s < 4:
            return _warm(b, s, 4)
        return b if s < 14 else _cos(b, 0.002, s - 14, 10)

    add(Case("flat_warmup", lambda o: FlatAnnealingWarmupLR(o, 24, 4, pct_start=0.5, eta_min=0.002), 24, flat_warmup))

    def linear_warmup(b: float, s: int) -> float:  # Colossal-AI's LinearWarmupLR ramps over W + 1
        return b * (s + 1) / 6 if s < 5 else b * (20 - s) / 15

    add(Case("linear_warmup", lambda o: LinearWarmupLR(o, 20, 5), 20, linear_warmup))
    add(Case("linear_warmup_0", lambda o: LinearWarmupLR(o, 20), 20, lambda b, s: b * (20 - s) / 20))

    def multistep(b: float, s: int) -> float:
        return b * 0.5 ** sum(m <= s for m in (5, 12, 15))

    add(Case("multistep", lambda o: MultiStepLR(o, 20, milestones=[5, 12, 15], gamma=0.5), 20, multistep))

    def multistep_warmup(b: float, s: int) -> float:  # milestone 2 falls inside warmup: ignored
        return _warm(b, s, 4) if s < 4 else b * 0.1 ** sum(4 <= m <= s for m in (2, 4, 10))

    add(Case("multistep_warmup", lambda o: MultiStepWarmupLR(o, 20, 4, milestones=[2, 4, 10]), 20, multistep_warmup))

    def poly(b: float, s: int) -> float:
        return (b - 0.001) * (1 - s / 20) ** 2.0 + 0.001

    add(Case("poly", lambda o: PolynomialLR(o, 20, end_lr=0.001, power=2.0), 20, poly))

    def poly_warmup(b: float, s: int) -> float:
        return _warm(b, s, 5) if s < 5 else (b - 0.001) * (1 - (s - 5) / 15) ** 0.5 + 0.001

    add(Case("poly_warmup", lambda o: PolynomialWarmupLR(o, 20, 5, end_lr=0.001, power=0.5), 20, poly_warmup))
    add(Case("exponential", lambda o: ExponentialLR(o, 20, gamma=0.9), 20, lambda b, s: b * 0.9**s))

    lr, momentum = _one_cycle(20, 0.3, "cos", 25.0, 10000.0)
    add(Case("one_cycle_cos", lambda o: OneCycleLR(o, 20), 20, lr, momentum))
    lr, momentum = _one_cycle(15, 0.4, "linear", 10.0, 100.0)
    build = lambda o: OneCycleLR(o, 15, 0.4, "linear", div_factor=10.0, final_div_factor=100.0)  # noqa: E731
    add(Case("one_cycle_linear", build, 15, lr, momentum))
    return cases


CASES = _cases()
ids = [case.name for case in CASES]


def _run(sched: torch_sched.LRScheduler, opt: torch.optim.Optimizer, num_steps: int) -> list[list[float]]:
    """Record every group's (lr, momentum) for ``num_steps`` steps, stepping like a training loop."""
    seen = []
    for _ in range(num_steps):
        seen.append([(group["lr"], group["momentum"]) for group in opt.param_groups])
        opt.step()
        sched.step()
    return seen


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_is_a_torch_lr_scheduler(case: Case) -> None:
    assert isinstance(case.build(_optimizer()), torch_sched.LRScheduler)


@pytest.mark.parametrize(
    ("cls", "torch_cls", "kwargs"),
    [
        (CosineAnnealingLR, torch_sched.CosineAnnealingLR, {}),
        (MultiStepLR, torch_sched.MultiStepLR, {"milestones": [3]}),
        (OneCycleLR, torch_sched.OneCycleLR, {}),
        (PolynomialLR, torch_sched.PolynomialLR, {}),
        (ExponentialLR, torch_sched.ExponentialLR, {}),
    ],
)
def test_plain_schedules_subclass_torch_family(cls, torch_cls, kwargs) -> None:
    assert isinstance(cls(_optimizer(), 10, **kwargs), torch_cls)


@pytest.mark.filterwarnings("error")  # no torch ordering or get_lr warnings in a normal loop
@pytest.mark.parametrize("case", CASES, ids=ids)
def test_matches_closed_form_at_every_step(case: Case) -> None:
    opt = _optimizer()
    sched = case.build(opt)
    for step in range(case.total_steps + 1 + EXTRA_STEPS):
        clamped = min(step, case.total_steps)
        for base, group in zip(BASE_LRS, opt.param_groups):
            want = case.expected(base, clamped)
            assert math.isclose(group["lr"], want, rel_tol=1e-9, abs_tol=1e-15), (step, group["lr"], want)
            if case.momentum is not None:
                assert math.isclose(group["momentum"], case.momentum(clamped), rel_tol=1e-9), step
        assert sched.get_last_lr() == [group["lr"] for group in opt.param_groups]
        opt.step()
        sched.step()


def _round_trip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)  # checkpoints must be plain data


@pytest.mark.parametrize("case", CASES, ids=ids)
@pytest.mark.parametrize("stop", [0.0, 0.2, 0.5, 1.0])
def test_state_dict_round_trip_continues_identically(case: Case, stop: float) -> None:
    num_steps = case.total_steps + 1 + EXTRA_STEPS
    resume_at = round(stop * case.total_steps)
    opt = _optimizer()
    reference = _run(case.build(opt), opt, num_steps)

    opt = _optimizer()
    sched = case.build(opt)
    before = _run(sched, opt, resume_at)
    saved = _round_trip({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()})

    resumed_opt = _optimizer()
    resumed = case.build(resumed_opt)  # built first: building a scheduler writes the optimizer's lr
    resumed_opt.load_state_dict(saved["optimizer"])
    resumed.load_state_dict(saved["scheduler"])
    assert resumed.last_epoch == resume_at
    after = _run(resumed, resumed_opt, num_steps - resume_at)
    assert before + after == reference  # exact, not approximate


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_scheduler_state_alone_gives_identical_lrs(case: Case) -> None:
    # The closed form depends on last_epoch and base_lrs only, not on the optimizer's current lr
    # (which torch's recursive schedulers multiply), so from the next step() on it is exact even if
    # the optimizer's param_groups were never restored.
    total, half = case.total_steps, case.total_steps // 2
    opt = _optimizer()
    reference = _run(case.build(opt), opt, total + 1)
    opt = _optimizer()
    sched = case.build(opt)
    _run(sched, opt, half)
    fresh_opt = _optimizer()
    fresh = case.build(fresh_opt)
    fresh.load_state_dict(_round_trip(sched.state_dict()))
    fresh_opt.step()
    fresh.step()  # to step half + 1, from state alone
    assert _run(fresh, fresh_opt, total - half) == reference[half + 1 :]


def test_warmup_state_dict_nests_the_after_scheduler() -> None:
    sched = CosineAnnealingWarmupLR(_optimizer(), 10, 3)
    state = sched.state_dict()
    assert isinstance(state["after_scheduler"], dict)
    assert state["after_scheduler"]["T_max"] == 7
    assert "optimizer" not in state and "optimizer" not in state["after_scheduler"]


def test_warmup_forms_importable_from_colossal() -> None:
    for name in colossal.__all__:
        assert getattr(colossal, name) is getattr(colossal_warmup, name, getattr(colossal, name))
    assert colossal.CosineAnnealingWarmupLR is colossal_warmup.CosineAnnealingWarmupLR
    with pytest.raises(AttributeError):
        colossal.NoSuchScheduler  # noqa: B018


def test_linear_warmup_peaks_once_at_warmup_steps() -> None:
    opt = _optimizer()
    lrs = [lr for lr, _ in (row[0] for row in _run(LinearWarmupLR(opt, 10, 3), opt, 11))]
    assert max(lrs) == BASE_LRS[0] and lrs.index(max(lrs)) == 3 and lrs.count(max(lrs)) == 1
    assert lrs[-1] == 0.0


def _bad(build: Callable[[torch.optim.Optimizer], object]) -> Callable[[], object]:
    return lambda: build(_optimizer())


BAD_ARGUMENTS = [
    # (argument the message must name, the value it must show, constructor call)
    ("total_steps", "0", _bad(lambda o: CosineAnnealingLR(o, 0))),
    ("total_steps", "2.5", _bad(lambda o: PolynomialLR(o, 2.5))),
    ("total_steps", "True", _bad(lambda o: ExponentialLR(o, True))),
    ("total_steps", "-3", _bad(lambda o: OneCycleLR(o, -3))),
    ("total_steps", "0", _bad(lambda o: MultiStepLR(o, 0, milestones=[1]))),
    ("total_steps", "0", _bad(lambda o: FlatAnnealingLR(o, 0))),
    ("total_steps", "0", _bad(lambda o: LinearWarmupLR(o, 0))),
    ("warmup_steps", "10", _bad(lambda o: CosineAnnealingWarmupLR(o, 10, 10))),
    ("warmup_steps", "-1", _bad(lambda o: LinearWarmupLR(o, 10, -1))),
    ("warmup_steps", "12", _bad(lambda o: MultiStepWarmupLR(o, 10, 12, milestones=[5]))),
    ("warmup_steps", "10", _bad(lambda o: PolynomialWarmupLR(o, 10, 10))),
    ("warmup_steps", "2.0", _bad(lambda o: FlatAnnealingWarmupLR(o, 10, 2.0))),
    ("eta_min", "-0.1", _bad(lambda o: CosineAnnealingLR(o, 10, eta_min=-0.1))),
    ("eta_min", "-0.1", _bad(lambda o: CosineAnnealingWarmupLR(o, 10, 2, eta_min=-0.1))),
    ("pct_start", "1.0", _bad(lambda o: FlatAnnealingLR(o, 10, pct_start=1.0))),
    ("pct_start", "-0.5", _bad(lambda o: FlatAnnealingWarmupLR(o, 10, 2, pct_start=-0.5))),
    ("pct_start", "1.5", _bad(lambda o: OneCycleLR(o, 10, pct_start=1.5))),
    ("pct_start", "0.1", _bad(lambda o: OneCycleLR(o, 10, pct_start=0.1))),  # a 1-step rise: torch divides by 0
    ("anneal_strategy", "exp", _bad(lambda o: OneCycleLR(o, 10, anneal_strategy="exp"))),
    ("div_factor", "0", _bad(lambda o: OneCycleLR(o, 10, div_factor=0))),
    ("milestones", "None", _bad(lambda o: MultiStepLR(o, 10))),
    ("milestones", "[5, 3]", _bad(lambda o: MultiStepLR(o, 10, milestones=[5, 3]))),
    ("milestones", "[-1]", _bad(lambda o: MultiStepWarmupLR(o, 10, 2, milestones=[-1]))),
    ("milestones", "None", _bad(lambda o: MultiStepWarmupLR(o, 10, 2))),
    ("gamma", "0", _bad(lambda o: MultiStepLR(o, 10, milestones=[2], gamma=0))),
    ("gamma", "-0.5", _bad(lambda o: ExponentialLR(o, 10, gamma=-0.5))),
    ("end_lr", "-1", _bad(lambda o: PolynomialLR(o, 10, end_lr=-1))),
    ("power", "0", _bad(lambda o: PolynomialWarmupLR(o, 10, 2, power=0))),
]


@pytest.mark.parametrize(("argument", "value", "call"), BAD_ARGUMENTS, ids=[f"{a}={v}" for a, v, _ in BAD_ARGUMENTS])
def test_bad_arguments_raise_value_error_naming_them(argument: str, value: str, call) -> None:
    with pytest.raises(ValueError) as excinfo:
        call()
    message = str(excinfo.value)
    assert argument in message and value in message, message


@pytest.mark.parametrize(
    "module", [colossal, colossal_plain, colossal_warmup], ids=["colossal", "colossal_plain", "colossal_warmup"]
)
def test_docstring_examples_run(module) -> None:
    result = doctest.testmod(module, extraglobs={"torch": torch}, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
