"""Checkpoints written by 2 ranks (DDP, ZeRO-1, and zero3 = FSDP2; one launch saves under each in turn)
load into 1 rank and training goes on: sharded and deduped through DCP's resharding, merged as one
plain file with no process group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kiln
from distributed import WORKERS, check, fork_run
from kiln.checkpoint import load_checkpoint, merge_checkpoint, verify_checkpoint
from kiln.parallel.state.dcp_state import get_state_dict


def _one_rank_state():
    torch.manual_seed(123)  # different from the saved weights, so loading must change them
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = kiln.Engine(model, optimizer, nn.CrossEntropyLoss())
    state = kiln.State(model, optimizers=[optimizer])
    state.engine = engine
    return state


def _assert_loaded(expected, state):
    got = get_state_dict(state.engine.model, state.engine.optimizer, full=True)
    for section in ("model", "optimizer"):
        assert expected[section].keys() == got[section].keys()
        for key, value in expected[section].items():
            same = (
                torch.equal(value, got[section][key]) if isinstance(value, torch.Tensor) else value == got[section][key]
            )
            assert same, f"{section}.{key}"


STRATEGIES = ["ddp", "zero1", "zero3"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One 2-rank launch saving under each strategy in turn: the folder holding a folder per strategy."""
    out = tmp_path_factory.mktemp("saved")
    check(fork_run(WORKERS / "ckpt_save_ranks.py", str(out), ",".join(STRATEGIES)))
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_save_one_rank_loads_and_trains(saved, tmp_path, strategy):
    expected = torch.load(saved / strategy / "expected.pt", weights_only=True)
    for save_type in ("sharded", "deduped", "merged"):
        path = saved / strategy / save_type / "ep0-ba3"
        manifest = verify_checkpoint(path)
        assert (manifest["world_size"], manifest["strategy"]["name"]) == (2, strategy)
        state = _one_rank_state()
        with pytest.warns(UserWarning, match="RNG states are not restored"):
            load_checkpoint(path, state)
        _assert_loaded(expected, state)
        assert state.timestamp.batch.value == 3
        engine = state.engine  # and training continues from there
        engine.zero_grad()
        engine.backward(engine.criterion(engine(torch.randn(4, 8)), torch.tensor([0, 1, 2, 3])))
        engine.step()

    # merged: one file, plain torch.load with weights_only=True, no process group, no kiln
    merged = torch.load(saved / strategy / "merged/ep0-ba3/checkpoint.pt", weights_only=True)
    for key, value in expected["model"].items():
        assert torch.equal(merged["model"][key], value)
    assert len(merged["ranks"]) == 2 and merged["ranks"][1]["rank"] == 1

    # and `kiln checkpoint merge` turns the sharded one into the same thing
    out = merge_checkpoint(saved / strategy / "sharded/ep0-ba3", tmp_path / "exported")
    assert verify_checkpoint(out)["save_type"] == "merged"
    state = _one_rank_state()
    load_checkpoint(out, state, restore_rng=False)
    _assert_loaded(expected, state)
