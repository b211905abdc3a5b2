"""Activation memory on fake tensors (kiln.cost.activations) against the memory a real
step uses, and what `auto` and `kiln plan` do with it.

The real side: one forward and backward on real tensors (the outputs held through the backward, as
the Trainer holds ``state.outputs``), under ``torch.profiler`` with ``profile_memory=True``, whose
memory timeline records every allocation and free of the CPU allocator; its peak above the
memory held before the step (parameters, buffers, input) is compared with the estimate plus the
gradients (the plan's own column). On CUDA, ``torch.cuda.max_memory_allocated`` does the same.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from kiln.cost.activations import checkpointed_modules, estimate_activations
from kiln.cost.memory import plan_table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from digits_data import DigitsCNN  # noqa: E402

TOLERANCE = 0.25


def tiny_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


class _Checkpointed(nn.Module):
    """The real run's checkpointing, applied independently of the estimate's own wrapping."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def _with_checkpointing(model: nn.Module, mode: str | None) -> nn.Module:
    if mode is None:
        return model
    model = copy.deepcopy(model)
    for name in checkpointed_modules(model, mode)[0]:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, _Checkpointed(model.get_submodule(name)))
    return model


def measured_peak(model: nn.Module, step) -> int:
    """Peak bytes the CPU allocator hands out during ``step(model)`` beyond what it held before."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    model.zero_grad(set_to_none=True)
    if torch.cuda.is_available() and next(model.parameters()).is_cuda:
        # A first step allocates what the libraries keep for good (cuBLAS's and cuBLASLt's
        # workspaces, 32 MiB and more on an H200, through the same allocator): the first H200 run
        # measured 86 MB for the llama's 20 MB step. A step before the measured one puts them in
        # ``before``, as they are in every training step but the first.
        step(model)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step(model)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step(model)
    live = peak = 0
    for _, action, _, nbytes in prof._memory_profile().timeline:
        if action == Action.CREATE:
            live += nbytes
        elif action == Action.DESTROY:
            live -= nbytes
        peak = max(peak, live)
    return peak


def _llama_case(device: str = "cpu"):
    model = tiny_llama().to(device)
    ids = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(0)).to(device)
    batch = {"input_ids": ids, "labels": ids}

    def step(m):
        outputs = m(**batch)  # held through the backward, as the Trainer's state.outputs
        outputs.loss.backward()
        return outputs

    return model, batch, step


def _cnn_case(device: str = "cpu"):
    torch.manual_seed(0)
    model = DigitsCNN().to(device)
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(64, 1, 8, 8, generator=g).to(device), torch.randint(0, 10, (64,), generator=g).to(device)

    def step(m):
        outputs = m(x)
        nn.functional.cross_entropy(outputs, y).backward()
        return outputs

    return model, x, step


@pytest.mark.parametrize("mode", [None, "full"])
@pytest.mark.parametrize("case", ["tiny_llama", "digits_cnn"])
def test_estimate_is_within_a_quarter_of_the_measured_peak(case, mode, capsys):
    model, example, step = _llama_case() if case == "tiny_llama" else _cnn_case()
    estimate = estimate_activations(model, example, activation_checkpointing=mode)
    assert estimate.method == "fake tensors"
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    measured = measured_peak(_with_checkpointing(model, mode), step)
    predicted = estimate.peak + grads
    with capsys.disabled():
        print(
            f"\n{case} activation_checkpointing={mode}: estimate {estimate.peak} B activations "
            f"({estimate.saved} B saved) + {grads} B gradients = {predicted} B; measured peak {measured} B "
            f"({predicted / measured:.3f}x)"
        )
    assert abs(predicted - measured) <= TOLERANCE * measured


def test_checkpointing_lowers_the_llamas_activations():
    model, batch, _ = _llama_case()
    plain = estimate_activations(model, batch)
    full = estimate_activations(model, batch, activation_checkpointing="full")
    every_other = estimate_activations(model, batch, activation_checkpointing="selective:2")
    assert full.saved < every_other.saved < plain.saved and full.peak < plain.peak


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["tiny_llama", "digits_cnn"])
def test_estimate_against_cuda_max_memory_allocated(case):
    model, example, step = _llama_case("cuda") if case == "tiny_llama" else _cnn_case("cuda")
    estimate = estimate_activations(model, example)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    measured = measured_peak(model, step)
    print(f"{case} on CUDA: estimate {estimate.peak + grads} B, max_memory_allocated {measured} B")
    assert abs(estimate.peak + grads - measured) <= TOLERANCE * measured


class _Stateful(nn.Module):
    """Batch norm statistics and dropout draws: what an estimate must not disturb."""

    def __init__(self, data_dependent: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 4)])
        self.norm, self.drop, self.data_dependent = nn.BatchNorm1d(16), nn.Dropout(0.5), data_dependent

    def forward(self, x):
        h = self.drop(self.norm(self.layers[0](x)))
        if self.data_dependent and bool(h.sum() > 0):  # reads a value: fake tensors have none
            h = h * 2
        return self.layers[1](h)


@pytest.mark.parametrize("data_dependent", [False, True])
def test_estimating_changes_nothing(data_dependent):
    torch.manual_seed(0)
    model = _Stateful(data_dependent)
    x = torch.randn(32, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    estimate = estimate_activations(model, x)
    assert estimate.method == ("real tensors" if data_dependent else "fake tensors") and estimate.peak > 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # running stats too
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_mode_that_checkpoints_nothing_is_refused():
    with pytest.raises(ValueError, match="found no blocks in Linear"):
        estimate_activations(nn.Linear(2, 2), torch.randn(1, 2), activation_checkpointing="full")
    with pytest.raises(ValueError, match="must be 'full'"):
        checkpointed_modules(tiny_llama(), "sometimes")


def _budget_between(model, example) -> int:
    rows = plan_table(model, torch.optim.AdamW, world_size=1, budget=1e12, example_input=example)
    plain, ckpt = (next(r for r in rows if bool(r.options) is c) for c in (False, True))
    assert ckpt.activations < plain.activations
    return (plain.total + ckpt.total) // 2


def test_auto_checkpoints_when_activations_do_not_fit(monkeypatch):
    from kiln.cost.auto import Auto
    from kiln.launch.context import context
    from kiln.parallel.single import SingleDevice
    from kiln.precision import get_precision

    model, batch, _ = _llama_case()
    seen = {}

    def setup(self, model, optimizer, ctx, precision):  # the chosen strategy, as it would be set up
        seen["options"] = self.parallelize_options
        return model, optimizer

    monkeypatch.setattr(SingleDevice, "setup", setup)
    auto = Auto(memory_budget=_budget_between(model, batch), example_input=batch)
    auto.setup(model, torch.optim.AdamW(model.parameters()), context(), get_precision("fp32"))
    assert auto.reason.startswith("single+ckpt") and "activations are" in auto.reason
    assert seen["options"].activation_checkpointing == "full"
    roomy = Auto(memory_budget=1e12, example_input=batch)
    roomy.setup(model, torch.optim.AdamW(model.parameters()), context(), get_precision("fp32"))
    assert roomy.reason.startswith("single:") and seen["options"].activation_checkpointing is None


def test_kiln_plan_shows_why_it_checkpoints(capsys):
    from kiln.cli.main import main

    sys.path.insert(0, str(Path(__file__).parent / "workers"))
    from parallel_model import Net

    example = torch.randn(256, 8)
    budget = _budget_between(Net(), example)
    args = ["plan", "--model", "parallel_model:Net", "--budget", str(budget), "--input-shape", "256,8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    chosen = [line for line in out.splitlines() if line.startswith("* ")]
    assert len(chosen) == 1 and chosen[0].startswith("* single+ckpt") and "activations are" in chosen[0]
    assert "activations of one microbatch per rank" in out and "activation_checkpointing='full'" in out
    assert main([*args, "--activation-checkpointing", "full"]) == 0  # the run's own choice: measured with it
    out = capsys.readouterr().out
    assert "without checkpointing" not in out and sum(line.startswith("* ") for line in out.splitlines()) == 1
