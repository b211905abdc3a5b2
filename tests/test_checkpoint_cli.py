"""`kiln checkpoint merge | inspect | verify | export`: exit 0 with a readable answer; otherwise one
line on stderr and one rule for every subcommand: 2 for usage and missing inputs (a path that is not
there, a destination that is), 1 for failures (a damaged checkpoint). Exported files get the mode
the umask gives (0o644 under 022), the weights as well as config.json."""

from __future__ import annotations

import json
import os
import stat
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
    assert main(["checkpoint", "merge", str(folder / "last"), str(out / "merged")]) == 2  # never overwrites
    assert "already exists" in capsys.readouterr().err
    for source in (folder / "last", out / "merged"):
        assert (
            main(["checkpoint", "export", str(source), "--safetensors", str(out / "w.safetensors"), "--dtype", "bf16"])
            == 0
        )
        weights = load_file(out / "w.safetensors")
        assert set(weights) == set(state.model.state_dict()) and weights["0.weight"].dtype == torch.bfloat16
        assert torch.equal(weights["0.weight"], state.model[0].weight.detach().to(torch.bfloat16))


def test_the_kiln_command_exits_2_on_a_missing_checkpoint(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "kiln.cli.main", "checkpoint", "verify", str(tmp_path / "none")],
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "does not exist" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def _commands(source, out):
    return {
        "inspect": ["inspect", str(source)],
        "verify": ["verify", str(source)],
        "merge": ["merge", str(source), str(out / "merged.pt")],
        "export --safetensors": ["export", str(source), "--safetensors", str(out / "w.safetensors")],
        "export --hf": ["export", str(source), "--hf", str(out / "hf"), "--config", str(out)],
    }


@pytest.mark.parametrize("command", list(_commands("", __import__("pathlib").Path())))
def test_every_subcommand_exits_2_on_a_missing_path_and_1_on_a_damaged_checkpoint(
    command, run_folder, tmp_path_factory, capsys
):
    folder, _ = run_folder
    out = tmp_path_factory.mktemp("out")
    (out / "config.json").write_text('{"model_type": "llama"}')
    assert main(["checkpoint", *_commands(folder / "no-such-checkpoint", out)[command]]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no-such-checkpoint does not exist" in err and "check the path" in err
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]  # bad usage writes nothing
    damaged = folder / "ep0-ba3" / "__0_0.distcp"
    damaged.write_bytes(damaged.read_bytes()[:-64])  # the tensors' file, cut short
    assert main(["checkpoint", *_commands(folder / "last", out)[command]]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "__0_0.distcp" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]  # a failure leaves nothing either


def test_outputs_in_the_way_and_misused_options_exit_2(run_folder, tmp_path_factory, capsys):
    folder, _ = run_folder
    tmp_path = tmp_path_factory.mktemp("out")
    (tmp_path / "taken.pt").write_bytes(b"")
    (tmp_path / "hf").mkdir()
    cases = [
        (["merge", str(folder / "last"), str(tmp_path / "taken.pt")], "DST"),
        (["export", str(folder / "last"), "--hf", str(tmp_path / "hf")], "--hf OUT"),
        (
            ["export", str(folder / "last"), "--hf", str(tmp_path / "new"), "--config", str(tmp_path / "none")],
            "--config",
        ),
        (["export", str(folder / "last"), "--safetensors", str(tmp_path / "w"), "--config", "c.json"], "--config"),
    ]
    for argv, named in cases:
        assert main(["checkpoint", *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"kiln checkpoint {argv[0]}: error: {named}"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "taken.pt"]


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_exported_files_get_the_mode_the_umask_gives(umask, run_folder, tmp_path_factory):
    folder, _ = run_folder
    tmp_path = tmp_path_factory.mktemp("out")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text('{"model_type": "llama"}')
    previous = os.umask(umask)
    try:
        assert (
            main(["checkpoint", "export", str(folder / "last"), "--safetensors", str(tmp_path / "w.safetensors")]) == 0
        )
        args = ["export", str(folder / "last"), "--hf", str(tmp_path / "hf"), "--config", str(tmp_path / "cfg")]
        assert main(["checkpoint", *args]) == 0
        assert main(["checkpoint", "merge", str(folder / "last"), str(tmp_path / "merged.pt")]) == 0
    finally:
        os.umask(previous)
    expected = 0o666 & ~umask
    files = [tmp_path / "w.safetensors", tmp_path / "hf" / "model.safetensors", tmp_path / "hf" / "config.json"]
    modes = {f.name if f.parent == tmp_path else f"hf/{f.name}": stat.S_IMODE(f.stat().st_mode) for f in files}
    modes["merged.pt"] = stat.S_IMODE((tmp_path / "merged.pt").stat().st_mode)
    assert modes == dict.fromkeys(modes, expected), {k: oct(v) for k, v in modes.items()}
