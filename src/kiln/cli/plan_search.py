"""``kiln plan --search``: the plans of a transformer on a world of devices, cheapest first.

    kiln plan --search -f run.yaml --world-size 256 --device h100 --memory 80GiB [--global-batch 512]
    kiln plan --search --model mypkg.models:make_llama --world-size 8 --seq-len 8192 --global-batch 16 --json
    kiln plan --search -f run.yaml --world-size 8 --confirm [N]  # the first N plans dry-run, then ranked

The model is built on the meta device (no weights) and priced by :mod:`kiln.planning.search`, whose
constants are :mod:`kiln.cost.devices`'s. ``--confirm`` dry-runs the first plans (3, or N) with the
run file and each plan's overrides, and ranks them by what the dry run measured
(:mod:`kiln.planning.confirm`); the table's ``by`` column says which plans were measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

__all__ = ["add_search_arguments", "search_command"]


def add_search_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``kiln plan --search`` (``--world-size``, ``--json``, ``-f``, ``--model`` are plan's own)."""
    p.add_argument(
        "--search",
        action="store_true",
        help="list the feasible (dp_shard, tp, pp, checkpointing, microbatch) plans of a transformer, cheapest first",
    )
    p.add_argument("--device", default="h100", help="with --search: the device class (a100, h100, h200, b200, ...)")
    p.add_argument("--memory", default=None, help="with --search: bytes per rank, e.g. 80GiB (default: the device's)")
    p.add_argument("--global-batch", "--global_batch", dest="global_batch", type=int, default=None,
                   help="with --search: sequences per optimizer step (default: the run file's global_batch_size, "
                   "else micro_batch_size x --world-size)")  # fmt: skip
    p.add_argument("--seq-len", "--seq_len", dest="seq_len", type=int, default=None,
                   help="with --search: tokens per sequence (default: the run file's first microbatch)")  # fmt: skip
    p.add_argument("--top", type=int, default=10, help="with --search: plans to print (default 10)")
    p.add_argument("--confirm", nargs="?", type=int, const=3, default=None, metavar="N",
                   help="with --search -f: dry-run the first N plans (default 3) and rank them by what "
                   "the dry runs measure")  # fmt: skip


def _fail(message: str) -> int:
    print(f"kiln plan: error: {message}", file=sys.stderr)
    return 2


def search_command(args: argparse.Namespace, extra: list[str]) -> int:
    """Run ``kiln plan --search``; 0, or 2 with one line on bad input."""
    import torch

    from kiln.cost.devices import device_class
    from kiln.cost.memory import optimizer_state_factor
    from kiln.planning.search import ModelShape, format_plans, parse_bytes, search

    if (args.file is None) == (args.model is None):
        return _fail("--search plans a model: pass -f run.yaml, or --model package.module:Name")
    if extra and args.file is None:
        return _fail(f"unrecognized arguments: {' '.join(extra)} (dotted overrides need -f)")
    if args.dry_run:
        return _fail("--search and --dry-run are two commands: --search --confirm dry-runs the first plans")
    if args.confirm is not None and args.file is None:
        return _fail("--confirm dry-runs a run file with the first plans: pass -f run.yaml")
    if args.confirm is not None and args.confirm < 1:
        return _fail(f"--confirm={args.confirm} must be >= 1")
    if args.top < 1:
        return _fail(f"--top={args.top} must be >= 1")
    if os.getcwd() not in sys.path:  # components resolve from the working directory, as kiln train's do
        sys.path.insert(0, os.getcwd())
    try:
        device = device_class(args.device)
        budget = parse_bytes(args.memory) if args.memory is not None else None
        if budget is None and device.memory is None:
            return _fail(f"--device {device.name} has no fixed memory: pass --memory (e.g. --memory 16GiB)")
        trainer_args, precision, optimizer = None, "amp_bf16", "torch.optim.AdamW"
        world = args.world_size
        if args.file is not None:
            from kiln.config.args import load_trainer_args
            from kiln.config.trainer_builder import build_model

            trainer_args = load_trainer_args(args.file, extra, world_size=world)
            world = world or trainer_args.compute_config.runtime_ngpus
            with torch.device("meta"):
                model = build_model(trainer_args)
            precision = trainer_args.precision if isinstance(trainer_args.precision, str) else precision
            optimizer = trainer_args.optimizer.type or optimizer
        else:
            from kiln.cli.dotted import load_object

            with torch.device("meta"):
                model = load_object(args.model)()
        if not world or world < 1:
            return _fail(f"--world-size={world} must be >= 1 (the run file sets no compute_config.runtime_ngpus)")
        shape = ModelShape.from_model(model)
        seq_len = args.seq_len or _seq_len(trainer_args)
        if not seq_len:
            return _fail("--search needs the sequence length: pass --seq-len (the run file has no dataset to read it)")
        global_batch = args.global_batch or _global_batch(args.file, trainer_args, world)
        from kiln.config.build import import_type

        factor = optimizer_state_factor(import_type(optimizer, "optimizer.type"))
        result = search(
            shape,
            world,
            device,
            budget=budget,
            global_batch=global_batch,
            seq_len=seq_len,
            precision=precision or "fp32",
            optimizer_factor=factor,
        )
        if args.confirm is not None and result.plans:
            from kiln.planning.confirm import confirm, dry_run_measure

            print(f"dry-running the first {args.confirm} plans ...", file=sys.stderr)
            confirm(result, dry_run_measure(args.file, extra, world), top=args.confirm)
    except (ValueError, TypeError, AttributeError) as exc:  # ConfigError is a ValueError
        return _fail(str(exc))
    print(json.dumps(result.to_dict(args.top)) if args.json else format_plans(result, args.top, args.file))
    return 0


def _seq_len(trainer_args: Any) -> int | None:
    # the last dimension of the run's first microbatch's token ids
    if trainer_args is None or trainer_args.dataset.type is None:
        return None
    from kiln.planning.dry_run import first_microbatch

    batch = first_microbatch(trainer_args)
    if isinstance(batch, dict):
        batch = batch.get("input_ids", next(iter(batch.values())))
    elif isinstance(batch, (tuple, list)):
        batch = batch[0]
    return int(batch.shape[-1]) if hasattr(batch, "shape") and batch.dim() >= 1 else None


def _global_batch(path: str | None, trainer_args: Any, world: int) -> int:
    # the run file's global_batch_size as written (the resolved one follows the file's own mesh, which
    # the search replaces), else one microbatch on every rank
    if path is not None and str(path).endswith((".yaml", ".yml")):
        from kiln.config.overrides import load_yaml

        written = load_yaml(path).get("global_batch_size")
        if written:
            return int(written)
    micro = trainer_args.micro_batch_size if trainer_args is not None else 1
    return int(micro) * world
