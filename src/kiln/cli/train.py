"""`kiln train -f run.yaml [--dotted.key value ...] [--nproc-per-node N] [--print-config] [--dry-run] [--verbose]`.

The whole config is read and checked first (types, batch arithmetic, imports, constructor
arguments, the resume path): a mistake exits with status 2 and one line on stderr, before any
process group, file or directory exists (``KILN_DEBUG=1`` adds the traceback). Then:

* ``--print-config`` prints the fully resolved YAML, which ``-f`` accepts back unchanged;
* ``--dry-run`` runs the setup and one step on a fake process group of the run's world size in this
  process, and prints what each rank holds and moves (``kiln plan --dry-run``; nothing is written);
* ``--nproc-per-node N`` starts N copies of this command through torch.distributed.run (via
  ``kiln run``); under torchrun (or ``kiln run``), SLURM (``srun``) or Open MPI (``mpirun``) the
  launcher's group is joined (:func:`kiln.launch.join.join_launcher`); otherwise it runs as one
  process;
* the Trainer is built from the config (:func:`kiln.config.build_trainer`) and fitted.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback
import typing
from typing import TYPE_CHECKING

from kiln.config.args import TrainerArgs, dump_yaml, load_trainer_args
from kiln.config.overrides import ConfigError, format_error
from kiln.config.types import field_docs, is_dataclass_type, type_name

if TYPE_CHECKING:
    from kiln.launch.environments import Launcher
    from kiln.trainer.trainer import Trainer

__all__ = ["add_parser", "fields_help", "train"]


def _launcher() -> Launcher | None:
    """The launcher this command runs under (torchrun, Open MPI, a SLURM step), as a config error."""
    # imported here: kiln.launch imports torch, which `kiln --help` and `kiln --version` never need
    from kiln.launch.environments import LaunchError, detect

    try:
        return detect()
    except LaunchError as e:
        raise ConfigError(str(e), path="environment") from None


def _field_lines(cls: type, prefix: str = "") -> list[str]:
    lines: list[str] = []
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        annotation, name = hints[f.name], f"{prefix}{f.name}"
        element = typing.get_args(annotation)[0] if typing.get_origin(annotation) is list else None
        arms = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
        nested = [a for a in arms if is_dataclass_type(a)] if element is None else []
        if nested:
            optional = " | None" if type(None) in typing.get_args(annotation) else ""
            kinds = " | ".join(a.__name__ for a in nested) + optional
            lines.append(f"  --{name}  ({kinds}): {docs.get(f.name, '')}")
            for cls_ in nested:
                lines += _field_lines(cls_, f"{name}.")
        elif element is not None and is_dataclass_type(element):
            lines.append(f"  --{name}  (list[{element.__name__}], default []): {docs.get(f.name, '')}")
            lines += _field_lines(element, f"{name}.N.")
        else:
            if f.default is not dataclasses.MISSING:
                default = f.default
            else:
                assert callable(f.default_factory)  # every config field has a default or a default_factory
                default = f.default_factory()
            lines.append(f"  --{name}  ({type_name(annotation)}, default {default!r}): {docs.get(f.name, '')}")
    return lines


def fields_help() -> str:
    """Every TrainerArgs field with its type, default and one-line doc, as ``kiln train --help`` shows."""
    return "config fields (YAML keys; override any with --dotted.key VALUE):\n" + "\n".join(_field_lines(TrainerArgs))


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train from a YAML config of TrainerArgs (nnScaler style)",
        description="Train from a YAML file of TrainerArgs. Any field can be overridden: --a.b.c VALUE or "
        "--a.b.c=VALUE (values guessed with ast.literal_eval unless the field is a string), "
        "--list.0.key VALUE for list items, --a.b! to delete a key; '-' and '_' are the same in keys; "
        "$(a.b) in a value refers to another field.",
        epilog=fields_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("-f", "--file", required=True, help="the YAML config file")
    p.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc_per_node",
        default=None,
        help="start N processes on this node with torch.distributed.run (an int, or 'gpu')",
    )
    p.add_argument(
        "--print-config",
        "--print_config",
        dest="print_config",
        action="store_true",
        help="print the fully resolved config as YAML and exit",
    )
    p.add_argument(
        "--dry-run",
        "--dry_run",
        dest="dry_run",
        action="store_true",
        help="run the setup and one training step as each pipeline stage's first rank, in this process, "
        "on a fake process group and fake tensors (the world: --nproc-per-node, else "
        "compute_config.runtime_ngpus); print what each rank holds and moves (kiln plan --dry-run)",
    )
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also print kiln's debug messages (such as the table of every strategy 'auto' weighed)",
    )
    p.set_defaults(func=train, accepts_extra=True)


def _nproc(value: str | None) -> int | None:
    if value is None:
        return None
    if value in ("gpu", "auto"):
        import torch

        return max(1, torch.cuda.device_count())
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(format_error("--nproc-per-node", value, "a positive int or 'gpu'"), path="--nproc-per-node")
    return n


def _world_size(nproc: int | None, launcher: Launcher | None) -> int:
    if launcher is not None and launcher.name != "torchrun":
        if nproc is not None:
            raise ConfigError(
                format_error(
                    "--nproc-per-node",
                    nproc,
                    f"nothing (this process is already rank {launcher.rank} of {launcher.world_size} "
                    f"started by {launcher.name})",
                ),
                path="--nproc-per-node",
            )
        return launcher.world_size
    if launcher is not None:
        world = launcher.world_size
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if nproc is not None and local is not None and int(local) != nproc:
            raise ConfigError(
                format_error(
                    "--nproc-per-node",
                    nproc,
                    f"{local} (this process already runs under torchrun with LOCAL_WORLD_SIZE={local}) or nothing",
                ),
                path="--nproc-per-node",
            )
        return world
    return nproc or 1


def _relaunch(args: argparse.Namespace, nproc: int) -> int:
    """This command again on ``nproc`` processes, through ``kiln run`` (torch.distributed.run)."""
    from kiln.cli.run import run

    argv = ["train", "-f", args.file, *(["--verbose"] if getattr(args, "verbose", False) else []), *args.extra]
    ns = argparse.Namespace(
        nproc_per_node=str(nproc),
        nnodes="1",
        node_rank=None,
        rdzv_endpoint=None,
        rdzv_id=None,
        rdzv_backend=None,
        max_restarts=0,
        master_addr=None,
        master_port=None,
        log_dir=None,
        redirects=None,
        tee=None,
        module=True,
        script="kiln.cli.main",
        script_args=argv,
    )
    return run(ns)


def _fail(error: BaseException) -> int:
    if os.environ.get("KILN_DEBUG") == "1":
        traceback.print_exception(error)
    print(f"kiln train: error: {error}", file=sys.stderr)
    return 2


def train(args: argparse.Namespace) -> int:
    """The ``kiln train`` command: check, then print, relaunch, or build and fit the Trainer."""
    if os.getcwd() not in sys.path:  # components resolve from the working directory, as with python -m
        sys.path.insert(0, os.getcwd())
    extra = list(getattr(args, "extra", []))
    if getattr(args, "verbose", False):
        from kiln.launch.logging import get_dist_logger

        get_dist_logger().set_level("DEBUG")
    try:
        nproc = _nproc(args.nproc_per_node)
        launcher = _launcher()
        world: int | None = _world_size(nproc, launcher)
        if args.dry_run and nproc is None and launcher is None:
            world = None  # the run file's runtime_ngpus: a dry run is for the cluster, not this machine
        trainer_args = load_trainer_args(args.file, extra, world_size=world)
    except ConfigError as e:
        return _fail(e)
    if args.print_config:
        sys.stdout.write(dump_yaml(trainer_args))
        return 0
    if args.dry_run:
        from kiln.cli.plan_dry_run import dry_run_command

        return dry_run_command(trainer_args, world, prog="kiln train")
    try:  # after the dry run, which runs context parallelism on the CPU with a stand-in attention
        import torch

        trainer_args.compute_config.check_context_parallel("cuda" if torch.cuda.is_available() else "cpu")
    except ConfigError as e:
        return _fail(e)
    if nproc is not None and launcher is None:
        # the dry run's checks of the plan (mesh, heads and experts against tp and ep, pipeline
        # splits and schedule), here, in seconds on the meta device, rather than in every worker
        from kiln.planning.dry_run import check_plan

        try:
            check_plan(trainer_args, nproc)
        except (ValueError, TypeError) as e:  # ConfigError is a ValueError; so are the strategies' checks
            return _fail(e)
        return _relaunch(args, nproc)
    return run_training(trainer_args)


def run_training(trainer_args: TrainerArgs) -> int:
    """Build the Trainer (which joins the launcher's process group, or runs alone) and fit it."""
    from kiln.config.trainer_builder import build_trainer

    trainer = build_trainer(trainer_args)
    try:
        if trainer_args.run_mode == "compile":
            _summary(trainer, trainer_args)
        else:
            trainer.fit()
    finally:
        trainer.close()
    return 0


def _summary(trainer: Trainer, args: TrainerArgs) -> None:
    state = trainer.state
    if state.rank != 0:
        return
    params = sum(p.numel() for p in state.model.parameters())
    print(
        f"kiln train (compile): model {type(state.model).__name__} with {params:,} parameters; "
        f"strategy {trainer.engine.strategy!r}; precision {trainer.engine.precision.name}; "
        f"world {state.world_size}; micro_batch_size {args.micro_batch_size} x "
        f"grad_accumulation_steps {args.grad_accumulation_steps} x data-parallel "
        f"{args.data_parallel_size(state.world_size)} = global_batch_size {args.global_batch_size}"
    )
