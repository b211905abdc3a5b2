"""``kiln plan --dry-run``: a run file's real build path on a fake world, each rank's bytes held and
moved (:mod:`kiln.planning.dry_run`); ``kiln train --dry-run`` and ``kiln plan --search --confirm``
print the same report."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Any

__all__ = ["dry_run_command", "dry_run_subcommand"]


def dry_run_subcommand(args: argparse.Namespace, extra: list[str]) -> int:
    """``kiln plan --dry-run -f RUN.yaml [overrides]``: read the run file, then :func:`dry_run_command`."""
    from kiln.config.args import load_trainer_args
    from kiln.config.overrides import ConfigError

    refused = [
        flag
        for flag, given in (
            ("--model", args.model),
            ("--optimizer", args.optimizer),
            ("--budget", args.budget),
            ("--input-shape", args.input_shape),
            ("--activation-checkpointing", args.activation_checkpointing),
        )
        if given is not None
    ]
    if not args.dry_run:
        refused = ["--json (it prints the --dry-run report)"]
    if args.file is None or refused:
        print(
            f"kiln plan: --dry-run runs a run file: pass -f run.yaml (and dotted overrides), without "
            f"{', '.join(refused) or '--model'}",
            file=sys.stderr,
        )
        return 2
    if args.world_size is not None and args.world_size < 1:
        print(f"kiln plan: --world-size={args.world_size} must be >= 1", file=sys.stderr)
        return 2
    if os.getcwd() not in sys.path:  # components resolve from the working directory, as kiln train's do
        sys.path.insert(0, os.getcwd())
    try:
        trainer_args = load_trainer_args(args.file, extra, world_size=args.world_size)
    except ConfigError as exc:
        print(f"kiln plan: error: {exc}", file=sys.stderr)
        return 2
    return dry_run_command(trainer_args, args.world_size, as_json=args.json, prog="kiln plan")


def dry_run_command(
    trainer_args: Any, world_size: int | None, *, as_json: bool = False, prog: str = "kiln plan"
) -> int:
    """Dry-run a resolved run (:func:`kiln.planning.dry_run.dry_run`) on ``world_size`` ranks (None:
    the run's ``compute_config.runtime_ngpus``, else 1) and print its report: text, or one JSON
    object. A configuration error prints the real run's one line and returns 2."""
    import json

    from kiln.planning.dry_run import dry_run

    world = world_size or trainer_args.compute_config.runtime_ngpus or 1
    try:
        report = dry_run(trainer_args, world)
    except (ValueError, TypeError) as exc:  # ConfigError is a ValueError; so are the strategies' checks
        if os.environ.get("KILN_DEBUG") == "1":
            traceback.print_exception(exc)
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=None) if as_json else report.format())
    return 0
