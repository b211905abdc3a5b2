"""`kiln plan`: what ``strategy="auto"`` would choose, with the memory per rank of every candidate.

    kiln plan --model mypkg.models:make_model --world-size 8 --optimizer torch.optim.AdamW
    kiln plan --model mypkg.models:GPT --world-size 4 --budget 40e9 --input-shape 8,1024 --input-dtype long

    kiln plan -f run.yaml --world-size 4 [--dotted.key value ...]

The model is built on the CPU and never trained. Activations are measured with one forward and
backward on fake tensors (no memory, no compute): of a ``--input-shape`` input, or with ``-f`` of
one microbatch (``micro_batch_size`` samples) of the run file's training dataset. With
``--activation-checkpointing`` they are measured with it; without, the table also shows each
strategy with every block checkpointed (``+ckpt``), which ``auto`` picks when nothing else fits.
With ``-f`` the run file is read and checked as ``kiln train`` reads it, and its model and
optimizer are planned; :func:`kiln.cost.memory.plan_table` does the work.

    kiln plan -f run.yaml --world-size 512 --dry-run [--json] [--dotted.key value ...]

``--dry-run`` runs the run itself instead of estimating it: its setup (mesh, every parallelize
step, the optimizer) and one training step, as the first rank of each pipeline stage of a world of
``--world-size``, in this process, on torch's fake process group and fake tensors; it prints what
each of those ranks holds and moves (:mod:`kiln.planning.dry_run`), or with ``--json`` the same
report as one JSON object. A configuration error is the real run's one line, with status 2.

    kiln plan -f run.yaml --world-size 256 --search --device h100 --memory 80GiB [--json] [--confirm [N]]

``--search`` lists the feasible (dp_shard, tp, pp, checkpointing, microbatch) plans of a transformer,
cheapest first by an explicit cost model (:mod:`kiln.cli.plan_search`, :mod:`kiln.planning.search`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kiln.cli.dotted import load_object
from kiln.cli.plan_dry_run import dry_run_subcommand
from kiln.cli.plan_search import add_search_arguments, search_command

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="show the memory per rank of each parallel strategy and what auto picks",
        description="Estimate parameters, gradients, optimizer state and activations per rank "
        "for every strategy, and show which one strategy='auto' would choose.",
    )
    p.add_argument(
        "-f",
        "--file",
        default=None,
        help="a run file (as for kiln train; dotted overrides may follow): its model and optimizer",
    )
    p.add_argument(
        "--model",
        default=None,
        help="dotted path of a model class or factory: 'package.module:Name' or 'package.module.Name'",
    )
    p.add_argument(
        "--world-size",
        "--world_size",
        dest="world_size",
        type=int,
        default=None,
        help="ranks of the run (default: the run file's compute_config.runtime_ngpus, else 1)",
    )
    p.add_argument(
        "--optimizer", default=None, help="optimizer class (state size; default: the run file's, else AdamW)"
    )
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help="bytes per rank (default: $KILN_MEMORY_BUDGET_BYTES, else the device's free memory)",
    )
    p.add_argument(
        "--input-shape",
        dest="input_shape",
        default=None,
        help="shape of one microbatch, e.g. 8,1024, to measure activations with one forward",
    )
    p.add_argument(
        "--input-dtype", dest="input_dtype", default="float32", help="dtype of that input (float32, long, ...)"
    )
    p.add_argument(
        "--activation-checkpointing",
        dest="activation_checkpointing",
        default=None,
        help="the run's checkpointing ('full', 'selective', 'selective:N'): activations are measured with it",
    )
    p.add_argument(
        "--dry-run",
        "--dry_run",
        dest="dry_run",
        action="store_true",
        help="with -f: run the run's setup and one training step as each pipeline stage's first rank of "
        "--world-size ranks, on a fake process group and fake tensors, and report what each holds and moves",
    )
    p.add_argument("--json", action="store_true", help="with --dry-run or --search: print one JSON object")
    add_search_arguments(p)
    p.set_defaults(func=run, accepts_extra=True)


def _from_run_file(path: str, overrides: list[str], world_size: int | None) -> tuple[Any, str, int, Any]:
    # the config CLI's own reading and model building, so the plan sees the model `kiln train` would
    from kiln.config.args import load_trainer_args
    from kiln.config.trainer_builder import build_model

    if world_size is None and str(path).endswith((".yaml", ".yml")):
        from kiln.config.overrides import load_yaml

        world_size = (load_yaml(path).get("compute_config") or {}).get("runtime_ngpus")
    world_size = world_size or 1
    trainer_args = load_trainer_args(path, overrides, world_size=world_size)
    optimizer = trainer_args.optimizer.type
    assert optimizer is not None  # TrainerArgs requires optimizer.type
    model = build_model(trainer_args)
    return model, optimizer, world_size, _example_microbatch(trainer_args, model)


def _example_microbatch(trainer_args: Any, model: Any) -> Any:
    """One microbatch of the run's training data as the model's forward takes it (a kiln.Model
    gets the batch; a module trained with a criterion the batch's inputs); None without a dataset."""
    from torch.utils.data import default_collate

    from kiln.config.build import build_value, import_type
    from kiln.core.model import Model

    data = trainer_args.dataset
    if data is None or data.type is None:
        return None
    dataset = import_type(data.type, "dataset.type")(**build_value(data.train_args, "dataset.train_args"))
    loader_args = build_value(trainer_args.dataloader.train_args, "dataloader.train_args")
    collate = loader_args.get("collate_fn") or default_collate
    if isinstance(collate, str):
        collate = import_type(collate, "dataloader.train_args.collate_fn")
    batch = collate([dataset[i] for i in range(min(trainer_args.micro_batch_size, len(dataset)))])
    if isinstance(model, Model):
        return batch
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def run(args: argparse.Namespace) -> int:
    import torch

    from kiln.cost.memory import activation_summary, format_table, plan_table

    extra = list(getattr(args, "extra", []) or [])
    if args.search:
        return search_command(args, extra)
    if args.dry_run or args.json:
        return dry_run_subcommand(args, extra)
    if (args.file is None) == (args.model is None):
        print(
            "kiln plan: pass -f run.yaml, or --model package.module:Name (a model class or a function returning one)",
            file=sys.stderr,
        )
        return 2
    if extra and args.file is None:
        print(f"kiln plan: unrecognized arguments: {' '.join(extra)} (dotted overrides need -f)", file=sys.stderr)
        return 2
    if args.world_size is not None and args.world_size < 1:
        print(f"kiln plan: --world-size={args.world_size} must be >= 1", file=sys.stderr)
        return 2
    try:
        example = None
        if args.file is not None:
            model, optimizer, world, example = _from_run_file(args.file, extra, args.world_size)
        else:
            model, optimizer, world = load_object(args.model)(), "torch.optim.AdamW", args.world_size or 1
        optimizer = load_object(args.optimizer or optimizer)
        if args.input_shape:
            shape = tuple(int(s) for s in args.input_shape.replace("x", ",").split(",") if s)
            dtype = getattr(torch, args.input_dtype)
            example = (
                torch.zeros(shape, dtype=dtype) if not dtype.is_floating_point else torch.randn(shape, dtype=dtype)
            )
        ac = args.activation_checkpointing
        if ac is not None:
            from kiln.cost.activations import checkpointed_modules

            checkpointed_modules(model, ac)  # a mode that names nothing fails here, with the fix
        rows = plan_table(model, optimizer, world, args.budget, example, activation_checkpointing=ac)
    except (ValueError, AttributeError, TypeError) as exc:  # ConfigError is a ValueError
        print(f"kiln plan: error: {exc}", file=sys.stderr)
        return 2
    print(f"{type(model).__name__} on {world} rank(s), optimizer {getattr(optimizer, '__name__', optimizer)}")
    print(format_table(rows))
    summary = activation_summary(rows)
    if summary:
        print(summary)
    return 0
