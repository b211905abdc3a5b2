"""`kiln checkpoint merge SRC DST`: one file when DST ends in .pt/.pth, a checkpoint folder otherwise.

The file opens with ``torch.load(DST, weights_only=True)`` and loads like a checkpoint folder
(``load_checkpoint``, ``kiln.Trainer(load_path=DST)``, ``kiln checkpoint verify|inspect|export``);
it is written under a temporary name and renamed, and an existing DST is never overwritten.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import kiln
from distributed import base_env
from kiln.checkpoint import (
    CheckpointError,
    export_safetensors,
    inspect_checkpoint,
    layout,
    load_checkpoint,
    merge_checkpoint,
    offline,
    save_checkpoint,
    verify_checkpoint,
)
from kiln.cli.main import main
from workers.ckpt_common import assert_same, build_state, snapshot, train


@pytest.fixture
def saved(tmp_path):
    state = build_state()
    train(state, 3)
    return save_checkpoint(tmp_path / "run", state, "sharded"), snapshot(state)


@pytest.mark.parametrize("name", ["merged.pt", "merged.pth"])
def test_merge_to_one_file_that_loads_everywhere(saved, tmp_path, name):
    path, before = saved
    out = tmp_path / "out"
    dst = merge_checkpoint(path, out / name)
    assert dst == out / name and dst.is_file() and [p.name for p in out.iterdir()] == [name]  # no temporary left
    content = torch.load(dst, weights_only=True)
    assert sorted(content) == ["manifest", "model", "optimizer", "ranks"]
    assert torch.equal(content["model"]["0.weight"], before["model"]["0.weight"])
    assert content["manifest"]["save_type"] == "merged" and content["manifest"]["timestamp"]["batch"] == 3

    state = build_state(seed=1)
    manifest = load_checkpoint(dst, state)  # everything back, RNG included: an exact resume
    assert manifest["name"] == "ep0-ba3"
    assert_same(before, snapshot(state))
    assert verify_checkpoint(dst)["name"] == "ep0-ba3"
    info = inspect_checkpoint(dst)
    assert info["num_files"] == 1 and info["model"]["0.weight"] == ([16, 8], "float32")
    weights = export_safetensors(dst, tmp_path / "w.safetensors")
    assert weights.is_file()

    with pytest.raises(CheckpointError, match="already exists"):  # never overwritten
        merge_checkpoint(path, dst)
    again = merge_checkpoint(dst, tmp_path / "folder")  # a file merges into a folder too
    assert verify_checkpoint(again)["save_type"] == "merged"


def test_merge_to_a_folder_is_unchanged(saved, tmp_path):
    path, before = saved
    dst = merge_checkpoint(path, tmp_path / "merged")
    assert dst.is_dir() and sorted(p.name for p in dst.iterdir()) == ["checkpoint.pt", "manifest.json"]
    state = build_state(seed=1)
    load_checkpoint(dst, state)
    assert_same(before, snapshot(state))


def test_a_failed_merge_leaves_nothing(saved, tmp_path, monkeypatch):
    path, _ = saved

    def disk_full(file, obj):
        file.write_bytes(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(offline, "_save_durably", disk_full)
    for name in ("m.pt", "m"):
        with pytest.raises(CheckpointError, match="could not be written.*No space") as err:
            merge_checkpoint(path, tmp_path / "out" / name)
        assert err.value.path == str(tmp_path / "out" / name)
    assert list((tmp_path / "out").iterdir()) == []  # neither DST nor a temporary


def test_a_pt_file_that_is_not_a_kiln_checkpoint(tmp_path):
    torch.save({"model": {"w": torch.ones(2)}}, tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match="no 'manifest' entry.*kiln checkpoint merge") as err:
        load_checkpoint(tmp_path / "plain.pt", build_state())
    assert err.value.path.endswith("plain.pt")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint folder"):
        load_checkpoint(tmp_path / "notes.txt", build_state())


def test_cli_merge_to_a_file(saved, tmp_path, capsys):
    path, before = saved
    dst = tmp_path / "merged.pt"
    assert main(["checkpoint", "merge", str(path), str(dst)]) == 0
    assert str(dst) in capsys.readouterr().out
    assert torch.equal(torch.load(dst, weights_only=True)["model"]["3.weight"], before["model"]["3.weight"])
    assert main(["checkpoint", "verify", str(dst)]) == 0
    assert main(["checkpoint", "inspect", str(dst)]) == 0
    assert "epoch 0, batch 3" in capsys.readouterr().out
    assert main(["checkpoint", "merge", str(path), str(dst)]) == 2  # exists: a usage error, one line, exit 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "already exists" in err


def test_the_kiln_command_merges_to_a_file(saved, tmp_path):
    path, before = saved
    dst = tmp_path / "merged.pt"
    result = subprocess.run(
        [sys.executable, "-m", "kiln.cli.main", "checkpoint", "merge", str(path), str(dst)],
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert torch.equal(torch.load(dst, weights_only=True)["model"]["0.bias"], before["model"]["0.bias"])
    assert not any(layout.is_temporary(p.name) for p in tmp_path.iterdir())


def test_trainer_loads_a_merged_file(tmp_path):
    kiln.seed_everything(0)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=16)

    def trainer(**kwargs):
        model = nn.Linear(4, 2)
        return kiln.Trainer(
            model,
            train_dataloader=loader,
            max_duration="2ep",
            criterion=nn.CrossEntropyLoss(),
            optimizers=torch.optim.Adam(model.parameters(), lr=0.1),
            progress_bar=False,
            **kwargs,
        )

    first = trainer(save_folder=tmp_path / "run")
    first.fit()
    dst = tmp_path / "final.pt"
    assert main(["checkpoint", "merge", str(tmp_path / "run" / "last"), str(dst)]) == 0
    again = trainer(load_path=str(dst))
    assert again.state.timestamp.batch.value == 8 and again.state.timestamp.epoch.value == 2
    assert torch.equal(again.state.model.weight, first.state.model.weight)
    saved_opt, loaded_opt = first.state.optimizers[0].state_dict(), again.state.optimizers[0].state_dict()
    for index, values in saved_opt["state"].items():
        for key, value in values.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(loaded_opt["state"][index][key])), key
