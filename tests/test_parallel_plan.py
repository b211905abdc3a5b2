"""`auto`'s memory estimate and choice, and `kiln plan` (in this process: nothing is launched)."""

from __future__ import annotations

import sys

import pytest
import torch

from distributed import WORKERS  # noqa: E402
from kiln.cli.main import main
from kiln.cost.memory import activation_bytes, optimizer_state_factor, plan_table

sys.path.insert(0, str(WORKERS))  # the shared test model lives beside the workers
from parallel_model import Net, make_model  # noqa: E402


def _rows(**kw):
    rows = plan_table(make_model(), torch.optim.AdamW, **kw)
    return {r.strategy: r for r in rows}, next(r for r in rows if r.chosen)


def test_small_model_gets_ddp():
    rows, chosen = _rows(world_size=2, budget=1e12)
    assert chosen.strategy == "ddp" and "least communication" in chosen.note
    assert list(rows) == ["ddp", "zero1", "zero2", "zero3", "tp"]


def test_tiny_budget_gets_a_sharded_strategy():
    rows, _ = _rows(world_size=2, budget=1e12)
    budget = rows["zero2"].total  # ddp and zero1 need more
    rows, chosen = _rows(world_size=2, budget=budget)
    assert chosen.strategy == "zero2" and not rows["ddp"].fits and not rows["zero1"].fits
    rows, chosen = _rows(world_size=2, budget=rows["zero3"].total)
    assert chosen.strategy == "zero3"
    _, chosen = _rows(world_size=2, budget=10)
    assert chosen.strategy == "zero3" and not chosen.fits and "nothing fits" in chosen.note


def test_budget_from_the_environment(monkeypatch):
    rows, _ = _rows(world_size=2, budget=1e12)
    monkeypatch.setenv("KILN_MEMORY_BUDGET_BYTES", str(rows["zero3"].total))
    _, chosen = _rows(world_size=2)
    assert chosen.strategy == "zero3"


def test_estimates_count_adam_state_twice_and_shard_it():
    rows, _ = _rows(world_size=2, budget=1e12)
    params = sum(p.numel() * p.element_size() for p in make_model().parameters())
    assert rows["ddp"].params == params and rows["ddp"].optimizer == 2 * params
    assert rows["zero1"].optimizer == params and rows["zero3"].optimizer == params
    assert rows["zero3"].total < rows["zero2"].total < rows["zero1"].total < rows["ddp"].total
    assert optimizer_state_factor(torch.optim.SGD) == 0
    assert optimizer_state_factor(torch.optim.SGD(make_model().parameters(), lr=0.1, momentum=0.9)) == 1


def test_activations_from_one_traced_microbatch():
    model = make_model()
    small = activation_bytes(model, torch.randn(4, 8, dtype=torch.float64))
    large = activation_bytes(model, torch.randn(8, 8, dtype=torch.float64))
    assert small > 0 and large == pytest.approx(2 * small, rel=0.1)
    example = torch.randn(4, 8, dtype=torch.float64)
    rows = plan_table(model, torch.optim.AdamW, world_size=2, budget=1e12, example_input=example)
    # each strategy without checkpointing carries the microbatch's activations; its +ckpt twin fewer
    plain = [r for r in rows if not r.options]
    assert [r.strategy for r in plain] == ["ddp", "zero1", "zero2", "zero3", "tp"]
    assert all(r.activations == small for r in plain)
    checkpointed = [r for r in rows if r.options]
    assert [r.label for r in checkpointed] == ["ddp+ckpt", "zero1+ckpt", "zero2+ckpt", "zero3+ckpt"]
    assert all(0 < r.activations < small for r in checkpointed)


def test_one_rank_plans_single():
    rows = plan_table(Net(), torch.optim.AdamW, world_size=1, budget=1e12)
    assert [r.strategy for r in rows] == ["single"] and rows[0].chosen


def test_kiln_plan_lists_every_candidate(capsys):
    assert (
        main(
            ["plan", "--model", "parallel_model:Net", "--world-size", "2", "--budget", "60000", "--input-shape", "4,8"]
        )
        == 0
    )
    out = capsys.readouterr().out
    for name in ("ddp", "zero1", "zero2", "zero3", "tp"):
        assert f" {name} " in out, name
    chosen = [line for line in out.splitlines() if line.startswith("* ")]
    assert len(chosen) == 1 and "CHOSEN" in chosen[0]


def test_kiln_plan_bad_model_path(capsys):
    assert main(["plan", "--model", "parallel_model:Nett"]) == 2
    assert "'parallel_model' has no attribute 'Nett'" in capsys.readouterr().err


def test_kiln_plan_reads_a_run_file(capsys, monkeypatch):
    # in this process, as the tests above: main's status is the command's (a process adds nothing
    # that kiln plan does; two fresh interpreters cost ~13 CPU-s)
    from distributed import ROOT

    monkeypatch.chdir(ROOT)  # the run file names examples.mlp_model: main puts the working directory on sys.path
    monkeypatch.setattr(sys, "path", list(sys.path))
    cmd = ["plan", "-f", "examples/mlp.yaml", "--optimizer.args.lr", "0.1"]
    assert main(cmd) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "MLP on 2 rank(s), optimizer Adam" in out  # runtime_ngpus: 2 in the file
    assert sum(line.startswith("* ") for line in out.splitlines()) == 1
    # one microbatch of the run file's dataset measured: activations are no longer 0 B
    assert "activations of one microbatch per rank, one forward and backward on fake tensors" in out
    assert main([*cmd[:-2], "--optimzer.args.lr", "0.1"]) == 2
    assert "did you mean 'optimizer'" in capsys.readouterr().err
