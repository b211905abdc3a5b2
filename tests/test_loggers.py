"""Tests for kiln.loggers: each destination's real output read back, and the Logger fan-out."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kiln.loggers.console import ConsoleLogger
from kiln.loggers.destination import LoggerDestination
from kiln.loggers.file import FileLogger
from kiln.loggers.logger import Logger

SRC = Path(__file__).resolve().parents[1] / "src"


class Recorder(LoggerDestination):
    """A destination that remembers every call."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls: list[tuple[str, Any, Any]] = []

    def log_metrics(self, metrics, step=None):
        self.calls.append(("metrics", metrics, step))

    def log_hyperparameters(self, params):
        self.calls.append(("hyperparameters", params, None))

    def log_text(self, text, step=None):
        self.calls.append(("text", text, step))


# --- package surface -------------------------------------------------------------------------


def test_import_does_not_load_optional_backends():
    code = (
        "import sys, kiln.loggers as L\n"
        "assert set(L.__all__) == {'LoggerDestination', 'Logger', 'ConsoleLogger', 'FileLogger',"
        " 'TensorBoardLogger', 'WandBLogger', 'MLflowLogger'}, L.__all__\n"
        "loaded = [m for m in ('tensorboard', 'torch.utils.tensorboard', 'wandb', 'mlflow')"
        " if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_destinations_are_callbacks_that_flush_on_epoch_end(tmp_path):
    from kiln.core.callback import Callback
    from kiln.core.event import Event

    destination = FileLogger(tmp_path / "m.jsonl")
    assert isinstance(destination, Callback)
    destination.log_metrics({"a": 1.0}, step=1)
    destination.run_event(Event.EPOCH_END, state=None, logger=None)
    assert (tmp_path / "m.jsonl").read_text() == '{"step": 1, "metrics": {"a": 1.0}}\n'
    destination.close()


# --- Logger ------------------------------------------------------------------------------------


def test_logger_fans_out_and_converts_tensors():
    first, second = Recorder(), Recorder()
    logger = Logger([first, second], rank=0)
    logger.log_metrics(
        {"loss": torch.tensor(0.5), "acc": torch.tensor([0.25]), "count": torch.tensor(3), "lr": 0.01, "epoch": 2},
        step=7,
    )
    for destination in (first, second):
        kind, metrics, step = destination.calls[0]
        assert (kind, step) == ("metrics", 7)
        assert metrics == {"loss": 0.5, "acc": 0.25, "count": 3, "lr": 0.01, "epoch": 2}
        assert type(metrics["loss"]) is float and type(metrics["count"]) is int
    # Each destination gets its own dict.
    assert first.calls[0][1] is not second.calls[0][1]


def test_logger_converts_numpy_scalars_and_hyperparameter_tensors():
    np = pytest.importorskip("numpy")
    recorder = Recorder()
    logger = Logger(recorder, rank=0)
    logger.log_metrics({"x": np.float32(1.5)}, step=0)
    logger.log_hyperparameters({"lr": torch.tensor(0.5), "optim": {"betas": torch.tensor([0.9, 0.99])}})
    assert recorder.calls[0][1] == {"x": 1.5} and type(recorder.calls[0][1]["x"]) is float
    params = recorder.calls[1][1]
    assert params["lr"] == 0.5 and params["optim"]["betas"] == pytest.approx([0.9, 0.99])


def test_logger_rank_zero_only(monkeypatch):
    zero_only, everywhere = Recorder(), Recorder(rank_zero_only=False)
    logger = Logger([zero_only, everywhere], rank=1)
    logger.log_metrics({"loss": torch.tensor(1.0)}, step=1)
    logger.log_hyperparameters({"lr": 0.1})
    logger.log_text("hello")
    assert zero_only.calls == []
    assert [c[0] for c in everywhere.calls] == ["metrics", "hyperparameters", "text"]


def test_logger_does_not_convert_when_nothing_writes(monkeypatch):
    import kiln.loggers.logger as logger_module

    def forbidden(metrics):
        raise AssertionError("tensors converted (a host sync) on a rank that writes nothing")

    monkeypatch.setattr(logger_module, "_metrics_to_python", forbidden)
    Logger([Recorder()], rank=3).log_metrics({"loss": torch.tensor(1.0)}, step=1)


def test_logger_rejects_non_scalar_tensor_and_non_destinations():
    with pytest.raises(ValueError, match="'loss'.*shape \\(2,\\)"):
        Logger(Recorder(), rank=0).log_metrics({"loss": torch.ones(2)})
    with pytest.raises(TypeError, match="LoggerDestination"):
        Logger([object()], rank=0)


def test_logger_step_defaults_to_state_batch():
    recorder = Recorder()
    state = SimpleNamespace(timestamp=SimpleNamespace(batch=SimpleNamespace(value=42)))
    logger = Logger([recorder], rank=0, state=state)
    logger.log_metrics({"a": 1.0})
    logger.log_metrics({"a": 2.0}, step=5)
    assert [c[2] for c in recorder.calls] == [42, 5]


def test_logger_default_rank_without_process_group():
    assert Logger().rank == 0


# --- ConsoleLogger -----------------------------------------------------------------------------


def test_console_logger_lines(capsys):
    logger = Logger([ConsoleLogger(time_format=None)], rank=0)
    logger.log_metrics({"train/loss": torch.tensor(0.1234), "train/lr": 0.01}, step=12)
    logger.log_metrics({"eval/Accuracy": 0.75})
    logger.log_hyperparameters({"lr": 0.01, "batch_size": 32})
    logger.log_text("done", step=3)
    assert capsys.readouterr().out.splitlines() == [
        "[batch 12] train/loss: 0.1234  train/lr: 0.01",
        "eval/Accuracy: 0.75",
        "[hyperparameters] lr: 0.01  batch_size: 32",
        "[batch 3] done",
    ]


def test_console_logger_interval_and_stream():
    stream = io.StringIO()
    console = ConsoleLogger(log_interval=10, stream=stream, time_format=None)
    for step in range(1, 21):
        console.log_metrics({"train/loss": 1.0 / step}, step=step)
    console.log_metrics({"eval/loss": 0.5}, step=15)  # eval results print off the interval
    assert stream.getvalue().splitlines() == [
        "[batch 10] train/loss: 0.1",
        "[batch 20] train/loss: 0.05",
        "[batch 15] eval/loss: 0.5",
    ]
    with pytest.raises(ValueError, match="log_interval.*0"):
        ConsoleLogger(log_interval=0)


def test_console_logger_lines_start_with_the_time(monkeypatch):
    """Each line starts with the time of day (a log file says when), in the format asked for."""
    monkeypatch.setattr(time, "localtime", lambda *args: time.struct_time((2026, 11, 27, 14, 2, 31, 4, 331, 0)))
    stream = io.StringIO()
    ConsoleLogger(stream=stream).log_metrics({"train/loss": 0.5}, step=3)
    ConsoleLogger(stream=stream, time_format="%Y-%m-%d %H:%M").log_text("done")
    assert stream.getvalue().splitlines() == ["14:02:31 [batch 3] train/loss: 0.5", "2026-11-27 14:02 done"]
    with pytest.raises(ValueError, match="time_format must be a strftime string or None, got 5"):
        ConsoleLogger(time_format=5)  # type: ignore[arg-type]


# --- FileLogger --------------------------------------------------------------------------------


def test_file_logger_writes_json_lines(tmp_path):
    path = tmp_path / "nested" / "run" / "metrics.jsonl"
    destination = FileLogger(path)
    assert not path.parent.exists()  # nothing is created until something is written
    logger = Logger([destination], rank=0)
    logger.log_hyperparameters({"lr": 0.01, "optim": {"name": "sgd"}, "path": Path("/x")})
    logger.log_metrics({"train/loss": torch.tensor(0.5), "train/lr": 0.01}, step=1)
    logger.log_metrics({"train/loss": 0.25}, step=2)
    logger.log_metrics({"eval/acc": 1}, step=None)
    logger.log_text("note", step=2)
    destination.close()
    destination.close()  # closing twice is harmless
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records == [
        {"hyperparameters": {"lr": 0.01, "optim": {"name": "sgd"}, "path": "/x"}},
        {"step": 1, "metrics": {"train/loss": 0.5, "train/lr": 0.01}},
        {"step": 2, "metrics": {"train/loss": 0.25}},
        {"step": None, "metrics": {"eval/acc": 1}},
        {"step": 2, "text": "note"},
    ]


def test_file_logger_flush_interval_and_append(tmp_path):
    path = tmp_path / "m.jsonl"
    destination = FileLogger(path, flush_interval=2)
    destination.log_metrics({"a": 1.0}, step=1)
    destination.log_metrics({"a": 2.0}, step=2)
    assert len(path.read_text().splitlines()) == 2  # flushed without close
    destination.close()
    resumed = FileLogger(path)  # a resumed run continues the same file
    resumed.log_metrics({"a": 3.0}, step=3)
    resumed.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    with pytest.raises(ValueError, match="flush_interval"):
        FileLogger(path, flush_interval=0)


# --- TensorBoardLogger -------------------------------------------------------------------------


def test_tensorboard_logger_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from kiln.loggers.tensorboard import TensorBoardLogger

    destination = TensorBoardLogger(tmp_path / "tb", flush_interval=2)
    logger = Logger([destination], rank=0)
    logged = {1: (0.5, 0.1), 2: (0.25, 0.05), 5: (0.125, 0.025)}
    for step, (loss, lr) in logged.items():
        logger.log_metrics({"train/loss": torch.tensor(loss), "train/lr": lr}, step=step)
    logger.log_hyperparameters({"lr": 0.1, "optim": {"momentum": 0.9}})
    destination.close()

    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    assert {"train/loss", "train/lr"} <= set(accumulator.Tags()["scalars"])
    losses = accumulator.Scalars("train/loss")
    lrs = accumulator.Scalars("train/lr")
    assert [e.step for e in losses] == [1, 2, 5] and [e.step for e in lrs] == [1, 2, 5]
    assert [e.value for e in losses] == pytest.approx([0.5, 0.25, 0.125])
    assert [e.value for e in lrs] == pytest.approx([0.1, 0.05, 0.025])
    (text_event,) = accumulator.Tensors("hyperparameters/text_summary")
    table = text_event.tensor_proto.string_val[0].decode()
    assert "| lr | 0.1 |" in table and "| optim.momentum | 0.9 |" in table


def test_tensorboard_logger_creates_nothing_until_written(tmp_path):
    pytest.importorskip("tensorboard")
    from kiln.loggers.tensorboard import TensorBoardLogger

    destination = TensorBoardLogger(tmp_path / "tb")
    destination.close()
    assert not (tmp_path / "tb").exists()


# --- missing packages --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "blocked", "make", "hint"),
    [
        ("kiln.loggers.tensorboard", ["torch.utils.tensorboard"], "TensorBoardLogger", "pip install tensorboard"),
        ("kiln.loggers.wandb", ["wandb"], "WandBLogger", "pip install wandb"),
        ("kiln.loggers.mlflow", ["mlflow", "mlflow.tracking"], "MLflowLogger", "pip install mlflow"),
    ],
)
def test_missing_package_error(monkeypatch, tmp_path, module, blocked, make, hint):
    import importlib

    cls = getattr(importlib.import_module(module), make)
    for name in blocked:
        monkeypatch.setitem(sys.modules, name, None)  # makes `import name` raise ImportError
    args = (tmp_path,) if make == "TensorBoardLogger" else ()
    with pytest.raises(ImportError, match=hint):
        cls(*args)


# --- WandBLogger -------------------------------------------------------------------------------


def _wandb_env(monkeypatch, tmp_path):
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")


def _read_wandb_history(run_file: Path) -> list[dict[str, Any]]:
    """History rows from a ``.wandb`` file (a LevelDB-style log of protobuf ``Record``s)."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the tail of a block too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record is assembled
            record = wandb_internal_pb2.Record.FromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in items})
    return rows


def test_wandb_logger_offline_run(monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    from kiln.loggers.wandb import WandBLogger

    _wandb_env(monkeypatch, tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    destination = WandBLogger(project="kiln-test", name="offline", dir=str(tmp_path))
    logger = Logger([destination], rank=0)
    logger.log_hyperparameters({"lr": 0.1, "optim": {"momentum": 0.9}})
    logger.log_metrics({"train/loss": torch.tensor(0.5)}, step=1)
    logger.log_metrics({"train/loss": 0.25, "eval/acc": 0.75}, step=2)
    run_id = destination.state_dict()["run_id"]
    destination.close()

    (run_dir,) = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}")
    # wandb's service process may still be writing the run file after finish() returns: poll.
    deadline = time.monotonic() + 30
    while True:
        try:
            rows = _read_wandb_history(run_dir / f"run-{run_id}.wandb")
        except Exception:  # a record still being written
            if time.monotonic() > deadline:
                raise
            rows = []
        if len(rows) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [(r["_step"], r["train/loss"]) for r in rows] == [(1, 0.5), (2, 0.25)]
    assert rows[1]["eval/acc"] == 0.75


def test_wandb_logger_mode_without_credentials(monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    from kiln.loggers.wandb import WandBLogger

    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.setenv(name, "x")
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert WandBLogger(project="p").init_kwargs["mode"] == "offline"  # no login: no prompt

    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password " + "k" * 40 + "\n")
    assert WandBLogger(project="p").init_kwargs["mode"] is None  # logged in: wandb's default
    (tmp_path / "netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert WandBLogger(project="p").init_kwargs["mode"] is None
    assert WandBLogger(project="p", mode="disabled").init_kwargs["mode"] == "disabled"


def test_wandb_logger_resume_uses_saved_run_id():
    pytest.importorskip("wandb")
    from kiln.loggers.wandb import WandBLogger

    destination = WandBLogger(project="p", mode="disabled")
    destination.load_state_dict({"run_id": "abc123"})
    assert destination.init_kwargs["id"] == "abc123" and destination.init_kwargs["resume"] == "allow"


# --- MLflowLogger ------------------------------------------------------------------------------


def test_mlflow_logger_file_store(monkeypatch, tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from kiln.loggers.mlflow import MLflowLogger

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "x")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")  # the logger must opt in itself
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "x")
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.chdir(tmp_path)
    destination = MLflowLogger(experiment_name="kiln-test", run_name="r1")
    monkeypatch.chdir(tmp_path.parent)  # the default ./mlruns was fixed when the logger was built
    assert destination.tracking_uri == (tmp_path / "mlruns").as_uri()

    logger = Logger([destination], rank=0)
    logger.log_hyperparameters({"lr": 0.1, "optim": {"momentum": 0.9}})
    logger.log_metrics({"train/loss": torch.tensor(0.5)}, step=1)
    logger.log_metrics({"train/loss": 0.25, "eval/acc": 0.75}, step=2)
    run_id = destination.state_dict()["run_id"]
    destination.close()

    assert (tmp_path / "mlruns").is_dir()
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    history = client.get_metric_history(run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.25)]
    run = client.get_run(run_id)
    assert run.data.params == {"lr": "0.1", "optim.momentum": "0.9"}
    assert run.data.metrics["eval/acc"] == 0.75
    assert run.info.run_name == "r1" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "kiln-test"

    # A resumed logger continues the same run.
    resumed = MLflowLogger(experiment_name="kiln-test", tracking_uri=(tmp_path / "mlruns").as_uri())
    resumed.load_state_dict({"run_id": run_id})
    resumed.log_metrics({"train/loss": 0.125}, step=3)
    resumed.close()
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [1, 2, 3]


def test_mlflow_logger_creates_nothing_until_written(monkeypatch, tmp_path):
    pytest.importorskip("mlflow")
    from kiln.loggers.mlflow import MLflowLogger

    destination = MLflowLogger(tracking_uri=(tmp_path / "mlruns").as_uri())
    destination.close()
    assert destination.state_dict() == {} and not (tmp_path / "mlruns").exists()


# --- images ------------------------------------------------------------------------------------


def _images():
    """Two 3-channel 4x6 images, float in [0, 1], and the uint8 NHWC array every logger receives."""
    images = torch.zeros(2, 3, 4, 6)
    images[0, 0] = 1.0  # red
    images[1, 2, :2] = 0.5  # half blue, top half
    expected = torch.zeros(2, 4, 6, 3, dtype=torch.uint8)
    expected[0, ..., 0] = 255
    expected[1, :2, :, 2] = 128
    return images, expected.numpy()


def test_log_images_normalises_every_input_form(tmp_path):
    import numpy as np

    images, expected = _images()
    recorder = Recorder()
    recorder.log_images = lambda array, name, step=None: recorder.calls.append(("images", array, (name, step)))
    logger = Logger([recorder, ConsoleLogger(), FileLogger(tmp_path / "m.jsonl")], rank=0)  # those two ignore images
    logger.log_images(images, "batch", step=3)
    logger.log_images(images[0], "one", step=4)  # (C, H, W)
    logger.log_images((images * 255).round().to(torch.uint8).numpy(), "uint8", step=5)
    logger.log_images(images.permute(0, 2, 3, 1).numpy(), "hwc", step=6, channels_last=True)
    logger.log_images([images[0], images[1]], "list", step=7)
    logger.log_images(torch.ones(4, 6), "grey", step=8)  # (H, W)
    calls = recorder.calls
    assert [c[2] for c in calls] == [("batch", 3), ("one", 4), ("uint8", 5), ("hwc", 6), ("list", 7), ("grey", 8)]
    for _, array, (name, _) in calls[:5]:
        assert array.dtype == np.uint8 and array.shape[-1] == 3, name
        np.testing.assert_array_equal(array, expected[:1] if name == "one" else expected, err_msg=name)
    assert calls[5][1].shape == (1, 4, 6, 1) and (calls[5][1] == 255).all()
    assert not (tmp_path / "m.jsonl").exists()
    with pytest.raises(ValueError, match=r"2 channels; expected 1, 3 or 4"):
        logger.log_images(torch.zeros(1, 2, 4, 4))
    with pytest.raises(TypeError, match="got str"):
        logger.log_images("picture.png")


def test_tensorboard_logger_images(tmp_path):
    pytest.importorskip("tensorboard")
    import numpy as np
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from kiln.loggers.tensorboard import TensorBoardLogger

    images, expected = _images()
    destination = TensorBoardLogger(tmp_path / "tb")
    Logger([destination], rank=0).log_images(images, "samples", step=7)
    destination.close()
    accumulator = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0})
    accumulator.Reload()
    assert accumulator.Tags()["images"] == ["samples"]
    (event,) = accumulator.Images("samples")
    assert event.step == 7 and (event.width, event.height) == (12, 4)  # add_images tiles the batch in a row
    decoded = np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))
    np.testing.assert_array_equal(decoded, np.concatenate(list(expected), axis=1))


def test_wandb_logger_images_offline(monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    import numpy as np
    from PIL import Image

    from kiln.loggers.wandb import WandBLogger

    _wandb_env(monkeypatch, tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    images, expected = _images()
    destination = WandBLogger(project="kiln-test", name="images", dir=str(tmp_path))
    Logger([destination], rank=0).log_images(images, "samples", step=2)
    run_id = destination.state_dict()["run_id"]
    destination.close()
    (run_dir,) = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}")
    deadline = time.monotonic() + 30
    while True:  # the service process may still be writing after finish(): poll
        files = sorted((run_dir / "files" / "media" / "images").glob("samples_*.png"))
        try:
            rows = _read_wandb_history(run_dir / f"run-{run_id}.wandb")
        except Exception:  # a record still being written
            rows = []
        if (len(files) == 2 and rows) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(files) == 2, list(run_dir.rglob("*"))
    decoded = sorted(np.asarray(Image.open(f).convert("RGB")).tobytes() for f in files)
    assert decoded == sorted(image.tobytes() for image in expected)
    (row,) = rows  # nested keys come back joined with "/"
    assert row["_step"] == 2 and row["samples/_type"] == "images/separated" and row["samples/count"] == 2
    assert sorted(row["samples/filenames"]) == sorted(f"media/images/{f.name}" for f in files)


def test_mlflow_logger_images(monkeypatch, tmp_path):
    pytest.importorskip("mlflow")
    import numpy as np
    from mlflow.tracking import MlflowClient
    from PIL import Image

    from kiln.loggers.mlflow import MLflowLogger

    images, expected = _images()
    uri = (tmp_path / "mlruns").as_uri()
    destination = MLflowLogger(experiment_name="kiln-test", tracking_uri=uri)
    Logger([destination], rank=0).log_images(images, "samples", step=3)
    run_id = destination.state_dict()["run_id"]
    destination.close()
    client = MlflowClient(tracking_uri=uri)
    artifacts = [a.path for a in client.list_artifacts(run_id, "images")]
    pngs = sorted(a for a in artifacts if a.endswith(".png"))
    # MLflow's file names: <key with "/" escaped><sep>step<sep>3<sep>timestamp... (separators vary by version)
    found = [re.match(r"images/samples[#~](\d)[%+]step[%+](\d+)[%+]", a) for a in pngs]
    assert [(m.group(1), m.group(2)) for m in found if m] == [("0", "3"), ("1", "3")], artifacts
    for index, artifact in enumerate(pngs):
        local = client.download_artifacts(run_id, artifact, str(tmp_path))
        np.testing.assert_array_equal(np.asarray(Image.open(local).convert("RGB")), expected[index])
