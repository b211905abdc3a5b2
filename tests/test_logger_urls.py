"""FileLogger and TensorBoardLogger writing to fsspec URLs: memory:// in one process, and S3 on a
local moto server (endpoint and credentials from the standard AWS_* variables, or storage_options=)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

from kiln.loggers import FileLogger, Logger, TensorBoardLogger

fsspec = pytest.importorskip("fsspec")


@pytest.fixture
def memory_fs():
    fs = fsspec.filesystem("memory")
    yield fs
    if fs.exists("/kiln-test"):
        fs.rm("/kiln-test", recursive=True)


def _jsonl(fs, path):
    return [json.loads(line) for line in fs.cat_file(path).decode().splitlines()]


def _scalars(fs, url_path, tag):
    """The values of ``tag`` in the event files under ``url_path``, read back with TensorBoard's reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with tempfile.TemporaryDirectory() as local:
        fs.get(url_path, local, recursive=True)
        (folder,) = {p.parent for p in Path(local).rglob("events.out.tfevents.*")}
        accumulator = EventAccumulator(str(folder))
        accumulator.Reload()
        return [(e.step, e.value) for e in accumulator.Scalars(tag)]


def test_file_logger_to_memory_url_uploads_at_each_flush_and_a_resumed_run_appends(memory_fs):
    url = "memory://kiln-test/run/metrics.jsonl"
    destination = FileLogger(url, flush_interval=2)
    logger = Logger([destination], rank=0)
    assert not memory_fs.exists("/kiln-test"), "nothing touches the storage before the first write"
    logger.log_metrics({"train/loss": torch.tensor(0.5)}, step=1)
    assert not memory_fs.exists("/kiln-test/run/metrics.jsonl"), "uploaded at the flush, not per record"
    logger.log_metrics({"train/loss": 0.25}, step=2)  # the second record: flush_interval=2
    assert [r["step"] for r in _jsonl(memory_fs, "/kiln-test/run/metrics.jsonl")] == [1, 2]
    logger.log_text("note", step=3)
    destination.close()
    staging = destination._remote
    assert staging is not None and staging._staging is None, "the local staging copy is removed on close"
    assert [r.get("step") for r in _jsonl(memory_fs, "/kiln-test/run/metrics.jsonl")] == [1, 2, 3]

    resumed = FileLogger(url)  # a resumed run continues the same file
    resumed.log_metrics({"train/loss": 0.125}, step=4)
    resumed.close()
    records = _jsonl(memory_fs, "/kiln-test/run/metrics.jsonl")
    assert [r.get("step") for r in records] == [1, 2, 3, 4]
    assert records[0]["metrics"] == {"train/loss": 0.5} and records[2]["text"] == "note"


def test_tensorboard_logger_to_memory_url(memory_fs):
    pytest.importorskip("tensorboard")
    destination = TensorBoardLogger("memory://kiln-test/tb", flush_interval=2)
    logger = Logger([destination], rank=0)
    logger.log_metrics({"train/loss": 0.5}, step=1)
    assert not memory_fs.exists("/kiln-test/tb")
    logger.log_metrics({"train/loss": 0.25}, step=2)
    assert _scalars(memory_fs, "/kiln-test/tb", "train/loss") == [(1, 0.5), (2, 0.25)]
    logger.log_metrics({"train/loss": 0.125}, step=3)
    destination.close()
    assert _scalars(memory_fs, "/kiln-test/tb", "train/loss") == [(1, 0.5), (2, 0.25), (3, 0.125)]


def test_file_urls_are_local_paths(tmp_path):
    destination = FileLogger(f"file://{tmp_path}/m.jsonl")
    destination.log_metrics({"a": 1.0}, step=1)
    destination.close()
    assert json.loads((tmp_path / "m.jsonl").read_text()) == {"step": 1, "metrics": {"a": 1.0}}


def test_an_unknown_protocol_names_the_package():
    destination = FileLogger("nosuchproto://bucket/m.jsonl")
    with pytest.raises((ImportError, ValueError), match="nosuchproto"):
        destination.log_metrics({"a": 1.0}, step=1)


# -- S3 on a local moto server ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def s3_endpoint():
    pytest.importorskip("s3fs")
    server_module = pytest.importorskip("moto.server")
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def _s3(endpoint):
    import s3fs

    return s3fs.S3FileSystem(
        key="test", secret="test", client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True
    )


def test_loggers_to_s3_with_the_standard_environment_variables(s3_endpoint, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    fs = _s3(s3_endpoint)
    fs.mkdir("kiln-env")
    file_logger = FileLogger("s3://kiln-env/run/metrics.jsonl")
    tensorboard = TensorBoardLogger("s3://kiln-env/run/tb")
    logger = Logger([file_logger, tensorboard], rank=0)
    for step in (1, 2):
        logger.log_metrics({"train/loss": 1.0 / step}, step=step)
    file_logger.close()
    tensorboard.close()
    assert [r["step"] for r in _jsonl(fs, "kiln-env/run/metrics.jsonl")] == [1, 2]
    assert _scalars(fs, "kiln-env/run/tb", "train/loss") == [(1, 1.0), (2, 0.5)]


def test_loggers_to_s3_with_storage_options(s3_endpoint, monkeypatch):
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    fs = _s3(s3_endpoint)
    fs.mkdir("kiln-options")
    options = {
        "key": "test",
        "secret": "test",
        "client_kwargs": {"endpoint_url": s3_endpoint, "region_name": "us-east-1"},
    }
    destination = FileLogger("s3://kiln-options/metrics.jsonl", storage_options=options)
    destination.log_metrics({"eval/loss": 0.75}, step=5)
    destination.flush()
    assert _jsonl(fs, "kiln-options/metrics.jsonl") == [{"step": 5, "metrics": {"eval/loss": 0.75}}]
    destination.close()
