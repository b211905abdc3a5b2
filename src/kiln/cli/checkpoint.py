"""`kiln checkpoint merge SRC DST[.pt] | inspect PATH | verify PATH | export PATH --safetensors OUT | --hf OUT`.

Every PATH, SRC and (for merge) DST may be an fsspec URL (``s3://bucket/run/last``); S3's endpoint
and credentials come from the standard environment variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ...). Exit codes, the same for every subcommand, each failure one line on
stderr and never a traceback:

* 0: done;
* 2: usage and missing inputs, found before anything is read or written: a PATH, SRC or
  ``--config`` that does not exist, a DST or ``--hf`` OUT that does, a checkpoint without the
  Hugging Face config ``export --hf`` needs and no ``--config`` (argparse's own errors exit 2 too);
* 1: failures: a checkpoint that is damaged, incomplete or unsafe, or an output that cannot be
  written (a :class:`kiln.checkpoint.CheckpointError` naming the file and the problem).
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["add_parser"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "checkpoint",
        help="inspect, verify, merge or export checkpoints",
        description="Work with kiln checkpoint folders, local or at fsspec URLs such as s3://bucket/run/last "
        "(no process group needed).",
    )
    sub = p.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)

    merge = sub.add_parser(
        "merge",
        help="turn a sharded/deduped checkpoint into one merged file",
        description="Write SRC as a merged checkpoint: one file when DST ends in .pt or .pth "
        "(loads with torch.load(weights_only=True), and as load_path= of a Trainer), "
        "else a checkpoint folder DST whose checkpoint.pt loads the same way. "
        "DST must not exist.",
    )
    merge.add_argument("src", help="checkpoint folder (or a 'last'/'best' link, or a merged .pt file)")
    merge.add_argument("dst", help="new file (DST.pt, DST.pth) or checkpoint folder to create")
    merge.set_defaults(func=_merge)

    inspect = sub.add_parser("inspect", help="a readable summary: progress, metrics, files, tensor shapes")
    inspect.add_argument("path")
    inspect.add_argument("--json", action="store_true", help="print the summary as JSON")
    inspect.add_argument("--max-tensors", type=int, default=40, help="model tensors to list (default 40)")
    inspect.set_defaults(func=_inspect)

    verify = sub.add_parser("verify", help="check sizes and checksums of every file; exit 0 or print the problem")
    verify.add_argument("path")
    verify.set_defaults(func=_verify)

    export = sub.add_parser(
        "export",
        help="write the model weights to a safetensors file, or a Hugging Face folder",
        description="--safetensors OUT: the model weights as one .safetensors file. --hf OUT: a new folder "
        "(config.json + safetensors files of at most --max-shard-size, with an index when several) that "
        "transformers' AutoModelFor...from_pretrained(OUT) loads, "
        "from a checkpoint of a kiln.models.HuggingFaceModel of any save type and world size.",
    )
    export.add_argument("path")
    target = export.add_mutually_exclusive_group(required=True)
    target.add_argument("--safetensors", metavar="OUT", help="output .safetensors file (or folder)")
    target.add_argument("--hf", metavar="OUT", help="output folder for transformers' from_pretrained (must not exist)")
    export.add_argument(
        "--config",
        metavar="CONFIG",
        default=None,
        help="with --hf: the model's config.json (or its folder), for a checkpoint that holds none",
    )
    export.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None, help="cast floating-point weights")
    export.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="with --hf: the largest safetensors file, as transformers' save_pretrained (default 5GB; e.g. "
        "500MB, 20KB); several files get model.safetensors.index.json. A sharded checkpoint is streamed "
        "one tensor at a time",
    )
    export.set_defaults(func=_export)


class _UsageError(Exception):
    """A usage mistake or a missing input: one line, exit status 2."""


_MISSING = "does not exist; check the path (a checkpoint is a folder such as ep3-ba120, or a merged .pt file)"
_IN_THE_WAY = "already exists; choose a new destination or remove it first"


def _check_paths(args: argparse.Namespace, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> None:
    """Refuse, before any work, an input that is not there or an output that is (exit 2)."""
    from kiln.checkpoint.storage import as_path

    for name in inputs:
        value = getattr(args, name, None)
        if value is None:
            continue
        path = as_path(value)
        if not (path.exists() or path.is_symlink()):  # a dangling `last` falls back to the newest checkpoint
            raise _UsageError(f"{_LABELS.get(name, name.upper())} {value} {_MISSING}")
    for name in outputs:
        value = getattr(args, name, None)
        if value is not None and (as_path(value).exists() or as_path(value).is_symlink()):
            raise _UsageError(f"{_LABELS.get(name, name.upper())} {value} {_IN_THE_WAY}")


_LABELS = {"config": "--config", "hf": "--hf OUT"}


def _guarded(inputs: tuple[str, ...] = (), outputs: tuple[str, ...] = ()):
    """The subcommand's action with kiln's exit codes: 2 for usage and missing inputs, 1 for failures."""

    def wrap(action):
        def run(args: argparse.Namespace) -> int:
            from kiln.checkpoint import CheckpointError
            from kiln.checkpoint.export import MissingConfigError

            command = f"kiln checkpoint {args.checkpoint_command}"
            try:
                _check_paths(args, inputs, outputs)
                return action(args) or 0
            except (_UsageError, MissingConfigError) as exc:
                print(f"{command}: error: {exc}", file=sys.stderr)
                return 2
            except CheckpointError as exc:
                print(f"{command}: {exc}", file=sys.stderr)
                return 1

        return run

    return wrap


@_guarded(inputs=("src",), outputs=("dst",))
def _merge(args: argparse.Namespace) -> int:
    from kiln.checkpoint import merge_checkpoint

    print(f"merged {args.src} -> {merge_checkpoint(args.src, args.dst)}")
    return 0


@_guarded(inputs=("path",))
def _inspect(args: argparse.Namespace) -> int:
    from kiln.checkpoint import inspect_checkpoint
    from kiln.checkpoint.offline import format_inspection

    info = inspect_checkpoint(args.path)
    print(json.dumps(info, indent=2, default=str) if args.json else format_inspection(info, args.max_tensors))
    return 0


@_guarded(inputs=("path",))
def _verify(args: argparse.Namespace) -> int:
    from kiln.checkpoint import verify_checkpoint

    manifest = verify_checkpoint(args.path)
    if "files" not in manifest:  # a merged .pt file: no checksums to compare
        from kiln.checkpoint.storage import as_path

        size = as_path(args.path).stat().st_size
        print(
            f"OK {args.path}: {manifest['name']}, one merged file, {size / 1e6:.1f} MB, loads safely "
            "(a single file carries no checksums)"
        )
        return 0
    total = sum(int(f.get("bytes", 0)) for f in manifest["files"].values())
    print(f"OK {args.path}: {manifest['name']}, {len(manifest['files'])} files, {total / 1e6:.1f} MB, checksums match")
    return 0


def _export(args: argparse.Namespace) -> int:
    if args.hf is not None:
        return _export_hf(args)
    return _export_safetensors(args)


@_guarded(inputs=("path",))
def _export_safetensors(args: argparse.Namespace) -> int:
    from kiln.checkpoint import export_safetensors

    if args.config is not None:
        raise _UsageError(f"--config {args.config} goes with --hf OUT (a Hugging Face folder), not --safetensors")
    print(f"exported model weights of {args.path} -> {export_safetensors(args.path, args.safetensors, args.dtype)}")
    return 0


@_guarded(inputs=("path", "config"), outputs=("hf",))
def _export_hf(args: argparse.Namespace) -> int:
    from kiln.checkpoint.export import export_hf

    try:
        out = export_hf(args.path, args.hf, config=args.config, dtype=args.dtype, max_shard_size=args.max_shard_size)
    except (ValueError, TypeError) as exc:  # an input it cannot export
        raise _UsageError(str(exc)) from None
    print(f"exported {args.path} -> {out} (transformers: AutoModelFor...from_pretrained({str(out)!r}))")
    return 0
