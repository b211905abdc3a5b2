"""The report's figures: which metrics go on which panel, drawn with matplotlib (Agg, no display).

One panel per concept: loss (train and every evaluator's), learning rate, throughput, FLOP/s and
MFU, memory, and one per evaluation metric. Checkpoints are dotted vertical lines and resumes
dashed ones, on every panel, at the step they happened. With one run each metric has its own
colour; with several, each run has its own colour and each metric its own line style.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.report.runs import Run, Series

__all__ = ["Panel", "Figure", "PALETTE", "CUDA_MEMORY", "panels_for", "draw_panels", "import_pyplot"]

# matplotlib's tab10, written out so that tests and captions can name the colours.
PALETTE = [
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
]
_LINE_STYLES = ["-", "--", ":", "-."]
_CHECKPOINT_COLOUR = "#555555"
_RESUME_COLOUR = "#d62728"
_FEW_POINTS = 25  # series this short (evaluations) get a dot per point


@dataclass(frozen=True)
class Panel:
    """A figure: its file stem, title, y label and the metrics on it (``scale`` multiplies values)."""

    stem: str
    title: str
    ylabel: str
    metrics: tuple[str, ...]
    scale: float = 1.0
    log_y: bool = False


@dataclass(frozen=True)
class Figure:
    """A drawn panel: the PNG written and what it shows."""

    panel: Panel
    path: Path
    png: bytes


def import_pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display); ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _is_loss(key: str) -> bool:
    """train/loss and every evaluation set's loss: eval/loss, eval/<label>/loss, <label>/loss."""
    return key.endswith("/loss")


# MemoryMonitor's CUDA series on the memory panel, in this order: what the caching allocator has
# handed out and what it holds from the driver, now and at their peaks. Its active and inactive
# series (and alloc_retries, a count) go to the page's table of other metrics; the process's RSS
# (on a CPU) is drawn as well.
CUDA_MEMORY = (
    "memory/current_allocated_mem",
    "memory/peak_allocated_mem",
    "memory/current_reserved_mem",
    "memory/peak_reserved_mem",
)
_TABLE_MEMORY = ("memory/alloc_retries", "_active_mem", "_inactive_mem")


def _memory(keys: list[str]) -> list[str]:
    others = [k for k in keys if k.startswith("memory/") and k not in CUDA_MEMORY and not k.endswith(_TABLE_MEMORY)]
    return [k for k in CUDA_MEMORY if k in keys] + others


# (stem, title, y label, selector over the metric names present, scale, log y)
_RULES: list[tuple[str, str, str, Callable[[list[str]], list[str]], float, bool]] = [
    # train/loss first (the first colour), then each evaluator's
    (
        "loss",
        "Loss",
        "loss",
        lambda keys: sorted((k for k in keys if _is_loss(k)), key=lambda k: (k != "train/loss", k)),
        1.0,
        False,
    ),
    (
        "learning_rate",
        "Learning rate",
        "learning rate",
        # the LR monitor's per-group names when there are any; train/lr repeats the first group
        lambda keys: [k for k in keys if k.startswith("lr-")] or [k for k in keys if k == "train/lr"],
        1.0,
        False,
    ),
    (
        "throughput",
        "Throughput",
        "samples / s",
        lambda keys: [k for k in keys if k == "throughput/samples_per_sec"],
        1.0,
        False,
    ),
    (
        "tokens",
        "Token throughput",
        "tokens / s",
        lambda keys: [k for k in keys if k == "throughput/tokens_per_sec"],
        1.0,
        False,
    ),
    (
        "flops",
        "Model FLOP/s (per device)",
        "TFLOP/s",  # or G, M, k: see _flops_unit
        lambda keys: [k for k in keys if k == "throughput/device/flops_per_sec"],
        1e-12,
        False,
    ),
    (
        "mfu",
        "Model FLOPs utilisation (MFU)",
        "MFU (%)",
        lambda keys: [k for k in keys if k == "throughput/mfu"],
        100.0,
        False,
    ),
    ("memory", "Memory", "GB", _memory, 1.0, False),
]


def panels_for(runs: Sequence[Run]) -> tuple[list[Panel], list[str]]:
    """The panels the runs' metrics fill, and the metrics no panel shows (listed in the report)."""
    keys = sorted({key for run in runs for key in run.series})
    panels: list[Panel] = []
    shown: set[str] = set()
    for stem, title, ylabel, select, scale, log_y in _RULES:
        chosen = select(keys)
        if chosen:
            if stem == "flops":
                ylabel, scale = _flops_unit(runs, chosen)
            panels.append(Panel(stem, title, ylabel, tuple(chosen), scale, log_y))
            shown.update(chosen)
    # One panel per evaluation metric name (their scales differ: accuracy, perplexity, ...), with
    # every evaluation set's values on it: eval/Accuracy, eval/val/Accuracy, test/Accuracy, ...
    sets = {key.rpartition("/")[0] for key in keys if _is_loss(key) and key != "train/loss"}
    by_metric: dict[str, list[str]] = {}
    for key in keys:
        head, _, metric = key.rpartition("/")
        if key not in shown and (head in sets or head == "eval" or head.startswith("eval/")):
            by_metric.setdefault(metric, []).append(key)
    for metric, chosen in sorted(by_metric.items()):
        panels.append(Panel(_stem(f"eval-{metric}"), f"{metric} (evaluation)", metric, tuple(chosen)))
        shown.update(chosen)
    shown.add("train/lr")  # the learning-rate panel shows it (or the same value per group)
    return panels, [key for key in keys if key not in shown]


def _flops_unit(runs: Sequence[Run], keys: list[str]) -> tuple[str, float]:
    """The largest unit (TFLOP/s down to FLOP/s) in which the largest value is at least 1."""
    peak = max(
        (abs(v) for run in runs for k in keys if k in run.series for v in run.series[k].finite_values), default=0
    )
    for prefix, factor in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if peak >= factor:
            return f"{prefix}FLOP/s", 1 / factor
    return "FLOP/s", 1.0


def _stem(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "metric"


def draw_panels(runs: Sequence[Run], panels: Sequence[Panel], out: Path, dpi: int = 110) -> list[Figure]:
    """Draw each panel to ``out/<stem>.png``; returns them in order."""
    plt = import_pyplot()
    figures = []
    for panel in panels:
        fig, ax = plt.subplots(figsize=(8.0, 3.8), dpi=dpi)
        try:
            _draw(ax, runs, panel)
            fig.tight_layout()
            path = out / f"{panel.stem}.png"
            fig.savefig(path, dpi=dpi, facecolor="white")
        finally:
            plt.close(fig)
        figures.append(Figure(panel, path, path.read_bytes()))
    return figures


def _draw(ax: Any, runs: Sequence[Run], panel: Panel) -> None:
    overlay = len(runs) > 1
    for r, run in enumerate(runs):
        for m, key in enumerate(panel.metrics):
            series = run.series.get(key)
            if series is None or not len(series):
                continue
            colour = PALETTE[r % len(PALETTE)] if overlay else PALETTE[m % len(PALETTE)]
            style = _LINE_STYLES[m % len(_LINE_STYLES)] if overlay else "-"
            label = f"{run.name}: {key}" if overlay else key
            # the panel's first metric on top: a later one with the same values (peak and current
            # memory) would hide it
            _plot_series(ax, series, panel.scale, colour, style, label, zorder=3 + len(panel.metrics) - m)
        _mark_events(ax, run, PALETTE[r % len(PALETTE)] if overlay else None, run.name if overlay else None)
    ax.set_title(panel.title, fontsize=12, fontweight="bold", loc="left")
    ax.set_xlabel("step (batches)")
    ax.set_ylabel(panel.ylabel)
    if panel.log_y:
        ax.set_yscale("log")
    ax.grid(True, color="#e5e5e5", linewidth=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_xlim(left=0)
    ax.legend(loc="best", fontsize=8, frameon=False)


def _plot_series(ax: Any, series: Series, scale: float, colour: str, style: str, label: str, zorder: float) -> None:
    values = [v * scale for v in series.values]
    few = len(series) <= _FEW_POINTS
    ax.plot(
        series.steps,
        values,
        linestyle=style,
        color=colour,
        linewidth=1.8,
        marker="o" if few else None,
        markersize=4,
        label=label,
        zorder=zorder,
    )


def _mark_events(ax: Any, run: Run, colour: str | None, name: str | None) -> None:
    """Checkpoints (dotted) and resumes (dashed) as vertical lines, each kind once in the legend."""
    prefix = f"{name}: " if name else ""
    for i, step in enumerate(run.checkpoints):
        ax.axvline(
            step,
            color=colour or _CHECKPOINT_COLOUR,
            linestyle=":",
            linewidth=1.2,
            alpha=0.8,
            label=f"{prefix}checkpoint" if i == 0 else None,
        )
    for i, step in enumerate(run.resumes):
        ax.axvline(
            step,
            color=colour or _RESUME_COLOUR,
            linestyle=(0, (6, 2, 1, 2)),  # dash-dot: apart from the metrics' dashed lines in an overlay
            linewidth=1.8,
            alpha=0.9,
            label=f"{prefix}resume" if i == 0 else None,
        )
        ax.annotate(
            f"{prefix}resumed",
            xy=(step, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(3, -3),
            textcoords="offset points",
            ha="left",
            va="top",
            fontsize=7,
            color=colour or _RESUME_COLOUR,
        )
