"""Reading a run's logs: the File logger's JSON lines or TensorBoard event files, as series per metric.

A run is a folder (or one ``.jsonl`` file). Under a folder, the File logger's ``*.jsonl`` files
are read when there are any, else TensorBoard's ``events.out.tfevents.*`` files; both are read in
the order they were written, so a resumed run (which appends to the same ``.jsonl``, or adds an
event file beside the first) reads as one history:

* ``checkpoint/saved`` and ``checkpoint/resumed`` (logged by the checkpoint saver and by the
  Trainer when it loads a checkpoint) become markers on the time axis, not curves;
* a resume at step ``s`` drops what was logged earlier after ``s``: training went on from the
  checkpoint, and the steps after it that the earlier process logged were done again (or never
  happened in the history that continued);
* otherwise a step logged twice keeps the value written last.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Run", "Series", "RunError", "load_run", "find_logs", "SAVED", "RESUMED"]

SAVED = "checkpoint/saved"
RESUMED = "checkpoint/resumed"

_TB_PREFIX = "events.out.tfevents."


class RunError(ValueError):
    """A run that cannot be read: no such path, no logs in it, or logs without metrics."""


@dataclass
class Series:
    """One metric's values by step (the x axis: the batch count at which it was logged)."""

    steps: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def finite_values(self) -> list[float]:
        return [v for v in self.values if math.isfinite(v)]

    @property
    def last(self) -> float:
        return self.values[-1]


@dataclass
class Run:
    """A run's metrics and the steps at which checkpoints were saved and the run resumed.

    Attributes:
        name: the label in legends (the folder's name unless given).
        path: the folder or file the logs were found under.
        source: ``"jsonl"`` (the File logger) or ``"tensorboard"``.
        files: the log files read, in the order read.
        series: metric name -> :class:`Series`, steps ascending.
        checkpoints: steps at which a checkpoint was saved.
        resumes: steps at which a process resumed from a checkpoint.
        num_skipped_lines: ``.jsonl`` lines that were not JSON (a line cut short by a crash).
    """

    name: str
    path: Path
    source: str
    files: list[Path]
    series: dict[str, Series]
    checkpoints: list[float]
    resumes: list[float]
    num_skipped_lines: int = 0

    @property
    def last_step(self) -> float:
        return max((s.steps[-1] for s in self.series.values() if len(s)), default=0.0)


def find_logs(path: str | os.PathLike[str]) -> tuple[str, list[Path]]:
    """``("jsonl" | "tensorboard", files)`` under ``path``, in the order they were written.

    Raises:
        RunError: when ``path`` does not exist or holds neither kind of log.
    """
    root = Path(path)
    if not root.exists():
        raise RunError(f"no such file or folder: {root}")
    if root.is_file():
        if root.suffix == ".jsonl":
            return "jsonl", [root]
        if root.name.startswith(_TB_PREFIX):
            return "tensorboard", [root]
        raise RunError(f"{root} is neither a File logger .jsonl file nor a TensorBoard event file")
    jsonl = sorted(p for p in root.rglob("*.jsonl") if p.is_file())
    if jsonl:
        return "jsonl", jsonl
    events = [p for p in root.rglob(f"{_TB_PREFIX}*") if p.is_file()]
    if events:
        # events.out.tfevents.<unix time>.<host>.<pid>.<n>: a resumed run's new file sorts after the first
        return "tensorboard", sorted(events, key=_event_file_order)
    raise RunError(f"no File logger (*.jsonl) or TensorBoard (events.out.tfevents.*) logs under {root}")


def _event_file_order(path: Path) -> tuple[int, str, str]:
    stamp = path.name[len(_TB_PREFIX) :].split(".", 1)[0]
    return (int(stamp) if stamp.isdigit() else 0, path.name, str(path))


def load_run(path: str | os.PathLike[str], name: str | None = None) -> Run:
    """Read the run's logs under ``path`` (a folder, a ``.jsonl`` file or an event file).

    Raises:
        RunError: no such path, no logs under it, or logs that hold no metrics.
        ImportError: TensorBoard event files and no ``tensorboard`` package to read them.
    """
    root = Path(path)
    source, files = find_logs(root)
    history = _History()
    skipped = 0
    if source == "jsonl":
        for file in files:
            skipped += _read_jsonl(file, history)
    else:
        for file in files:
            _read_events(file, history)
    if not any(history.series.values()):
        raise RunError(f"the logs under {root} hold no metrics ({', '.join(str(f) for f in files)})")
    label = name or (root.resolve().name if root.is_dir() else root.resolve().parent.name) or str(root)
    return Run(
        name=label,
        path=root,
        source=source,
        files=files,
        # a metric logged only after a checkpoint that a resume went back to has no points left
        series={key: _as_series(points) for key, points in sorted(history.series.items()) if points},
        checkpoints=sorted(history.checkpoints),
        resumes=sorted(history.resumes),
        num_skipped_lines=skipped,
    )


class _History:
    """Records applied in the order they were written (see the module docstring)."""

    def __init__(self) -> None:
        self.series: dict[str, dict[float, float]] = {}
        self.checkpoints: set[float] = set()
        self.resumes: set[float] = set()
        self.num_records = 0  # the step of a record logged without one (what the TensorBoard logger uses)

    def add(self, metrics: dict[str, Any], step: float | None) -> None:
        if step is None:
            step = float(self.num_records)
        self.num_records += 1
        if RESUMED in metrics:
            self._resume(step)
        for key, value in metrics.items():
            if key == SAVED:
                self.checkpoints.add(step)
            elif key != RESUMED and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.series.setdefault(key, {})[step] = float(value)

    def _resume(self, step: float) -> None:
        for points in self.series.values():
            for later in [s for s in points if s > step]:
                del points[later]
        self.checkpoints = {s for s in self.checkpoints if s <= step}
        self.resumes = {s for s in self.resumes if s <= step}
        self.resumes.add(step)


def _as_series(points: dict[float, float]) -> Series:
    steps = sorted(points)
    return Series(steps=steps, values=[points[s] for s in steps])


def _read_jsonl(file: Path, history: _History) -> int:
    skipped = 0
    with file.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                skipped += 1  # a line a crash cut short
                continue
            metrics = record.get("metrics") if isinstance(record, dict) else None
            if isinstance(metrics, dict):
                step = record.get("step")
                history.add(metrics, float(step) if isinstance(step, (int, float)) else None)
    return skipped


def _read_events(file: Path, history: _History) -> None:
    try:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
        from tensorboard.util import tensor_util
    except ImportError as error:
        raise ImportError(
            f"reading TensorBoard event files ({file}) needs the tensorboard package: pip install tensorboard"
        ) from error
    # The loader yields events in the order they were written (a scalar per summary value).
    for event in EventFileLoader(str(file)).Load():
        if not event.HasField("summary"):
            continue
        metrics: dict[str, float] = {}
        for value in event.summary.value:
            if value.HasField("simple_value"):
                metrics[value.tag] = float(value.simple_value)
            elif value.HasField("tensor") and value.metadata.plugin_data.plugin_name == "scalars":
                metrics[value.tag] = float(tensor_util.make_ndarray(value.tensor).item())
        if metrics:
            history.add(metrics, float(event.step))
