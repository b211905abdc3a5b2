"""``kiln report``: plots and an HTML page from a run's logs.

Reads the File logger's JSON lines (or TensorBoard event files) of one run, or of several to
overlay, and writes ``report.html`` (self-contained: figures embedded) and one PNG per figure.
matplotlib is needed to draw (``pip install 'kiln-train[report]'``); reading needs nothing extra
for JSON lines and ``tensorboard`` for event files.

Example::

    from kiln.report import write_report
    write_report(["runs/a", "runs/b"], "runs/compare")   # runs/compare/report.html, loss.png, ...
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from kiln.report.runs import Run, RunError, Series, find_logs, load_run

__all__ = ["Run", "RunError", "Series", "find_logs", "load_run", "write_report"]


def write_report(
    runs: Sequence[str | os.PathLike[str] | Run], out: str | os.PathLike[str], names: Sequence[str] | None = None
) -> Path:
    """Write ``out/report.html`` and ``out/<figure>.png`` for ``runs``; returns the HTML file's path.

    Every run is read (and matplotlib imported) before anything is written, so a run that cannot
    be read leaves ``out`` untouched.

    Args:
        runs: run folders (or ``.jsonl`` / event files, or loaded :class:`Run` objects); two or
            more are overlaid on the same axes.
        out: the folder to write into (created if missing).
        names: legend labels, one per run (default: each run's folder name, made unique).

    Raises:
        RunError: a run that does not exist or holds no metrics.
        ImportError: matplotlib (or, for event files, tensorboard) is not installed.
    """
    if not runs:
        raise RunError("no run given")
    if names is not None and len(names) != len(runs):
        raise ValueError(f"names has {len(names)} entries for {len(runs)} runs")
    loaded = [run if isinstance(run, Run) else load_run(run) for run in runs]
    _unique_names(loaded, names)
    from kiln import __version__
    from kiln.report.html import render_html
    from kiln.report.plots import draw_panels, import_pyplot, panels_for

    import_pyplot()  # before the folder is made: no matplotlib, nothing written
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    panels, unplotted = panels_for(loaded)
    unplotted = [key for key in unplotted if not key.startswith("goodput/")]  # the goodput section shows them
    figures = draw_panels(loaded, panels, folder)
    page = folder / "report.html"
    goodput = _goodput_section(loaded, folder)
    page.write_text(render_html(loaded, figures, unplotted, __version__, goodput), encoding="utf-8")
    return page


def _goodput_section(runs: list[Run], folder: Path) -> str:
    """Each run's goodput account (kiln.report.goodput): a table and a figure, one bar per launch."""
    import base64
    import html

    from kiln.report.goodput import draw_account, find_account, read_account, table_rows

    parts = []
    for i, run in enumerate(runs):
        path = find_account(run.path)
        launches = read_account(path) if path is not None else []
        if not launches:
            continue
        header, rows = table_rows(launches)
        # an SVG: the PNGs beside the page are the curves' figures, one per panel
        svg = folder / ("goodput.svg" if len(runs) == 1 else f"goodput-{i + 1}.svg")
        draw_account(launches, svg, run.name)
        cells = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        body = "".join(
            "<tr>" + "".join(f'<td class="num">{html.escape(c)}</td>' for c in row) + "</tr>" for row in rows
        )
        data = base64.b64encode(svg.read_bytes()).decode("ascii")
        parts.append(
            f"<h3>{html.escape(run.name)} ({html.escape(str(path))}), seconds</h3><table><tr>{cells}</tr>{body}</table>"
            f'<figure id="goodput-{i + 1}"><img alt="goodput" src="data:image/svg+xml;base64,{data}">'
            f"<figcaption>one bar per launch ({html.escape(svg.name)})</figcaption></figure>"
        )
    return "".join(parts)


def _unique_names(runs: list[Run], names: Sequence[str] | None) -> None:
    if names is not None:
        for run, name in zip(runs, names):
            run.name = name
        return
    seen: dict[str, int] = {}
    for run in runs:
        count = seen.get(run.name, 0)
        seen[run.name] = count + 1
        if count:
            run.name = f"{run.name} ({count + 1})"
