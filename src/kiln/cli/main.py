"""`kiln`: the command-line entry point. Each subcommand lives in its own module."""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main", "build_parser", "parse_args"]

# subcommand modules, each with add_parser(subparsers) that sets `func`
_COMMANDS = ["kiln.cli.run", "kiln.cli.lighthouse"]
_OPTIONAL_COMMANDS = ["kiln.cli.train", "kiln.cli.checkpoint", "kiln.cli.plan", "kiln.cli.report"]


def build_parser() -> argparse.ArgumentParser:
    from kiln import __version__

    parser = argparse.ArgumentParser(prog="kiln", description="kiln: train PyTorch models from one CPU to many GPUs")
    parser.add_argument("--version", action="version", version=f"kiln {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        importlib.import_module(name).add_parser(sub)
    for name in _OPTIONAL_COMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.add_parser(sub)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``kiln ARGV`` parsed as :func:`main` parses it, without running the command.

    The namespace's ``command`` names the subcommand (None when there is none) and ``func`` runs
    it; a subcommand that takes further arguments (``kiln train``'s dotted overrides, ``kiln
    run``'s script arguments) has them in ``extra``. Bad arguments exit with status 2 and
    argparse's usage line, as on the command line; ``--help`` and ``--version`` exit with 0.

    Example::

        args = parse_args(["train", "-f", "run.yaml", "--optimizer.args.lr", "0.01"])
        assert args.command == "train" and args.extra == ["--optimizer.args.lr", "0.01"]
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "accepts_extra", False):
        args.extra = extra
    return args


def main(argv: list[str] | None = None) -> int:
    # Components are named by dotted paths relative to the project (``examples.mlp_model.MLP``);
    # the console script's sys.path starts at its own folder, so add the working directory as
    # ``python -m`` would.
    import os

    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        build_parser().print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
