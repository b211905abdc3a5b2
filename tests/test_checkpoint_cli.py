"""`kiln checkpoint merge | inspect | verify | export`: exit 0 with a readable answer, or exit 1 with
one line naming the file and the problem."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from distributed import base_env
from kiln.checkpoint import save_checkpoint
from kiln.cli.main import main
from workers.ckpt_common import build_state, train


@pytest.fixture
def run_folder(tmp_path):
    state = build_state()
    train(state, 3)
    state.metrics["eval/loss"] = 0.25
    save_checkpoint(tmp_path, state)
    return tmp_path, state


def test_verify_ok_and_corrupt(run_folder, capsys):
    folder, _ = run_folder
    assert main(["checkpoint", "verify", str(folder / "last")]) == 0
    assert "OK" in capsys.readouterr().out
    victim = folder / "ep0-ba3" / "rank0.pt"
    victim.write_bytes(victim.read_bytes()[:-10])
    assert main(["checkpoint", "verify", str(folder / "last")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rank0.pt" in err and "truncated" in err


def test_inspect_text_and_json(run_folder, capsys):
    folder, state = run_folder
    assert main(["checkpoint", "inspect", str(folder / "last")]) == 0
    text = capsys.readouterr().out
    assert "epoch 0, batch 3" in text and "eval/loss=0.25" in text and "0.weight" in text and "[16, 8]" in text
    assert main(["checkpoint", "inspect", "--json", str(folder / "ep0-ba3")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["num_parameters"] == sum(p.numel() for p in state.model.parameters())
    assert info["save_type"] == "sharded" and info["model"]["3.weight"] == [[4, 16], "float32"]


def test_merge_then_export_safetensors(run_folder, capsys, tmp_path_factory):
    from safetensors.torch import load_file

    folder, state = run_folder
    out = tmp_path_factory.mktemp("out")
    assert main(["checkpoint", "merge", str(folder / "last"), str(out / "merged")]) == 0
    merged = torch.load(out / "merged" / "checkpoint.pt", weights_only=True)
    assert torch.equal(merged["model"]["0.weight"], state.model[0].weight)
    assert main(["checkpoint", "merge", str(folder / "last"), str(out / "merged")]) == 1  # never overwrites
    assert "already exists" in capsys.readouterr().err
    for source in (folder / "last", out / "merged"):
        assert (
            main(["checkpoint", "export", str(source), "--safetensors", str(out / "w.safetensors"), "--dtype", "bf16"])
            == 0
        )
        weights = load_file(out / "w.safetensors")
        assert set(weights) == set(state.model.state_dict()) and weights["0.weight"].dtype == torch.bfloat16
        assert torch.equal(weights["0.weight"], state.model[0].weight.detach().to(torch.bfloat16))


def test_the_kiln_command_exits_1_on_a_missing_checkpoint(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "kiln.cli.main", "checkpoint", "verify", str(tmp_path / "none")],
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and "does not exist" in result.stderr and "Traceback" not in result.stderr
