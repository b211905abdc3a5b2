"""The report page: one self-contained HTML file (figures embedded as PNG data URIs, inline CSS)."""

from __future__ import annotations

import base64
import datetime
import html
import math
from collections.abc import Sequence

from kiln.report.plots import PALETTE, Figure
from kiln.report.runs import Run

__all__ = ["render_html"]

_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 0; color: #222;
       background: #f6f7f9; }
header { background: #2b2d42; color: #fff; padding: 18px 32px; }
header h1 { margin: 0; font-size: 22px; }
header p { margin: 4px 0 0; color: #c9cbd6; font-size: 13px; }
main { padding: 20px 32px 40px; }
h2 { font-size: 16px; margin: 24px 0 10px; }
table { border-collapse: collapse; background: #fff; font-size: 13px; }
th, td { border: 1px solid #dde; padding: 5px 10px; text-align: left; vertical-align: top; }
th { background: #eef0f4; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.swatch { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin-right: 6px; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 16px; }
figure { margin: 0; background: #fff; border: 1px solid #dde; border-radius: 6px; padding: 8px; }
figure img { width: 100%; height: auto; display: block; }
figcaption { font-size: 12px; color: #555; padding: 4px 6px 0; }
.note { font-size: 12px; color: #666; }
"""


def render_html(
    runs: Sequence[Run], figures: Sequence[Figure], unplotted: Sequence[str], version: str, goodput: str = ""
) -> str:
    """The page for ``runs``: a summary table, the goodput accounts (``goodput``: their HTML, if
    any), the figures, and the metrics no figure shows."""
    names = ", ".join(run.name for run in runs)
    title = f"kiln report: {names}" if len(runs) == 1 else f"kiln report: {names} (overlay)"
    made = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_e(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<header><h1>{_e(title)}</h1><p>made by kiln {_e(version)} on {made}; x axes: training step "
        "(batches); dotted lines: checkpoints saved, dash-dotted lines: resumes from a checkpoint</p></header>",
        "<main>",
        "<h2>Runs</h2>",
        _summary(runs),
        *(["<h2>Goodput</h2>", goodput] if goodput else []),
        "<h2>Curves</h2>",
        '<div class="grid">',
    ]
    for figure in figures:
        data = base64.b64encode(figure.png).decode("ascii")
        caption = ", ".join(figure.panel.metrics)
        parts.append(
            f'<figure id="{_e(figure.panel.stem)}"><img alt="{_e(figure.panel.title)}" '
            f'src="data:image/png;base64,{data}"><figcaption>{_e(caption)} '
            f"({_e(figure.path.name)})</figcaption></figure>"
        )
    parts.append("</div>")
    if unplotted:
        parts += ["<h2>Other metrics</h2>", _other_metrics(runs, unplotted)]
    parts += ["</main></body></html>", ""]
    return "\n".join(parts)


def _summary(runs: Sequence[Run]) -> str:
    header = (
        "<tr><th>run</th><th>logs</th><th>last step</th><th>last train/loss</th><th>best eval/loss</th>"
        "<th>peak memory (GB)</th><th>checkpoints at step</th><th>resumes at step</th></tr>"
    )
    rows = []
    for i, run in enumerate(runs):
        swatch = f'<span class="swatch" style="background:{PALETTE[i % len(PALETTE)]}"></span>' if len(runs) > 1 else ""
        files = "<br>".join(_e(str(f)) for f in run.files[:4]) + (" ..." if len(run.files) > 4 else "")
        source = "File logger" if run.source == "jsonl" else "TensorBoard"
        skipped = (
            f'<br><span class="note">{run.num_skipped_lines} unreadable lines skipped</span>'
            if run.num_skipped_lines
            else ""
        )
        train = run.series.get("train/loss")
        evals = run.series.get("eval/loss")
        rows.append(
            "<tr>"
            f"<td>{swatch}{_e(run.name)}</td>"
            f"<td>{source}:<br>{files}{skipped}</td>"
            f'<td class="num">{_number(run.last_step)}</td>'
            f'<td class="num">{_number(train.last) if train else "-"}</td>'
            f'<td class="num">{_number(min(evals.finite_values)) if evals and evals.finite_values else "-"}</td>'
            f"<td>{_peak_memory(run)}</td>"
            f"<td>{_steps(run.checkpoints)}</td>"
            f"<td>{_steps(run.resumes)}</td>"
            "</tr>"
        )
    return f"<table>{header}{''.join(rows)}</table>"


# MemoryMonitor's peaks: the CUDA allocator's (allocated, reserved), or the process's RSS on a CPU
_PEAK_MEMORY = (
    ("memory/peak_allocated_mem", "allocated"),
    ("memory/peak_reserved_mem", "reserved"),
    ("memory/peak_rss_mem", "RSS"),
)


def _peak_memory(run: Run) -> str:
    """The highest peak of each kind the run logged, e.g. ``allocated 31.2, reserved 36``."""
    peaks = []
    for key, label in _PEAK_MEMORY:
        series = run.series.get(key)
        if series is not None and series.finite_values:
            peaks.append(f"{label} {_number(max(series.finite_values))}")
    return ", ".join(peaks) or "-"


def _other_metrics(runs: Sequence[Run], keys: Sequence[str]) -> str:
    header = "<tr><th>metric</th>" + "".join(
        f"<th>{_e(run.name)}: last</th><th>min</th><th>max</th><th>points</th>" for run in runs
    )
    rows = []
    for key in keys:
        cells = [f"<td>{_e(key)}</td>"]
        for run in runs:
            series = run.series.get(key)
            finite = series.finite_values if series else []
            if series and finite:
                cells += [
                    f'<td class="num">{_number(series.last)}</td>',
                    f'<td class="num">{_number(min(finite))}</td>',
                    f'<td class="num">{_number(max(finite))}</td>',
                    f'<td class="num">{len(series)}</td>',
                ]
            else:
                cells += ["<td>-</td>"] * 4
        rows.append(f"<tr>{''.join(cells)}</tr>")
    return f"<table>{header}</tr>{''.join(rows)}</table>"


def _steps(steps: Sequence[float]) -> str:
    if not steps:
        return "-"
    shown = ", ".join(_number(s) for s in steps[:12])
    return shown + (f" ... ({len(steps)} in all)" if len(steps) > 12 else "")


def _number(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.5g}"


def _e(text: str) -> str:
    return html.escape(text, quote=True)
