"""The fused/foreach step kiln picks when the user picks none (kiln.optim.implementation)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kiln
from kiln.optim import implementation
from kiln.optim.implementation import apply_default_implementation, choose_implementation


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


@pytest.fixture
def on_cuda(monkeypatch):
    """Every parameter reports CUDA to the choice (the kernels never run)."""
    monkeypatch.setattr(implementation, "_device_type", lambda tensor: "cuda")


def test_cpu_keeps_the_loop_for_plain_tensors_and_takes_foreach_for_dtensors(monkeypatch):
    # torch's own CPU default: foreach slows a few-tensor model's step (benchmarks/overhead_instructions.py)
    params = list(_model().parameters())
    for cls in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.RMSprop, torch.optim.Adagrad):
        assert choose_implementation(cls, params) == "for-loop", cls
    opt = torch.optim.SGD(params, lr=0.1)
    assert apply_default_implementation(opt) == {"for-loop": 1}
    assert opt.param_groups[0]["foreach"] is None and opt.param_groups[0]["fused"] is None  # left to torch
    # DTensors (FSDP2, tensor parallel over gloo): the loop would pay DTensor's dispatch per op and parameter
    monkeypatch.setattr(implementation, "_is_dtensor", lambda tensor: True)
    for cls in (torch.optim.AdamW, torch.optim.SGD):
        assert choose_implementation(cls, params) == "foreach", cls


def test_cuda_gets_fused_where_torch_has_it(on_cuda):
    params = list(_model().parameters())
    for cls in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD):
        assert choose_implementation(cls, params) == "fused", cls
    # no fused kernel (RMSprop), or state built for the loop in the constructor (Adagrad): foreach
    assert choose_implementation(torch.optim.RMSprop, params) == "foreach"
    assert choose_implementation(torch.optim.Adagrad, params) == "foreach"
    # fused wants floating point parameters and a fresh optimizer
    assert choose_implementation(torch.optim.AdamW, [torch.zeros(3, dtype=torch.long)]) == "foreach"
    assert choose_implementation(torch.optim.AdamW, params, has_state=True) == "foreach"
    assert choose_implementation(torch.optim.AdamW, params, differentiable=True) == "for-loop"


def test_dtensor_fused_only_for_adam(on_cuda, monkeypatch):
    # DTensor has sharding rules for _fused_adam(w)_ only: the other fused kernels would fail on FSDP2 parameters
    monkeypatch.setattr(implementation, "_is_dtensor", lambda tensor: True)
    params = [torch.zeros(4), torch.zeros(2)]
    assert choose_implementation(torch.optim.AdamW, params) == "fused"
    assert choose_implementation(torch.optim.SGD, params) == "foreach"


def test_other_optimizers_and_devices_are_left_alone(on_cuda, monkeypatch):
    params = list(_model().parameters())

    class MyAdam(torch.optim.AdamW):  # a subclass outside torch.optim may not take what torch's does
        pass

    assert choose_implementation(MyAdam, params) == "for-loop"
    monkeypatch.setattr(implementation, "_device_type", lambda tensor: "mps")
    assert choose_implementation(torch.optim.AdamW, params) == "for-loop"


def test_apply_fills_only_unset_groups(on_cuda):
    model = _model()
    first, second = model[0].parameters(), model[2].parameters()
    opt = torch.optim.AdamW([{"params": first}, {"params": second, "foreach": False}], lr=0.1)
    assert apply_default_implementation(opt) == {"fused": 1}
    assert opt.param_groups[0]["fused"] is True and opt.param_groups[0]["foreach"] is False
    assert opt.param_groups[1]["foreach"] is False and opt.param_groups[1]["fused"] is None  # the user's choice
    assert not getattr(opt, "_step_supports_amp_scaling", False)  # one group is not fused: the scaler unscales
    explicit = torch.optim.SGD(model.parameters(), lr=0.1, fused=False)
    assert apply_default_implementation(explicit) == {} and explicit.param_groups[0]["foreach"] is None
    all_fused = torch.optim.Adam(model.parameters(), lr=0.1)
    assert apply_default_implementation(all_fused) == {"fused": 1} and all_fused._step_supports_amp_scaling
    assert apply_default_implementation(object()) == {}  # not a torch optimizer (DeepSpeed's): untouched


def test_foreach_on_cpu_gives_the_loops_bits():
    """foreach (kiln's choice for DTensors on the CPU, or the user's) must not move a number: a
    checkpoint saved with either implementation resumes alike, golden runs included."""
    results = {}
    for foreach in (False, None):
        model = _model().double()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, foreach=foreach is None)
        x = torch.randn(32, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        for _ in range(5):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        results[foreach] = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(results[False], results[None]))


def test_trainer_applies_the_default(on_cuda):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = [(torch.randn(4, 8), torch.randint(0, 4, (4,))) for _ in range(2)]
    trainer = kiln.Trainer(
        model,
        optimizers=opt,
        criterion=nn.CrossEntropyLoss(),
        train_dataloader=data,
        max_duration="1ba",
        progress_bar=False,
    )
    assert trainer.engine.optimizer.param_groups[0]["fused"] is True  # "CUDA" (the fixture); fused runs on the CPU too
    trainer.fit()
    other_model = _model()
    explicit = torch.optim.SGD(other_model.parameters(), lr=0.1, foreach=False)
    other = kiln.Trainer(other_model, optimizers=explicit, criterion=nn.CrossEntropyLoss(), progress_bar=False)
    assert other.engine.optimizer.param_groups[0]["foreach"] is False


def test_initialize_applies_the_default_and_the_users_choice_wins(on_cuda):
    model = _model()
    engine, *_ = kiln.initialize(model, torch.optim.AdamW(model.parameters(), lr=0.01), nn.MSELoss())
    assert engine.optimizer.param_groups[0]["fused"] is True
    other = _model()
    engine, *_ = kiln.initialize(other, torch.optim.AdamW(other.parameters(), lr=0.01, foreach=False), nn.MSELoss())
    assert engine.optimizer.param_groups[0]["foreach"] is False and engine.optimizer.param_groups[0]["fused"] is None


@pytest.fixture
def first_is_dtensor(monkeypatch):
    """Tensors marked `dtensor` count as DTensors (of one mesh): a tensor-parallel layer beside plain ones."""
    monkeypatch.setattr(implementation, "_is_dtensor", lambda tensor: getattr(tensor, "dtensor", False))


def _mixed_params() -> list[nn.Parameter]:
    params = list(_model().parameters())
    params[0].dtensor = True  # type: ignore[attr-defined]
    return params


def test_a_group_mixing_dtensors_and_tensors_steps_in_a_loop(first_is_dtensor):
    params = _mixed_params()
    assert choose_implementation(torch.optim.AdamW, params) == "for-loop"
    opt = torch.optim.AdamW(params, lr=0.1)
    assert apply_default_implementation(opt) == {"for-loop": 1}
    # said explicitly: torch's own default (None) picks foreach for such a group on CUDA, and fails
    assert opt.param_groups[0]["foreach"] is False and opt.param_groups[0]["fused"] is False


def test_the_choice_follows_parameters_a_strategy_points_the_groups_at(first_is_dtensor, on_cuda):
    """A pipeline builds its stages at the first forward: the groups kiln filled choose again when
    repoint_optimizer hands them the stage's parameters; the user's group keeps its choice."""
    from kiln.parallel.state.optimizer_params import parameter_names, repoint_optimizer

    model = _model()
    names = parameter_names(model)
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters(), "foreach": True}])
    assert apply_default_implementation(opt) == {"fused": 1}
    stage = {name: nn.Parameter(p.detach().clone()) for name, p in model.named_parameters()}
    stage["0.weight"].dtensor = True  # type: ignore[attr-defined]  # tensor parallel split it; 0.bias stays plain
    stage["2.weight"].dtensor = True  # type: ignore[attr-defined]
    repoint_optimizer(opt, names, stage, strategy="pp")
    assert opt.param_groups[0]["params"][0] is stage["0.weight"]
    assert opt.param_groups[0]["foreach"] is False and not opt.param_groups[0]["fused"]  # now a mix: the loop
    assert opt.param_groups[1]["foreach"] is True  # the user's, as it was
    plain = {name: nn.Parameter(p.detach().clone()) for name, p in model.named_parameters()}
    repoint_optimizer(opt, {id(p): n for n, p in stage.items()}, plain, strategy="pp")
    assert opt.param_groups[0]["fused"] is True  # plain tensors again: fused again
