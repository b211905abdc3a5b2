"""`kiln run -n N [torchrun options] script.py [args]`: torch.distributed.run underneath.

kiln spawns nothing itself: it translates its short form into torchrun's arguments and calls
torchrun's own entry point in this process, so elastic restarts, rendezvous and signal handling
are torch's.
"""

from __future__ import annotations

import argparse
import signal
import sys

__all__ = ["add_parser", "torchrun_args", "run", "describe_failure"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run",
        help="launch a script on N processes with torch.distributed.run",
        description="Launch a training script on N processes per node (torchrun underneath). "
        "One node uses a standalone rendezvous; pass --nnodes/--node-rank/--rdzv-endpoint for more.",
    )
    p.add_argument(
        "-n",
        "--nproc-per-node",
        dest="nproc_per_node",
        default="1",
        help="processes per node: an integer, or auto/cpu/gpu as torchrun accepts (default 1)",
    )
    p.add_argument("--nnodes", default="1", help="number of nodes, or MIN:MAX for elastic jobs (default 1)")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=None, help="this node's rank")
    p.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        dest="rdzv_endpoint",
        default=None,
        help="host:port of the rendezvous (multi-node)",
    )
    p.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id", default=None, help="job id shared by all nodes")
    p.add_argument(
        "--rdzv-backend",
        "--rdzv_backend",
        dest="rdzv_backend",
        default=None,
        help="rendezvous backend (default c10d when an endpoint is given)",
    )
    p.add_argument(
        "--max-restarts",
        "--max_restarts",
        dest="max_restarts",
        type=int,
        default=0,
        help="restart the worker group up to this many times when a worker fails",
    )
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", default=None)
    p.add_argument("--master-port", "--master_port", dest="master_port", default=None)
    p.add_argument("--log-dir", "--log_dir", dest="log_dir", default=None, help="where torchrun writes worker logs")
    p.add_argument("--redirects", default=None, help="torchrun --redirects (e.g. 3 for stdout+stderr)")
    p.add_argument("--tee", default=None, help="torchrun --tee")
    p.add_argument("-m", "--module", action="store_true", help="run the script as a module, like python -m")
    p.add_argument("script", help="the training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(func=run)


def torchrun_args(args: argparse.Namespace) -> list[str]:
    """The torch.distributed.run argument list for a parsed `kiln run` command line."""
    out = [f"--nproc-per-node={args.nproc_per_node}", f"--nnodes={args.nnodes}", f"--max-restarts={args.max_restarts}"]
    multi_node = args.rdzv_endpoint is not None or str(args.nnodes) not in ("1", "1:1")
    if multi_node:
        if args.rdzv_endpoint is None and args.master_addr is None:
            raise ValueError(
                f"--nnodes={args.nnodes} needs --rdzv-endpoint HOST:PORT (or --master-addr) so nodes can meet"
            )
        if args.rdzv_endpoint is not None:
            out += [f"--rdzv-endpoint={args.rdzv_endpoint}", f"--rdzv-backend={args.rdzv_backend or 'c10d'}"]
        if args.rdzv_id is not None:
            out.append(f"--rdzv-id={args.rdzv_id}")
        if args.node_rank is not None:
            out.append(f"--node-rank={args.node_rank}")
    elif args.master_addr is None and args.master_port is None:
        out.append("--standalone")  # one node: torchrun picks a free port itself
    if args.master_addr is not None:
        out.append(f"--master-addr={args.master_addr}")
    if args.master_port is not None:
        out.append(f"--master-port={args.master_port}")
    for flag in ("log_dir", "redirects", "tee"):
        value = getattr(args, flag)
        if value is not None:
            out.append(f"--{flag.replace('_', '-')}={value}")
    if args.module:
        out.append("--module")
    return [*out, args.script, *args.script_args]


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from torch.distributed.run import main as torchrun_main

    if not args.module and not Path(args.script).is_file():
        print(
            f"kiln run: script {args.script!r} does not exist (pass a Python file, or -m for a module)", file=sys.stderr
        )
        return 2
    if not str(args.nproc_per_node).isdigit() and args.nproc_per_node not in ("auto", "cpu", "gpu", "xpu"):
        print(
            f"kiln run: -n {args.nproc_per_node!r} is not a process count; expected an integer or auto/cpu/gpu",
            file=sys.stderr,
        )
        return 2
    try:
        argv = torchrun_args(args)
    except ValueError as exc:
        print(f"kiln run: {exc}", file=sys.stderr)
        return 2
    try:
        torchrun_main(argv)
    except SystemExit as exc:  # torchrun exits with the workers' status
        return int(exc.code or 0)
    except Exception as exc:  # ChildFailedError: torchrun already printed the failing rank's error
        print(f"kiln run: {describe_failure(exc)}", file=sys.stderr)
        return 1
    return 0


def describe_failure(exc: BaseException) -> str:
    """One line naming the rank that failed first and how, from torchrun's ``ChildFailedError``."""
    failures = getattr(exc, "failures", None)
    if not failures:
        return f"{type(exc).__name__}: {exc}"
    # torchrun stops the surviving ranks with SIGTERM once one fails: those are not the cause
    stopped = lambda f: f.exitcode == -signal.SIGTERM  # noqa: E731
    first_rank, first = min(failures.items(), key=lambda item: (stopped(item[1]), item[1].timestamp, item[0]))
    line = f"rank {first_rank} (local rank {first.local_rank}, pid {first.pid}) failed first: {_how(first)}"
    others = [
        f"rank {rank} ({'stopped by torchrun' if stopped(f) else _how(f)})"
        for rank, f in sorted(failures.items())
        if rank != first_rank
    ]
    if others:
        line += "; then " + ", ".join(others)
    return line + ("; its traceback is above" if first.exitcode > 0 else "")


def _how(failure) -> str:
    if failure.exitcode < 0:
        return f"killed by {failure.signal_name()}"
    return f"exit code {failure.exitcode}"
