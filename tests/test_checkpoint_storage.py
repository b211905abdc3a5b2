"""Checkpoints beyond the local disk: the same suite on the local disk, ``memory://`` and a real S3
endpoint (moto's server on 127.0.0.1, spoken to over HTTP by s3fs), plus a 2-rank Trainer run on
S3 killed hard in the middle of an upload and autoresumed from the bucket, bit-exact.

``memory://`` lives inside one process, so it runs only in the single-process tests; the 2-rank
test uses S3 (the local disk's multi-process kills are tests/test_checkpoint_crash.py and
tests/test_checkpoint_trainer.py).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import sys
import threading
import uuid
from contextlib import contextmanager

import pytest
import torch

from distributed import WORKERS, fork_run, free_port
from kiln.checkpoint import (
    CheckpointError,
    CheckpointSaver,
    hashing,
    layout,
    load_checkpoint,
    save_checkpoint,
    verification,
    verify_checkpoint,
)
from kiln.checkpoint.storage import RemotePath, as_path
from kiln.launch.runlock import LOCK_NAME
from workers.ckpt_common import assert_same, build_state, snapshot, train

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3_endpoint():
    """An S3 server on 127.0.0.1 (moto's S3 app under werkzeug's threaded server, as
    moto.server.ThreadedMotoServer serves it), with a bucket ``kiln``; its URL.

    Served without ThreadedMotoServer's dispatcher of every AWS service, which lists moto's ~150
    package folders on each request to find the service (a quarter of the server's CPU here: the
    suite makes ~2,500 requests)."""
    from moto.moto_server.werkzeug_app import MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = make_server(
        "127.0.0.1", free_port(), create_backend_app("s3"), threaded=True, request_handler=MotoRequestHandler
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_port}"
    import boto3

    boto3.client("s3", endpoint_url=url, **_boto_credentials()).create_bucket(Bucket="kiln")
    yield url
    server.shutdown()
    thread.join()


def _boto_credentials():
    return {
        "aws_access_key_id": S3_ENV["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": S3_ENV["AWS_SECRET_ACCESS_KEY"],
        "region_name": S3_ENV["AWS_DEFAULT_REGION"],
    }


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch):
    """The standard environment variables pointing at the test server (conftest restores them)."""
    for key, value in {**S3_ENV, "AWS_ENDPOINT_URL": s3_endpoint}.items():
        monkeypatch.setenv(key, value)
    return {**S3_ENV, "AWS_ENDPOINT_URL": s3_endpoint}


@pytest.fixture(params=["local", "memory", "s3"])
def folder(request, tmp_path):
    """A fresh save folder on each storage: a path, or a URL."""
    run = uuid.uuid4().hex[:8]
    if request.param == "local":
        yield str(tmp_path / "run")
    elif request.param == "memory":
        yield f"memory://kiln-test-{run}"
        as_path(f"memory://kiln-test-{run}").rmtree()
        as_path(f"memory://kiln-test-{run}-merged").rmtree()
    else:
        request.getfixturevalue("s3_env")
        yield f"s3://kiln/{run}"


def _names(folder) -> set[str]:
    """Every entry of the save folder, as the storage lists it (but the lock of a run still saving there)."""
    return {entry.name for entry in as_path(folder).iterdir() if entry.name != LOCK_NAME}


def _files(path) -> set[str]:
    path = as_path(path)
    return {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}


@contextmanager
def _failing_upload():
    """Every DCP data file fails at its first write (a full disk, a dropped connection): the save
    dies part-way, its rank<r>.pt already written."""
    write = hashing.HashingStream.write

    def fail(self, data):
        if self.name.endswith(".distcp"):
            raise OSError(28, "No space left on device (test)")
        return write(self, data)

    hashing.HashingStream.write = fail
    try:
        yield
    finally:
        hashing.HashingStream.write = write


# -- the suite, on every storage ------------------------------------------------------------------
def test_save_types_load_bit_exact_with_a_complete_manifest(folder):
    state = build_state()
    for save_type in ("sharded", "deduped", "merged"):
        train(state, 2)
        path = save_checkpoint(folder, state, save_type)
        expected = snapshot(state)
        manifest = verify_checkpoint(path)
        assert manifest["save_type"] == save_type and manifest["name"] == path.name
        # the manifest vouches for exactly the files there, with their checksums and sizes
        assert set(manifest["files"]) == _files(path) - {layout.MANIFEST}
        for name, record in manifest["files"].items():
            assert record == {
                "xxh3_128": verification.checksum_file(path / name)[0],
                "bytes": (path / name).stat().st_size,
            }
        assert layout.link_target(folder, "last") == path.name
        fresh = build_state(seed=1)
        load_checkpoint("last", fresh, folder=folder)
        assert_same(expected, snapshot(fresh))
    assert _names(folder) == {"ep0-ba2", "ep0-ba4", "ep0-ba6", "last"}


def test_a_failed_upload_is_invisible_and_cleaned_up(folder):
    state = build_state()
    train(state, 2)
    good = save_checkpoint(folder, state)
    expected = copy.deepcopy(snapshot(state))  # the tensors themselves: training goes on below
    train(state, 1)
    with _failing_upload(), pytest.raises(CheckpointError, match="No space left on device"):
        save_checkpoint(folder, state)
    # the failed save removed what it wrote (ep0-ba3 on an object store, ep0-ba3.tmp-* locally)
    assert _names(folder) == {good.name, "last"}
    assert layout.link_target(folder, "last") == good.name
    assert [p.name for p, _ in layout.list_checkpoints(folder)] == [good.name]
    assert layout.resolve_checkpoint(folder, "last") == as_path(good).resolve()
    fresh = build_state(seed=1)
    load_checkpoint(folder, fresh)  # a save folder: its `last`
    assert_same(expected, snapshot(fresh))
    assert layout.cleanup_temporary(folder) == []
    assert _names(folder) == {good.name, "last"}


def _damage(file) -> None:
    """Flip one byte in the middle of ``file`` (a tensor's data, in a .distcp file)."""
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def test_a_corrupt_file_is_refused_before_the_state_changes(folder):
    state = build_state()
    train(state, 2)
    path = save_checkpoint(folder, state)
    victim = max((n for n in _files(path) if n.endswith(".distcp")), key=lambda n: (path / n).stat().st_size)
    _damage(path / victim)
    fresh = build_state(seed=1)
    before = copy.deepcopy(snapshot(fresh))
    with pytest.raises(
        CheckpointError, match=f"{victim}: is corrupt: its xxh3_128 checksum does not match the manifest"
    ):
        load_checkpoint(path, fresh)
    assert_same(before, snapshot(fresh))  # the checksums are taken while reading, but checked before applying


def _damage_tensor(path, tensor) -> str:
    """Flip one byte inside ``tensor``'s saved values (not the zip records around them, whose damage
    fails the read by itself): only the checksum can tell. Returns the damaged file's name."""
    needle = tensor.detach().contiguous().numpy().tobytes()
    for name in sorted(_files(path)):
        file = as_path(path) / name
        data = bytearray(file.read_bytes())
        at = data.find(needle)
        if name.endswith(".distcp") and at >= 0:
            data[at + len(needle) // 2] ^= 0x01
            file.write_bytes(bytes(data))
            return name
    raise AssertionError("the tensor's bytes are in no .distcp file")


@pytest.mark.parametrize("memory", ["plenty", "none to spare"])
def test_damaged_tensor_values_are_refused_before_the_state_changes(folder, memory, monkeypatch):
    """The values still unpickle, so the read succeeds: the checksum alone refuses them. On object
    stores the load reads the bytes the checksum pass downloaded, unless memory is short."""
    if memory == "none to spare":
        monkeypatch.setattr(verification, "memory_to_spare", lambda: 0)
    state = build_state()
    train(state, 2)
    path = save_checkpoint(folder, state)
    victim = _damage_tensor(path, state.model[0].weight)
    fresh = build_state(seed=1)
    before = copy.deepcopy(snapshot(fresh))
    with pytest.raises(
        CheckpointError, match=f"{victim}: is corrupt: its xxh3_128 checksum does not match the manifest"
    ):
        load_checkpoint(path, fresh)
    assert_same(before, snapshot(fresh))
    load_checkpoint(path, fresh, verify=False)  # the damage is real: unchecked, the flipped value loads
    assert not torch.equal(fresh.model[0].weight, state.model[0].weight)


def test_a_verified_load_reads_each_file_once_from_an_object_store(monkeypatch):
    """The checksum pass downloads each .distcp file once and the load reads those bytes."""
    folder = f"memory://kiln-test-{uuid.uuid4().hex[:8]}"
    state = build_state()
    train(state, 2)
    path = save_checkpoint(folder, state)
    fs, reads = path.fs, []
    cat_file, open_ = fs.cat_file, fs.open
    monkeypatch.setattr(fs, "cat_file", lambda p, *a, **k: (reads.append(("cat", str(p))), cat_file(p, *a, **k))[1])
    monkeypatch.setattr(fs, "open", lambda p, *a, **k: (reads.append(("open", str(p))), open_(p, *a, **k))[1])
    fresh = build_state(seed=1)
    load_checkpoint(path, fresh)
    assert_same(snapshot(state), snapshot(fresh))
    distcp = sorted(n for n in _files(path) if n.endswith(".distcp"))
    assert sorted(p.rsplit("/", 1)[1] for _, p in reads if p.endswith(".distcp")) == distcp
    as_path(folder).rmtree()


def test_manifests_of_earlier_kiln_with_sha256_still_verify(folder):
    import hashlib

    state = build_state()
    train(state, 2)
    path = save_checkpoint(folder, state)
    manifest = layout.read_manifest(path)
    for name, entry in manifest["files"].items():
        manifest["files"][name] = {
            "sha256": hashlib.sha256((path / name).read_bytes()).hexdigest(),
            "bytes": entry["bytes"],
        }
    layout.write_manifest(path, manifest)
    assert verify_checkpoint(path)["files"] == manifest["files"]
    fresh = build_state(seed=1)
    load_checkpoint(path, fresh)
    assert_same(snapshot(state), snapshot(fresh))
    victim = _damage_tensor(path, state.model[0].weight)
    with pytest.raises(CheckpointError, match=f"{victim}: is corrupt: its sha256 checksum does not match the manifest"):
        load_checkpoint(path, fresh)
    manifest["files"][victim] = {"md5": "0" * 32, "bytes": manifest["files"][victim]["bytes"]}
    layout.write_manifest(path, manifest)
    with pytest.raises(
        CheckpointError,
        match=rf"{victim}: has no checksum this kiln knows in the manifest \(its record: \['bytes', 'md5'\]\); upgrade kiln, or load with verify=False",
    ):
        load_checkpoint(path, fresh)


def test_a_failure_in_a_writer_thread_is_not_committed(folder, monkeypatch):
    """DCP writes a rank's files from several threads and drops an exception raised in any but the
    first; kiln must still refuse to commit a checkpoint that is missing a file."""
    write = hashing.HashingStream.write

    def fail_off_the_main_thread(self, data):
        if threading.current_thread() is not threading.main_thread():
            raise OSError(5, "Input/output error (test)")
        return write(self, data)

    state = build_state()
    train(state, 1)
    good = save_checkpoint(folder, state)
    train(state, 1)
    monkeypatch.setattr(hashing.HashingStream, "write", fail_off_the_main_thread)
    with pytest.raises(CheckpointError, match="could not be written.*Input/output error"):
        save_checkpoint(folder, state)
    assert [p.name for p, _ in layout.list_checkpoints(folder)] == [good.name]
    assert layout.link_target(folder, "last") == good.name


def test_last_falls_back_to_the_newest_complete_checkpoint(folder):
    state = build_state()
    saved = []
    for _ in range(2):
        train(state, 1)
        saved.append(save_checkpoint(folder, state))
    layout.remove_checkpoint(saved[1])  # `last` now names a checkpoint that is gone
    assert layout.link_target(folder, "last") == saved[1].name
    with pytest.warns(UserWarning, match="most recently saved complete checkpoint"):
        assert layout.resolve_checkpoint(folder, "last").name == saved[0].name
    assert _names(folder) == {saved[0].name, "last"}


def test_retention_deletes_only_old_complete_checkpoints(folder):
    state = build_state()
    saver = CheckpointSaver(folder, interval="1ba", num_checkpoints_to_keep=2, save_best="loss")
    saver.run_event(kiln_event("FIT_START"), state, None)
    for loss in (1.0, 3.0, 2.0, 4.0, 5.0):
        train(state, 1)
        state.metrics["loss"] = loss
        saver.save(state)
        if loss == 3.0:  # a save interrupted after ep0-ba2: debris retention must not touch
            train(state, 1)
            with _failing_upload(), pytest.MonkeyPatch.context() as crash, pytest.raises(CheckpointError):
                # a crash, not a failure: the save's own clean-up (SaveJob.discard) never runs
                crash.setattr("kiln.checkpoint.checkpointing.SaveJob.discard", lambda job: None)
                save_checkpoint(folder, state, name="interrupted")
    debris = {n for n in _names(folder) if "interrupted" in n}
    assert len(debris) == 1
    complete = [p.name for p, _ in layout.list_checkpoints(folder)]
    # the two newest, and `best` (loss 1.0) whatever its age
    assert complete == ["ep0-ba1", "ep0-ba5", "ep0-ba6"]
    assert layout.link_target(folder, "best") == "ep0-ba1"
    assert layout.link_target(folder, "last") == "ep0-ba6"
    assert _names(folder) == {"ep0-ba1", "ep0-ba5", "ep0-ba6", "best", "last"} | debris
    saver.run_event(kiln_event("FIT_START"), state, None)  # a new run cleans the debris up
    assert _names(folder) == {"ep0-ba1", "ep0-ba5", "ep0-ba6", "best", "last"}


def test_async_save_commits_in_the_background(folder):
    state = build_state()
    saver = CheckpointSaver(folder, interval="1ba", num_checkpoints_to_keep=1, save_async=True)
    saver.run_event(kiln_event("FIT_START"), state, None)
    for _ in range(2):
        train(state, 1)
        saver.save(state)
    expected = snapshot(state)
    saver.run_event(kiln_event("FIT_END"), state, None)  # waits for the upload and its commit
    assert _names(folder) == {"ep0-ba2", "last"}
    manifest = verify_checkpoint(as_path(folder) / "last")
    assert manifest["name"] == "ep0-ba2"
    fresh = build_state(seed=1)
    load_checkpoint(folder, fresh)
    assert_same(expected, snapshot(fresh))


def test_cli_verifies_inspects_and_merges_urls(folder, tmp_path, capsys):
    from kiln.cli.main import main

    state = build_state()
    train(state, 2)
    save_checkpoint(folder, state)
    last = f"{folder}/last"
    assert main(["checkpoint", "verify", last]) == 0
    assert "ep0-ba2" in capsys.readouterr().out
    assert main(["checkpoint", "inspect", "--json", last]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["timestamp"]["batch"] == 2 and info["num_parameters"] == 8 * 16 + 16 + 16 * 4 + 4
    merged = f"{folder}-merged/ep0-ba2.pt"
    assert main(["checkpoint", "merge", last, merged]) == 0
    assert torch.load(as_path(merged).open("rb"), weights_only=True)["manifest"]["name"] == "ep0-ba2"
    assert main(["checkpoint", "export", last, "--safetensors", str(tmp_path / "model.safetensors")]) == 0
    # damage one byte of a tensor file: verify names it, inspect (sizes only) still reads it
    path = as_path(folder) / "ep0-ba2"
    victim = next(name for name in sorted(_files(path)) if name.endswith(".distcp"))
    _damage(path / victim)
    assert main(["checkpoint", "verify", last]) == 1
    err = capsys.readouterr().err
    assert f"{victim}: is corrupt: its xxh3_128 checksum does not match the manifest" in err
    assert err.count("\n") == 1  # one line, no traceback


def test_storage_options_reach_the_filesystem(s3_endpoint, monkeypatch):
    """No endpoint in the environment: storage_options= carries endpoint and credentials."""
    for key in ("AWS_ENDPOINT_URL", *S3_ENV):
        monkeypatch.delenv(key, raising=False)
    options = {"endpoint_url": s3_endpoint, "key": "testing", "secret": "testing"}
    folder = f"s3://kiln/{uuid.uuid4().hex[:8]}"
    state = build_state()
    train(state, 1)
    path = save_checkpoint(folder, state, storage_options=options)
    assert isinstance(path, RemotePath) and str(path) == f"{folder}/ep0-ba1"
    fresh = build_state(seed=1)
    load_checkpoint(folder, fresh, storage_options=options)
    assert_same(snapshot(state), snapshot(fresh))


def test_a_missing_filesystem_names_the_extra(monkeypatch):
    import fsspec

    registry = sys.modules["fsspec.registry"]._registry  # the classes fsspec has imported (fsspec.registry is a view)
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as if not installed
    monkeypatch.delitem(registry, "s3", raising=False)  # nor imported before
    assert fsspec
    with pytest.raises(ImportError, match=r"s3://kiln/x: the s3:// filesystem is not installed.*the s3 extra \(s3fs\)"):
        as_path("s3://kiln/x")


def kiln_event(name):
    import kiln

    return getattr(kiln.Event, name)


# -- 2 ranks on S3: a hard kill in the middle of an upload, then autoresume from the bucket ----------
RUN = WORKERS / "ckpt_storage.py"


def _launch(env, *runs):
    """One 2-rank job training ``runs`` (each ``(out, save_folder, *extra)``) one after another."""
    argv = []
    for i, (out, save_folder, *extra) in enumerate(runs):
        out.mkdir(parents=True, exist_ok=True)
        argv += [*(["--then"] if i else []), str(out), save_folder, *extra]
    return fork_run(RUN, *argv, nproc=2, env=env, timeout=240)


def _finals(out):
    return [torch.load(out / f"final_rank{r}.pt", weights_only=True) for r in range(2)]


def test_two_ranks_killed_in_an_upload_autoresume_from_the_bucket_bit_exact(tmp_path, s3_env):
    run = f"s3://kiln/{uuid.uuid4().hex[:8]}"
    # the uninterrupted run, then in the same processes the one killed in its second upload
    full = (tmp_path / "full", f"{run}-full")
    killed = _launch(s3_env, full, (tmp_path / "run", run, "--kill-in-upload", "2", "--async"))
    assert killed.returncode != 0, "the run should have been killed"
    missing = [r for r in range(2) if not (tmp_path / f"full/final_rank{r}.pt").exists()]
    assert not missing, f"the uninterrupted run did not finish on ranks {missing}:\n{killed.stderr[-3000:]}"
    bucket = as_path(run)
    first, second = "ep0-ba4", "ep1-ba8"
    assert _names(run) == {first, second, "last"}
    assert layout.link_target(run, "last") == first  # `last` points at the complete checkpoint
    assert not (bucket / second / layout.MANIFEST).exists()  # the upload that was cut short
    assert {"rank0.pt", "rank1.pt"} <= _files(bucket / second)  # part of it is in the bucket
    assert verify_checkpoint(bucket / "last")["world_size"] == 2

    resumed = _launch(s3_env, (tmp_path / "run", run, "--async"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for a, b in zip(_finals(tmp_path / "full"), _finals(tmp_path / "run")):
        assert a["batch"] == b["batch"] == 12
        for section in ("model", "optimizer"):
            for key, value in a[section].items():
                same = torch.equal(value, b[section][key]) if torch.is_tensor(value) else value == b[section][key]
                assert same, f"{section}.{key} differs after the resume from the bucket"
    # keep 2, of complete checkpoints only: the two newest (the last batch's, then the end of
    # training's); the interrupted upload was saved again when the run came back, then retired
    assert _names(run) == {"ep2-ba12", "ep3-ba12", "last"}
    assert [p.name for p, _ in layout.list_checkpoints(run)] == ["ep2-ba12", "ep3-ba12"]
    verify_checkpoint(bucket / "last")
    assert os.environ["AWS_ENDPOINT_URL"] == s3_env["AWS_ENDPOINT_URL"]


def test_trainer_storage_options_save_and_autoresume(s3_endpoint, monkeypatch, tmp_path):
    """The Trainer's storage_options= reach save_folder and autoresume (no S3 variables set)."""
    import kiln

    for key in ("AWS_ENDPOINT_URL", *S3_ENV):
        monkeypatch.delenv(key, raising=False)
    options = {"endpoint_url": s3_endpoint, "key": "testing", "secret": "testing"}
    folder = f"s3://kiln/{uuid.uuid4().hex[:8]}"

    def trainer(duration):
        kiln.seed_everything(0)
        model = torch.nn.Linear(4, 2)
        data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
        return kiln.Trainer(
            model,
            train_dataloader=torch.utils.data.DataLoader(data, batch_size=4),
            max_duration=duration,
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            criterion=torch.nn.CrossEntropyLoss(),
            save_folder=folder,
            autoresume=True,
            storage_options=options,
            progress_bar=False,
        )

    first = trainer("1ep")
    first.fit()
    assert layout.link_target(as_path(folder, options), "last") == "ep1-ba4"
    second = trainer("2ep")  # autoresume: loads `last` from the bucket
    assert second.state.timestamp.batch.value == 4
    assert torch.equal(second.state.model.weight, first.state.model.weight)
