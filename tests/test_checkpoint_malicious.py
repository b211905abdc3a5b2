"""Code in a checkpoint is refused, never run: in a ``.distcp`` byte entry, in deduped saves, and
through ``kiln checkpoint inspect|merge|export``.

Each attack rewrites the manifest's checksums (as an attacker can), so only the loader's refusal to
unpickle code stands between the file and the user. Every refusal is one CheckpointError naming
the file; the command line exits 1 with one line. The sentinel file the payload would create
must not exist afterwards. (tests/test_checkpoint_errors.py covers ``rank0.pt``, ``.metadata`` and
a merged ``checkpoint.pt`` through the Python API.)
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from distributed import base_env
from kiln.checkpoint import (
    CheckpointError,
    export_safetensors,
    inspect_checkpoint,
    load_checkpoint,
    merge_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from kiln.cli.main import main
from workers.ckpt_common import build_state, train
from workers.ckpt_tamper import Evil, dcp_bytes_keys, evil_pickles, rehash, replace_dcp_bytes_entry

KEY = "optimizer.param_groups.0.weight.lr"  # an optimizer hyperparameter: DCP stores it as pickled bytes


def _checkpoint(folder, save_type):
    state = build_state()
    train(state, 2)
    return save_checkpoint(folder, state, save_type)


def _attempts(path, out):
    return {
        "load_checkpoint": lambda: load_checkpoint(path, build_state(seed=1)),
        "verify_checkpoint": lambda: verify_checkpoint(path),
        "inspect_checkpoint": lambda: inspect_checkpoint(path),
        "merge_checkpoint": lambda: merge_checkpoint(path, out / "merged.pt"),
        "export_safetensors": lambda: export_safetensors(path, out / "w.safetensors"),
    }


@pytest.mark.parametrize("form", ["pickle", "torch.save"])
@pytest.mark.parametrize("save_type", ["sharded", "deduped"])
def test_code_in_a_distcp_byte_entry_is_refused(tmp_path, save_type, form):
    path = _checkpoint(tmp_path / "run", save_type)
    assert KEY in dcp_bytes_keys(path)
    sentinel = tmp_path / "pwned"
    victim = replace_dcp_bytes_entry(path, KEY, evil_pickles(sentinel)[form])
    rehash(path)
    for name, attempt in _attempts(path, tmp_path).items():
        with pytest.raises(CheckpointError, match="run code") as err:
            attempt()
        assert err.value.path == str(path / victim) and KEY in str(err.value), name
        assert "weights_only" in str(err.value), name
        assert not sentinel.exists(), f"{name} ran the payload"
    assert not (tmp_path / "merged.pt").exists() and not (tmp_path / "w.safetensors").exists()

    # The control: torch's own DCP reader unpickles byte entries with weights_only=False, and runs it.
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    control = tmp_path / "control"
    replace_dcp_bytes_entry(path, KEY, evil_pickles(control)[form])
    try:
        _load_state_dict(
            {}, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(keys={KEY}), no_dist=True
        )
    except BaseException:  # the payload has run by then; what torch makes of its result does not matter
        pass
    assert control.exists(), "the crafted entry is not what DCP reads; this test would prove nothing"


def _malicious(tmp_path, save_type, victim):
    """A checkpoint whose ``victim`` file carries code, with the manifest rewritten to match."""
    path = _checkpoint(tmp_path / save_type, save_type)
    sentinel = tmp_path / "pwned"
    if victim == "distcp":
        victim = replace_dcp_bytes_entry(path, KEY, evil_pickles(sentinel)["torch.save"])
    elif victim == ".metadata":
        (path / victim).write_bytes(evil_pickles(sentinel)["pickle"])
    else:
        torch.save({"model": Evil(sentinel), "ranks": [Evil(sentinel)]}, path / victim)
    rehash(path)
    return path, victim, sentinel


CASES = [
    ("deduped", "distcp"),
    ("deduped", ".metadata"),
    ("deduped", "rank0.pt"),
    ("sharded", "distcp"),
    ("merged", "checkpoint.pt"),
]


@pytest.mark.parametrize("save_type, victim", CASES, ids=[f"{s}-{v}" for s, v in CASES])
def test_cli_refuses_code_with_one_line(tmp_path, capsys, save_type, victim):
    in_distcp = victim == "distcp"  # the line then names the entry too
    path, victim, sentinel = _malicious(tmp_path, save_type, victim)
    for command in (
        ["inspect", str(path)],
        ["merge", str(path), str(tmp_path / "m.pt")],
        ["merge", str(path), str(tmp_path / "m")],
        ["export", str(path), "--safetensors", str(tmp_path / "w")],
    ):
        assert main(["checkpoint", *command]) == 1, command
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and victim in err and "run code" in err, (command, err)
        assert KEY in err or not in_distcp, (command, err)
        assert not sentinel.exists(), f"kiln checkpoint {command[0]} ran the payload"
    assert [p.name for p in tmp_path.iterdir()] == [save_type]  # nothing written, no temporary left


def test_the_kiln_command_refuses_code_in_a_distcp_entry(tmp_path):
    """`python -m kiln.cli.main checkpoint inspect` as a user runs it: exit 1, one line, no traceback.
    One command in a real process (the entry point's exit status and error printing are shared);
    merge and export refuse the same entry in test_cli_refuses_code_with_one_line, in this process."""
    path, victim, sentinel = _malicious(tmp_path, "deduped", "distcp")
    command, args = "inspect", [str(path)]
    result = subprocess.run(
        [sys.executable, "-m", "kiln.cli.main", "checkpoint", command, *args],
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    err = result.stderr.strip().splitlines()
    assert result.returncode == 1, result.stderr[-3000:]
    assert len(err) == 1 and victim in err[0] and KEY in err[0] and "run code" in err[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr and not sentinel.exists()


def test_a_memo_index_beyond_the_pickle_is_refused_before_the_unpickler_grows_its_table(tmp_path):
    """One byte of ``.metadata`` turned from MEMOIZE into LONG_BINPUT makes the next four bytes a memo
    index; the C unpickler grows its table to it at once, zeroed (a fuzz run of
    test_checkpoint_fuzz.py took 21 GB and was killed). kiln walks the opcodes first: the load is one
    CheckpointError naming .metadata, and memory stays where it was."""
    import pickletools
    import resource

    path = _checkpoint(tmp_path / "run", "sharded")
    data = (path / ".metadata").read_bytes()
    memoize = [pos for op, _, pos in pickletools.genops(data) if op.name == "MEMOIZE"]
    # the middle MEMOIZE becomes LONG_BINPUT of index 2**27 (the next four bytes overwritten): 2 GiB
    # of memo table without the check, small enough that the test survives it being removed
    at = memoize[len(memoize) // 2]
    (path / ".metadata").write_bytes(data[:at] + b"r" + (1 << 27).to_bytes(4, "little") + data[at + 5 :])
    rehash(path)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for name in ("load_checkpoint", "verify_checkpoint", "inspect_checkpoint"):
        with pytest.raises(CheckpointError, match=r"\.metadata: is damaged and cannot be read"):
            _attempts(path, tmp_path)[name]()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB


def test_the_memo_check_passes_every_sound_pickle_and_stops_a_put_or_long_binput_past_the_end():
    import pickle

    from kiln.checkpoint.serialization import check_memo_indices

    values = [{"a": [1, 2, 3] * 50, "b": "x\ny" * 300, "c": b"\n" * 70000, "d": 2**100, "e": 1.5, "f": (None, True)}]
    values.append([[i, str(i)] for i in range(300)])
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        for value in values:
            check_memo_indices(pickle.dumps(value, protocol=protocol))  # no error
    for bad in (b"\x80\x02]r\xff\xff\xff\x7f.", b"(lp99999999\n."):
        with pytest.raises(ValueError, match="memo index beyond"):
            check_memo_indices(bad)


def test_plain_byte_entries_are_read_without_torch_load_and_everything_else_is_left_to_it(tmp_path):
    """DCP stores an optimizer's hyperparameters as one small torch.save archive per parameter and
    name; kiln reads those with an unpickler that knows no global and no storage. It gives exactly
    what torch.load(weights_only=True) gives, and declines (for torch.load to judge) anything else."""
    import io

    from kiln.checkpoint.serialization import _NOT_PLAIN, _plain_value

    def archive(value):
        buffer = io.BytesIO()
        torch.save(value, buffer)
        buffer.seek(0)
        return buffer

    for value in [0.001, (0.9, 0.999), True, None, 7, "name", [1, {"a": (2.5,)}], 2**80, -3.5e300]:
        got = _plain_value(archive(value))
        assert got == value and type(got) is type(value) and got == torch.load(archive(value), weights_only=True)
    # torch.save pickles with protocol 2, where bytes and sets name a global (_codecs.encode,
    # builtins.set): declined here, and torch.load reads them
    assert _plain_value(archive(b"\x00\n")) is _NOT_PLAIN and _plain_value(archive({1, 2})) is _NOT_PLAIN
    sentinel = tmp_path / "pwned"
    for other in [
        archive(torch.zeros(2)),  # a storage
        archive({"lr": torch.tensor(0.1)}),
        archive(torch.Size([2, 3])),  # a global, although a harmless one
        io.BytesIO(evil_pickles(sentinel)["torch.save"]),
        io.BytesIO(evil_pickles(sentinel)["pickle"]),  # not an archive
        io.BytesIO(b"garbage"),
    ]:
        assert _plain_value(other) is _NOT_PLAIN
    assert not sentinel.exists()


def test_a_damaged_metadata_opcode_is_reported_as_damage_and_a_named_global_as_code(tmp_path):
    """An opcode the unpickler does not know is damage, not code: the message says so; a global
    that is not one of DCP's record classes is code (test_checkpoint_errors.py has the payload)."""
    import pickletools

    path = _checkpoint(tmp_path / "run", "sharded")
    data = (path / ".metadata").read_bytes()
    at = next(pos for op, _, pos in pickletools.genops(data) if op.name == "EMPTY_TUPLE")
    (path / ".metadata").write_bytes(data[:at] + b"\x00" + data[at + 1 :])  # no opcode has code 0
    rehash(path)
    with pytest.raises(CheckpointError, match=r"\.metadata: is damaged and cannot be read \(UnpicklingError"):
        load_checkpoint(path, build_state(seed=1))


def test_archive_pickles_with_a_memo_index_past_their_end_are_declined_without_growing_memory():
    """The tensor and plain-value readers unpickle an archive's data.pkl themselves: the same memo
    check runs first, so a LONG_BINPUT of index 2**27 is declined (torch.load's own unpickler, with
    a dictionary for a memo, then judges it) instead of a 2 GiB table."""
    import io
    import pickletools
    import resource

    from kiln.checkpoint.serialization import _NOT_PLAIN, _plain_value, _tensor_record

    def crafted(value):
        buffer = io.BytesIO()
        torch.save(value, buffer, pickle_protocol=4)  # protocol 4 memoizes with one-byte MEMOIZE
        data = buffer.getvalue()
        pickled = torch._C.PyTorchFileReader(io.BytesIO(data)).get_record("data.pkl")
        at = [pos for op, _, pos in pickletools.genops(pickled) if op.name == "MEMOIZE"][1]
        bad = pickled[:at] + b"r" + (1 << 27).to_bytes(4, "little") + pickled[at + 5 :]  # same length
        return io.BytesIO(data.replace(pickled, bad, 1))

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert _tensor_record(crafted(torch.zeros(2, 3))) is None
    assert _plain_value(crafted({"lr": [0.1, (0.9, 0.99)], "name": "adam"})) is _NOT_PLAIN
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB
