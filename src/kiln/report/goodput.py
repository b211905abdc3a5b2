"""The goodput account of a run: where its wall time went, across all its launches and resumes.

The Trainer's :class:`kiln.trainer.goodput.GoodputMonitor` keeps it (rank 0 writes it); ``kiln
report`` draws it and ``kiln run`` prints its last line. This module holds the account's file,
the rule that folds a failed launch's time into lost work, and the table, line and figure; it
imports nothing of the loop, so the CLI and the report read it without torch.

Segments (each launch's add up to its wall time):

* ``starting``: from the process's start to the end of the launch's first step (imports, the
  model, the strategy, loading a checkpoint, the first fetch, forward, backward and step);
* ``recovery`` (instead of ``starting`` after a failure): from the failed launch's last record to
  the end of this launch's first step: the failure's detection, the restart, the rendezvous, the
  process's start, the checkpoint's load and the first step;
* ``productive``: training steps whose result the run kept (a step's work after its batch arrived);
* ``eval``: evaluation inside ``fit()``;
* ``checkpoint``: time the loop waited on the checkpoint saver (a save's stall);
* ``data``: time a step waited on its batch (the loader's ``next``);
* ``lost``: everything a failed launch did after the checkpoint the next launch resumed from
  (steps computed and then redone, their data waits, evaluations and saves).

The file (``<save_folder>.goodput.json`` beside the save folder, else ``<log>.goodput.json`` beside
a File logger's file) is JSON: ``{"version": 1, "launches": [...]}``, each launch with ``begin``/``end`` (Unix
seconds), ``ended`` (``fit()`` reached its end), ``first_step``/``last_step``, ``world_size``,
``seconds`` (per segment), ``lost_steps`` and ``commits`` (the segments when each checkpoint was
committed, to split a failed launch at the one resumed from).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "SEGMENTS",
    "ACCOUNT_NAME",
    "POINTER_ENV",
    "new_launch",
    "read_account",
    "write_account",
    "find_account",
    "fold_failure",
    "totals",
    "fraction",
    "summary_line",
    "format_table",
    "draw_account",
]

SEGMENTS = ("starting", "recovery", "productive", "eval", "checkpoint", "data", "lost")
"""The segments of a launch's wall time, in the order tables and bars show them."""

ACCOUNT_NAME = "goodput.json"
"""The account's file name ends so: ``<save_folder>.goodput.json``, ``<log>.goodput.json``."""

POINTER_ENV = "KILN_GOODPUT_POINTER"
"""Set by ``kiln run``: a file into which rank 0 writes the path of its account, for the end-of-run line."""

_COLOURS = {
    "starting": "#8d99ae",
    "recovery": "#d62728",
    "productive": "#2ca02c",
    "eval": "#1f77b4",
    "checkpoint": "#ff7f0e",
    "data": "#9467bd",
    "lost": "#7f0000",
}


def new_launch(begin: float, first_step: int, world_size: int) -> dict[str, Any]:
    """A launch's record before its first step."""
    return {
        "begin": begin,
        "end": begin,
        "ended": False,
        "first_step": first_step,
        "last_step": first_step,
        "world_size": world_size,
        "seconds": dict.fromkeys(SEGMENTS, 0.0),
        "lost_steps": 0,
        "commits": [],
    }


def read_account(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The launches recorded in ``path`` (``[]`` when it is missing or unreadable: a new account)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    launches = data.get("launches") if isinstance(data, dict) else None
    return [x for x in launches if isinstance(x, dict) and isinstance(x.get("seconds"), dict)] if launches else []


def write_account(path: str | os.PathLike[str], launches: Sequence[Mapping[str, Any]]) -> None:
    """Write the account atomically (a temporary file renamed over it: a reader sees one whole version)."""
    target = Path(path)
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"version": 1, "launches": list(launches)}, f)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def find_account(path: str | os.PathLike[str]) -> Path | None:
    """The account of a run: the newest ``*goodput.json`` under its folder (or beside a log file),
    or beside the folder when it is the save folder itself; None when there is none."""
    root = Path(path)
    if root.is_file():
        root = root.parent
    if not root.is_dir():
        return None
    found = [p for p in root.rglob(f"*{ACCOUNT_NAME}") if p.is_file() and not p.name.startswith(".")]
    beside = root.parent / f"{root.name}.{ACCOUNT_NAME}"
    found += [beside] if beside.is_file() else []
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def fold_failure(launches: list[dict[str, Any]], resume_step: int) -> bool:
    """A new launch resumes at ``resume_step``: when the last launch failed (did not reach the end
    of ``fit()``), its time after the checkpoint resumed from becomes ``lost`` and its steps after
    it ``lost_steps``. Returns whether it failed (the new launch's first segment is then recovery).

    The lost steps are ``last_step - resume_step``: the steps the failed launch had recorded past
    the checkpoint the run went on from (so a damaged newest checkpoint skipped by autoresume
    counts the steps since the older one); a run that goes on from the failed launch's last recorded
    step or later (a torchft replica group healed from a live group) lost none of its time."""
    if not launches or launches[-1].get("ended", True):
        return False
    failed = launches[-1]
    seconds = failed["seconds"]
    wall = sum(seconds.values())
    commit = next((c for c in reversed(failed.get("commits", [])) if c.get("step") == resume_step), None)
    if commit is not None:
        kept = {k: float(commit["seconds"].get(k, 0.0)) for k in SEGMENTS}
    elif resume_step >= int(failed.get("last_step", resume_step)):
        # the run goes on from past every step it recorded (a torchft group that heals from a live
        # group, which kept the steps this one committed; a checkpoint newer than its last record):
        # nothing it did is redone
        kept = {k: float(seconds[k]) for k in SEGMENTS}
    else:  # the checkpoint came from an earlier launch: all it did after its first step is redone
        kept = {k: (seconds[k] if k in ("starting", "recovery") else 0.0) for k in SEGMENTS}
    kept["lost"] = max(0.0, wall - sum(kept.values()))
    failed["seconds"] = kept
    failed["lost_steps"] = max(0, int(failed.get("last_step", resume_step)) - resume_step)
    failed["commits"] = []
    return True


def totals(launches: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Seconds per segment over all launches."""
    return {k: sum(float(x["seconds"].get(k, 0.0)) for x in launches) for k in SEGMENTS}


def fraction(launches: Sequence[Mapping[str, Any]]) -> float:
    """The run's goodput: productive seconds over all seconds (0 before any)."""
    sums = totals(launches)
    wall = sum(sums.values())
    return sums["productive"] / wall if wall > 0 else 0.0


def _failures(launches: Sequence[Mapping[str, Any]]) -> list[int]:
    """Steps lost at each failure, in order (a launch followed by a recovery failed)."""
    return [int(x.get("lost_steps", 0)) for x, after in zip(launches, launches[1:]) if after["seconds"]["recovery"] > 0]


def summary_line(launches: Sequence[Mapping[str, Any]], where: str | os.PathLike[str] | None = None) -> str:
    """One line: ``goodput 81.2% of 14.3 s over 2 launches: productive 11.6 s, ... (path)``."""
    sums = totals(launches)
    wall = sum(sums.values())
    parts = [f"{k} {sums[k]:.1f} s" for k in SEGMENTS if sums[k] > 0 or k == "productive"]
    failures = _failures(launches)
    lost = f"; steps lost per failure: {', '.join(map(str, failures))}" if failures else ""
    count = f"{len(launches)} launch" + ("es" if len(launches) != 1 else "")
    tail = f" ({where})" if where is not None else ""
    return f"goodput {100 * fraction(launches):.1f}% of {wall:.1f} s over {count}: {', '.join(parts)}{lost}{tail}"


def table_rows(launches: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The table's header and rows (one per launch, then ``all``), as text cells."""
    header = ["launch", "steps", *SEGMENTS, "wall", "lost steps"]
    rows = []
    for i, x in enumerate(launches, 1):
        seconds = x["seconds"]
        rows.append(
            [str(i), f"{x.get('first_step', 0)}-{x.get('last_step', 0)}"]
            + [f"{seconds.get(k, 0.0):.2f}" for k in SEGMENTS]
            + [f"{sum(seconds.values()):.2f}", str(x.get("lost_steps", 0))]
        )
    sums = totals(launches)
    rows.append(
        ["all", ""]
        + [f"{sums[k]:.2f}" for k in SEGMENTS]
        + [f"{sum(sums.values()):.2f}", str(sum(int(x.get("lost_steps", 0)) for x in launches))]
    )
    return header, rows


def format_table(launches: Sequence[Mapping[str, Any]]) -> str:
    """The account as a text table (seconds), then the goodput and the steps lost per failure."""
    header, rows = table_rows(launches)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [header, *rows]]
    failures = _failures(launches)
    lines.append(
        f"goodput {100 * fraction(launches):.1f}% (productive / wall); steps lost per failure: "
        + (", ".join(map(str, failures)) if failures else "none")
    )
    return "\n".join(lines)


def draw_account(launches: Sequence[Mapping[str, Any]], path: Path, title: str, dpi: int = 110) -> None:
    """One bar per launch, its segments stacked (seconds), to ``path`` (an SVG)."""
    from kiln.report.plots import import_pyplot

    plt = import_pyplot()
    fig, ax = plt.subplots(figsize=(8.0, 1.2 + 0.5 * len(launches)), dpi=dpi)
    try:
        labels = [
            f"launch {i} (steps {x.get('first_step', 0)}-{x.get('last_step', 0)})" for i, x in enumerate(launches, 1)
        ]
        positions = list(range(len(launches)))
        left = [0.0] * len(launches)
        for k in SEGMENTS:
            widths = [float(x["seconds"].get(k, 0.0)) for x in launches]
            if any(widths):
                ax.barh(positions, widths, left=left, color=_COLOURS[k], label=k, height=0.6)
                left = [a + b for a, b in zip(left, widths)]
        ax.set_yticks(positions, labels)
        ax.invert_yaxis()
        ax.set_xlabel("seconds")
        ax.set_title(f"{title}: goodput {100 * fraction(launches):.1f}%", fontsize=12, fontweight="bold", loc="left")
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        ax.legend(
            loc="upper center",
            bbox_to_anchor=(0.5, -0.3 if len(launches) < 3 else -0.15),
            ncol=7,
            fontsize=8,
            frameon=False,
        )
        fig.tight_layout()
        fig.set_facecolor("white")
        # the SVG canvas itself: the page's curve figures are the ones Figure.savefig writes
        from matplotlib.backends.backend_svg import FigureCanvasSVG

        FigureCanvasSVG(fig).print_svg(str(path))
    finally:
        plt.close(fig)
