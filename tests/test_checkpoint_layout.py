"""The checkpoint folder: atomic commit, manifest checksums, verification, links, retention, debris."""

from __future__ import annotations

import json
import os

import pytest

from kiln.checkpoint import CheckpointError, layout, load_checkpoint, save_checkpoint, verification, verify_checkpoint
from workers.ckpt_common import build_state, train


@pytest.fixture
def saved(tmp_path):
    state = build_state()
    train(state, 3)
    return save_checkpoint(tmp_path, state), state


def test_folder_manifest_and_link(saved, tmp_path):
    path, _ = saved
    assert path == tmp_path / "ep0-ba3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ep0-ba3", "last"]  # no temporary left behind
    assert os.readlink(tmp_path / "last") == "ep0-ba3"  # relative: the run folder can move
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == "kiln-checkpoint" and manifest["format_version"] == layout.FORMAT_VERSION
    assert (manifest["world_size"], manifest["save_type"], manifest["timestamp"]["batch"]) == (1, "sharded", 3)
    assert manifest["strategy"]["name"] == "single" and "created" in manifest and "metrics" in manifest
    on_disk = layout.list_files(path)
    assert sorted(manifest["files"]) == on_disk and "manifest.json" not in on_disk
    for name, record in manifest["files"].items():
        assert record == {"xxh3_128": verification.checksum_file(path / name)[0], "bytes": (path / name).stat().st_size}
    assert verify_checkpoint(tmp_path / "last")["name"] == "ep0-ba3"


@pytest.mark.parametrize(
    "damage, words",
    [
        ("flip", "is corrupt"),
        ("truncate", "truncated"),
        ("delete", "is missing"),
    ],
)
def test_verify_names_the_damaged_file(saved, damage, words):
    path, _ = saved
    victim = path / "__0_0.distcp"
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(bytes(data[: len(data) // 3]))
    else:
        victim.unlink()
    with pytest.raises(CheckpointError, match=words) as err:
        verify_checkpoint(path)
    assert err.value.path == str(victim)
    with pytest.raises(CheckpointError, match=words):  # and loading refuses it the same way
        load_checkpoint(path, build_state(seed=1))


def test_incomplete_and_foreign_folders(saved, tmp_path):
    path, _ = saved
    tmp = tmp_path / layout.temporary_name("ep0-ba9")
    tmp.mkdir()
    with pytest.raises(CheckpointError, match="did not finish"):
        verify_checkpoint(tmp)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        verify_checkpoint(path)
    with pytest.raises(CheckpointError, match="does not exist"):
        verify_checkpoint(tmp_path / "nope")


def test_newer_format_version_is_refused_with_the_fix(saved):
    path, _ = saved
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format_version"] = 99
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="format version 99.*upgrade kiln") as err:
        load_checkpoint(path, build_state(seed=1))
    assert err.value.path.endswith("manifest.json")


def test_retention_never_deletes_last_or_best(tmp_path):
    state = build_state()
    for _ in range(5):
        train(state, 1)
        save_checkpoint(tmp_path, state)
    layout.update_link(tmp_path, "best", "ep0-ba1")
    removed = layout.apply_retention(tmp_path, keep=1)
    assert sorted(removed) == ["ep0-ba2", "ep0-ba3", "ep0-ba4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "ep0-ba1", "ep0-ba5", "last"]
    layout.update_link(tmp_path, "last", "ep0-ba1")  # even when `last` points at an old one
    assert layout.apply_retention(tmp_path, keep=1) == []
    assert layout.apply_retention(tmp_path, keep=-1) == []


def test_retention_after_a_restart_keeps_the_new_runs_checkpoints(tmp_path):
    """A run started again from scratch (or from an earlier checkpoint) in an old run's folder saves
    checkpoints of less progress than the old run's; they are the newer ones, and retention keeps them."""

    def save(state):
        train(state, 1)
        save_checkpoint(tmp_path, state)
        layout.apply_retention(tmp_path, keep=2)
        return sorted(p.name for p, _ in layout.list_checkpoints(tmp_path))

    old = build_state()
    assert [save(old) for _ in range(4)][-1] == ["ep0-ba3", "ep0-ba4"]
    new = build_state(seed=1)
    assert save(new) == ["ep0-ba1", "ep0-ba4"]  # ep0-ba3 was the oldest save; ep0-ba1 (`last`) the newest
    assert save(new) == ["ep0-ba1", "ep0-ba2"]  # the old run's checkpoints are gone, not the new run's
    os.unlink(tmp_path / "last")
    with pytest.warns(UserWarning, match="most recently saved complete checkpoint"):
        assert layout.resolve_checkpoint(tmp_path, "last") == (tmp_path / "ep0-ba2").resolve()


def test_debris_is_ignored_cleaned_and_last_falls_back(saved, tmp_path):
    path, state = saved
    train(state, 1)
    newer = save_checkpoint(tmp_path, state, update_last=False)  # a crash before the link moved
    half = tmp_path / layout.temporary_name("ep0-ba5")
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"partial")
    assert [p.name for p, _ in layout.list_checkpoints(tmp_path)] == ["ep0-ba3", "ep0-ba4"]
    os.unlink(tmp_path / "last")
    os.symlink("ep0-ba77", tmp_path / "last")  # dangling
    with pytest.warns(UserWarning, match="most recently saved complete checkpoint"):
        assert layout.resolve_checkpoint(tmp_path, "last") == newer.resolve()
    assert layout.cleanup_temporary(tmp_path) == [half.name]
    assert layout.resolve_checkpoint(tmp_path / "none", "last", must_exist=False) is None


def test_links_fall_back_to_copies(saved, tmp_path, monkeypatch):
    path, state = saved

    def no_links(*args, **kwargs):
        raise OSError("links not supported here")

    monkeypatch.setattr(os, "symlink", no_links)
    layout.update_link(tmp_path, "best", "ep0-ba3")
    assert (tmp_path / "best").is_dir() and not (tmp_path / "best").is_symlink()
    assert layout.link_target(tmp_path, "best") == "ep0-ba3"
    verify_checkpoint(tmp_path / "best")
    train(state, 1)
    save_checkpoint(tmp_path, state)  # replaces the copy `last` was
    assert layout.link_target(tmp_path, "last") == "ep0-ba4"
    assert layout.apply_retention(tmp_path, keep=1) == []  # ep0-ba3 is what the `best` copy stands for


def test_saving_the_same_step_again_replaces_it_whole(saved, tmp_path):
    path, state = saved
    before = json.loads((path / "manifest.json").read_text())["created_unix"]
    again = save_checkpoint(tmp_path, state)
    assert again == path and json.loads((path / "manifest.json").read_text())["created_unix"] >= before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ep0-ba3", "last"]
    verify_checkpoint(path)


def test_whole_tensors_are_read_in_place_and_the_rest_the_way_dcp_does():
    """A whole, contiguous tensor of the target's dtype is read from the file straight into the
    target; anything else is left for DCP's load-and-copy (nothing written into the target)."""
    import io
    from types import SimpleNamespace

    import torch

    from kiln.checkpoint.serialization import _read_in_place

    def archive(tensor):
        buffer = io.BytesIO()
        torch.save(tensor, buffer)
        buffer.seek(0)
        return buffer

    whole = SimpleNamespace(storage_offsets=[0, 0], lengths=[3, 4])
    saved = torch.arange(12, dtype=torch.float32).view(3, 4)
    target = torch.zeros(3, 4)
    assert _read_in_place(archive(saved), whole, target) and torch.equal(target, saved)
    base = torch.arange(20.0)  # a view is saved with its whole storage: the data starts 5 floats in
    target = torch.zeros(3, 4)
    assert _read_in_place(archive(base[5:17].view(3, 4)), whole, target)
    assert torch.equal(target, base[5:17].view(3, 4))
    part = SimpleNamespace(storage_offsets=[1, 0], lengths=[2, 4])
    for req, other in [
        (whole, torch.zeros(3, 4, dtype=torch.float64)),  # another dtype: DCP's copy_ converts
        (part, torch.zeros(2, 4)),  # a part of the saved tensor (another world size)
        (whole, torch.zeros(4, 3).t()),  # a non-contiguous target
    ]:
        assert not _read_in_place(archive(saved), req, other) and not other.any()
    # saved non-contiguous (a transposed view of its whole storage): its bytes are not in the
    # target's order, so DCP's copy_ lays them out
    other = torch.zeros(3, 4)
    assert not _read_in_place(archive(saved.view(4, 3).t()), whole, other) and not other.any()
    # another dtype, read in place when the target has it
    target = torch.zeros(3, 4, dtype=torch.bfloat16)
    assert _read_in_place(archive(saved.bfloat16()), whole, target) and torch.equal(target, saved.bfloat16())
    data = archive(saved).getvalue()
    with pytest.raises(RuntimeError, match="failed finding central directory"):  # reported by the reader
        _read_in_place(io.BytesIO(data[: len(data) - 300]), whole, torch.zeros(3, 4))


_CALLS: list = []


def _record_call(*args):
    _CALLS.append(args)


def test_the_tensor_record_reader_calls_nothing_and_declines_what_is_not_one_tensor():
    """_tensor_record reads an archive's pickle without building anything: a pickle that is not one
    tensor (or names any other global) gives None, so the caller falls back to the weights-only
    torch.load, which refuses what it must; a storage shorter than its tensor gives None too."""
    import io

    import torch

    from kiln.checkpoint.serialization import _tensor_record

    def archive(value):
        buffer = io.BytesIO()
        torch.save(value, buffer)
        buffer.seek(0)
        return buffer

    dtype, size, stride, storage_offset, data_offset, data_bytes = _tensor_record(archive(torch.zeros(2, 5)))
    assert (dtype, size, stride, storage_offset, data_bytes) == (torch.float32, (2, 5), (5, 1), 0, 40)
    assert data_offset % 64 == 0  # torch.save aligns a storage's data
    assert _tensor_record(archive({"a": torch.zeros(2)})) is None  # a dict, not one tensor
    assert _tensor_record(archive([torch.zeros(2)])) is None

    class Boom:
        def __reduce__(self):
            return (_record_call, ("ran",))

    assert _tensor_record(archive(Boom())) is None
    assert not _CALLS  # the global was refused, never called

    # a pickle that claims more elements than its storage record holds
    data = archive(torch.zeros(4)).getvalue()
    # the pickle says numel 4 (BININT1 4) after 'cpu'; make it 40 (BININT1 '(')
    edited = data.replace(b"X\x03\x00\x00\x00cpuq\x04K\x04", b"X\x03\x00\x00\x00cpuq\x04K(", 1)
    assert edited != data
    assert _tensor_record(io.BytesIO(edited)) is None


def test_a_float32_checkpoint_loads_into_a_float64_model(saved):
    """The fallback: DCP's own load and copy_, converting the dtype."""
    import torch

    path, state = saved
    fresh = build_state(seed=1)
    fresh.model.double()
    load_checkpoint(path, fresh, restore_rng=False)
    for (name, a), b in zip(state.model.named_parameters(), fresh.model.parameters()):
        assert b.dtype == torch.float64 and torch.equal(a.double(), b), name


def test_each_file_is_read_in_a_thread_of_its_own_and_a_failure_there_names_its_entry(saved, monkeypatch):
    """With several .distcp files on local disk, each file's whole tensors are read in a thread of
    their own; what cannot be read in place comes back to the caller's thread. Damage found in a
    thread is reported as in one: the file and the entry."""
    import threading

    import torch

    from kiln.checkpoint import CheckpointError
    from kiln.checkpoint.serialization import _SafeReading, read_dcp_metadata
    from workers.ckpt_tamper import rehash

    path, state = saved
    metadata = read_dcp_metadata(path)
    files = sorted({info.relative_path for info in metadata.storage_data.values()})
    assert len(files) >= 2
    seen: list[tuple[str, str]] = []
    original = _SafeReading._read_whole_tensors

    def spy(self, planner, relative_path, reqs):
        seen.append((relative_path, threading.current_thread().name))
        return original(self, planner, relative_path, reqs)

    monkeypatch.setattr(_SafeReading, "_read_whole_tensors", spy)
    fresh = build_state(seed=1)
    load_checkpoint(path, fresh)
    assert sorted(name for name, _ in seen) == files
    assert all(thread.startswith("kiln-read") for _, thread in seen)
    for a, b in zip(state.model.parameters(), fresh.model.parameters()):
        assert torch.equal(a, b)
    # the zip directory of the last tensor entry of the second file, damaged (checksums rewritten,
    # as an attacker would): one CheckpointError naming that file and that entry
    tensors = [
        (info.offset, index.fqn, info)
        for index, info in metadata.storage_data.items()
        if info.relative_path == files[1] and hasattr(metadata.state_dict_metadata[index.fqn], "size")
    ]
    _, key, info = max(tensors, key=lambda t: t[0])
    file = path / files[1]
    data = bytearray(file.read_bytes())
    end = info.offset + info.length
    directory = data.rfind(b"PK\x01\x02", info.offset, end)
    data[directory : directory + 4] = b"XXXX"
    file.write_bytes(bytes(data))
    rehash(path)
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path, build_state(seed=1))
    message = str(caught.value)
    assert files[1] in message and f"entry {key} " in message and "is damaged" in message, message
