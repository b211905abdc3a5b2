"""Bad input: malicious pickles are refused without running them, and mismatched checkpoints give
one clear error naming the file, never a traceback from deep inside torch."""

from __future__ import annotations

import pickle

import pytest
import torch

import kiln
from kiln.checkpoint import CheckpointError, layout, load_checkpoint, save_checkpoint, verify_checkpoint
from workers.ckpt_common import build_state, train
from workers.ckpt_tamper import Evil, rehash  # rehash: an attacker rewrites the manifest too


@pytest.mark.parametrize(
    "save_type, victim", [("sharded", "rank0.pt"), ("sharded", ".metadata"), ("merged", "checkpoint.pt")]
)
def test_malicious_pickle_is_refused_and_never_runs(tmp_path, save_type, victim):
    state = build_state()
    train(state, 2)
    path = save_checkpoint(tmp_path / "run", state, save_type)
    sentinel = tmp_path / "pwned"
    if victim == ".metadata":
        (path / victim).write_bytes(pickle.dumps(Evil(sentinel)))
    else:
        torch.save({"model": Evil(sentinel)}, path / victim)
    rehash(path)
    for attempt in (lambda: load_checkpoint(path, build_state(seed=1)), lambda: verify_checkpoint(path)):
        with pytest.raises(CheckpointError, match="run code") as err:
            attempt()
        assert err.value.path.endswith(victim) and "weights_only" in str(err.value)
    assert not sentinel.exists()


def test_wrong_shapes_name_the_file_and_the_tensor(tmp_path):
    state = build_state(width=16)
    train(state, 2)
    path = save_checkpoint(tmp_path, state)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, build_state(width=32))
    message = str(err.value)
    assert err.value.path.endswith(".metadata") and "does not fit this model" in message
    assert "0.weight is [16, 8] in the checkpoint but [32, 8] in the model" in message
    assert "kiln checkpoint inspect" in message


def test_missing_and_extra_tensors_suggest_strict_false(tmp_path):
    state = build_state()
    train(state, 2)
    path = save_checkpoint(tmp_path, state, "merged")
    other = build_state()
    other.engine.module.add_module("head", torch.nn.Linear(4, 2))
    with pytest.raises(CheckpointError, match="not in the checkpoint.*head.weight.*strict=False") as err:
        load_checkpoint(path, other)
    assert err.value.path.endswith("checkpoint.pt")
    load_checkpoint(path, other, strict=False)  # partial loading on request (fine-tuning a new head)
    assert torch.equal(other.model[0].weight, state.model[0].weight)


def test_unsafe_callback_state_fails_at_save_naming_the_callback(tmp_path):
    class Sloppy(kiln.Callback):
        def state_dict(self):
            return {"when": Evil(tmp_path / "x")}

    state = build_state(callbacks=[Sloppy()])
    with pytest.raises(CheckpointError, match="callback Sloppy.*weights_only"):
        save_checkpoint(tmp_path / "run", state)
    assert not any(p.name for p in (tmp_path / "run").iterdir() if not layout.is_temporary(p.name))


def test_not_a_checkpoint_and_a_garbled_file(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint folder"):
        load_checkpoint(tmp_path / "notes.txt", build_state())
    state = build_state()
    train(state, 1)
    path = save_checkpoint(tmp_path / "run", state, "merged")
    (path / "checkpoint.pt").write_bytes(b"\x00garbage" * 10)
    rehash(path)
    with pytest.raises(CheckpointError, match="truncated or damaged") as err:
        load_checkpoint(path, build_state(seed=1), verify=False)
    assert err.value.path.endswith("checkpoint.pt")
