"""``--then``: several runs of one worker script in one process and process group.

A process start (torch's import, DDP's first construction) costs more CPU than the small runs the
resume tests make, so a reference run and the runs that finish ride in the launch of a run that
dies, before it: ``worker.py ARGS --then ARGS --then ARGS --die-after 3``.
"""

from __future__ import annotations

import argparse


def split_runs(parser: argparse.ArgumentParser, argv: list[str], *ending: str) -> list[argparse.Namespace]:
    """The runs of ``argv`` (separated by ``--then``), each parsed by ``parser``. Only the last run may
    set one of the options ``ending`` names (destinations, such as ``die_after``): they end the
    process, so nothing after them would run."""
    runs, current = [], []
    for arg in [*argv, "--then"]:
        if arg == "--then":
            runs.append(parser.parse_args(current))
            current = []
        else:
            current.append(arg)
    if any(getattr(run, name) for run in runs[:-1] for name in ending):
        flags = " or ".join("--" + name.replace("_", "-") for name in ending)
        parser.error(f"only the last run may {flags} (it ends the process)")
    return runs
