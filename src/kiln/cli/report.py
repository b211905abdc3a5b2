"""`kiln report RUN [RUN_B ...] [--out DIR]`: report.html and PNGs from runs' logs.

Exits 0 after writing, and 2 with one line (nothing written) when a run cannot be read or
matplotlib is missing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_parser"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "report",
        help="plot a run's logs (or overlay several) into report.html and PNGs",
        description="Read each RUN's logs (the File logger's *.jsonl files under it, else TensorBoard "
        "event files) and write report.html (self-contained) and one PNG per figure: loss, learning "
        "rate, throughput and MFU, memory and evaluation metrics, with checkpoints and resumes marked. "
        "Several runs are overlaid on the same axes. A run's goodput account (goodput.json under RUN) "
        "is printed as a table (seconds per segment, one row per launch) and drawn as goodput.svg.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="a run folder (or a .jsonl / event file)")
    p.add_argument(
        "--out",
        metavar="DIR",
        default=None,
        help="folder to write into (default: RUN/report for the first RUN, or beside a RUN file)",
    )
    p.add_argument("--name", action="append", default=None, help="legend label of each RUN, in order (repeat)")
    p.set_defaults(func=_report)


def _report(args: argparse.Namespace) -> int:
    from kiln.report import RunError, write_report

    first = Path(args.runs[0])
    out = Path(args.out) if args.out else (first if first.is_dir() else first.parent) / "report"
    if args.name is not None and len(args.name) != len(args.runs):
        print(f"kiln report: {len(args.name)} --name for {len(args.runs)} runs; give one per RUN", file=sys.stderr)
        return 2
    try:
        page = write_report(args.runs, out, names=args.name)
    except RunError as exc:
        print(f"kiln report: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        missing = getattr(exc, "name", None) or ""
        if missing.split(".")[0] == "matplotlib":
            print("kiln report needs matplotlib: pip install 'kiln-train[report]'", file=sys.stderr)
        else:
            print(f"kiln report: {exc}", file=sys.stderr)
        return 2
    from kiln.report.goodput import find_account, format_table, read_account

    for run in args.runs:  # each run's goodput account, as a table (seconds)
        account = find_account(run)
        launches = read_account(account) if account is not None else []
        if launches:
            if len(args.runs) > 1:
                print(f"{run}:")
            print(format_table(launches))
    print(page)
    return 0
