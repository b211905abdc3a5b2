"""`kiln lighthouse --min-replicas N [--port P | --bind HOST:PORT]`: torchft's Lighthouse, for
``fault_tolerance=`` (see :mod:`kiln.trainer.fault_tolerance`).

The Lighthouse forms the quorum of the live replica groups at each step. It prints one line with the
address the groups are given (``fault_tolerance.lighthouse`` or ``$TORCHFT_LIGHTHOUSE``), then serves
until SIGINT or SIGTERM (exit 0). Bad arguments, a missing torchft, or an address it cannot listen on
exit with status 2 and one line. The same server as torchft's ``torchft_lighthouse`` binary.
"""

from __future__ import annotations

import argparse
import signal
import sys

__all__ = ["add_parser"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "lighthouse",
        help="run torchft's Lighthouse: the quorum server of fault-tolerant replica groups",
        description="Serve torchft's Lighthouse, which forms a quorum of the live replica groups of a "
        "job trained with fault_tolerance= at every step. Prints the address to give the groups, then "
        "serves until interrupted.",
    )
    p.add_argument("--min-replicas", type=int, required=True, metavar="N", help="fewest groups a quorum forms with")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--port", type=int, default=None, metavar="P", help="port on every interface (default 29510)")
    where.add_argument("--bind", default=None, metavar="HOST:PORT", help="address to listen on (default [::]:29510)")
    p.add_argument(
        "--join-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds to wait for the groups of the last quorum before forming one without them (default 60)",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds without a heartbeat after which a group counts as dead (default 5)",
    )
    p.add_argument(
        "--quorum-tick", type=float, default=0.1, metavar="S", help="seconds between quorum checks (default 0.1)"
    )
    p.set_defaults(func=_lighthouse)


def _lighthouse(args: argparse.Namespace) -> int:
    def fail(message: str) -> int:
        print(f"kiln lighthouse: {message}", file=sys.stderr)
        return 2

    if args.min_replicas < 1:
        return fail(f"--min-replicas {args.min_replicas} must be at least 1")
    for flag in ("join_timeout", "heartbeat_timeout", "quorum_tick"):
        if not getattr(args, flag) > 0:
            return fail(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be a positive number of seconds")
    if args.port is not None and not 0 <= args.port < 65536:
        return fail(f"--port {args.port} is not a port; expected 0 to 65535 (0: any free port)")
    bind = args.bind if args.bind is not None else f"[::]:{29510 if args.port is None else args.port}"
    try:
        from torchft.coordination import LighthouseServer
    except ModuleNotFoundError:
        return fail("needs torchft: pip install 'kiln-train[ft]'")
    # Blocked before the server's threads start (they inherit the mask), so that only sigwait below
    # receives them and the server shuts down cleanly.
    stop = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    try:
        server = LighthouseServer(
            bind=bind,
            min_replicas=args.min_replicas,
            join_timeout_ms=round(args.join_timeout * 1000),
            quorum_tick_ms=max(1, round(args.quorum_tick * 1000)),
            heartbeat_timeout_ms=round(args.heartbeat_timeout * 1000),
        )
    except Exception as exc:  # torchft raises a plain RuntimeError for an address in use or malformed
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stop)
        return fail(f"cannot listen on {bind!r} ({exc}); choose another --port or --bind HOST:PORT")
    print(
        f"kiln lighthouse: listening on {server.address()} (min replicas {args.min_replicas}); give the groups "
        f"fault_tolerance.lighthouse={server.address()} or TORCHFT_LIGHTHOUSE={server.address()}",
        flush=True,
    )
    signal.sigwait(stop)
    server.shutdown()
    return 0
