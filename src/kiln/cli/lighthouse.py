"""`kiln lighthouse --min-replicas N [--port P | --bind HOST:PORT]`: torchft's Lighthouse, for
``fault_tolerance=`` (see :mod:`kiln.trainer.fault_tolerance`).

The Lighthouse forms the quorum of the live replica groups at each step. It prints one line with the
address the groups are given (``fault_tolerance.lighthouse`` or ``$TORCHFT_LIGHTHOUSE``), then one
line each time the quorum's members change (``kiln lighthouse: quorum 3 at committed step 152: 2 replica groups
(kiln_group_0, kiln_group_1); kiln_group_1 joined``), and serves until SIGINT or SIGTERM (exit 0).
Bad arguments, a missing torchft, or an address it cannot listen on exit with status 2 and one line.
The same server as torchft's ``torchft_lighthouse`` binary.

torchft's server is Rust and logs to stderr (file descriptor 2) at INFO several lines per quorum
request and heartbeat change: over a thousand lines in two minutes of two groups. kiln sets
``RUST_LOG=torchft=warn,torchft::lighthouse=info``, reads those lines through a pipe, prints its own
line when a new quorum's members differ and passes on warnings and errors; INFO lines are dropped.
A ``RUST_LOG`` set by the user (``RUST_LOG=info`` for all of torchft's lines) turns the filter off.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading

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
    summarize = "RUST_LOG" not in os.environ
    if summarize:  # read by torchft's logger when its module loads
        os.environ["RUST_LOG"] = "torchft=warn,torchft::lighthouse=info"
    try:
        from torchft.coordination import LighthouseServer
    except ModuleNotFoundError:
        return fail("needs torchft: pip install 'kiln-train[ft]'")
    # Blocked before the server's threads start (they inherit the mask), so that only sigwait below
    # receives them and the server shuts down cleanly.
    stop = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    summary = _Summary() if summarize else None
    try:
        server = LighthouseServer(
            bind=bind,
            min_replicas=args.min_replicas,
            join_timeout_ms=round(args.join_timeout * 1000),
            quorum_tick_ms=max(1, round(args.quorum_tick * 1000)),
            heartbeat_timeout_ms=round(args.heartbeat_timeout * 1000),
        )
    except Exception as exc:  # torchft raises a plain RuntimeError for an address in use or malformed
        if summary is not None:
            summary.close()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stop)
        return fail(f"cannot listen on {bind!r} ({exc}); choose another --port or --bind HOST:PORT")
    print(
        f"kiln lighthouse: listening on {server.address()} (min replicas {args.min_replicas}); give the groups "
        f"fault_tolerance.lighthouse={server.address()} or TORCHFT_LIGHTHOUSE={server.address()}",
        flush=True,
    )
    signal.sigwait(stop)
    server.shutdown()
    if summary is not None:
        summary.close()
    return 0


# torchft's line for each quorum it hands out (its Debug format of the Quorum message):
# ... [INFO] [torchft::lighthouse] - Quorum! Quorum { quorum_id: 3, participants: [QuorumMember {
# replica_id: "kiln_group_0:<uuid>", ..., step: 152, ... }, ...], created: ... }
_QUORUM = re.compile(r"\[torchft::lighthouse\] - Quorum! Quorum \{ quorum_id: (\d+), participants: \[(.*)\], created")
_MEMBER = re.compile(r'replica_id: "([^"]*)".*?step: (\d+)')


class _Summary:
    """Takes file descriptor 2 (where torchft's Rust logger writes) and reads it on a thread: a
    line per change of the quorum's members on stdout, torchft's warnings and errors (and anything
    else written to stderr) passed on to the real stderr, its INFO lines dropped."""

    def __init__(self) -> None:
        sys.stderr.flush()
        self._stderr = os.dup(2)
        read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
        self._members: list[str] | None = None
        self._thread = threading.Thread(target=self._read, args=(read,), name="kiln-lighthouse-log", daemon=True)
        self._thread.start()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as lines:
            for raw in lines:
                line = raw.decode(errors="replace")
                if " [INFO] [torchft::" not in line:
                    os.write(self._stderr, raw)
                elif (match := _QUORUM.search(line)) is not None:
                    self._quorum(int(match.group(1)), match.group(2))

    def _quorum(self, quorum_id: int, participants: str) -> None:
        members = sorted(_MEMBER.findall(participants))
        ids = [replica_id for replica_id, _ in members]
        if ids == self._members:
            return
        names = [replica_id.split(":")[0] for replica_id in ids]
        changes = []
        if self._members is not None:
            before = {replica_id.split(":")[0]: replica_id for replica_id in self._members}
            left = [name for name in before if name not in names]
            joined = [name for name in names if name not in before]
            restarted = [name for replica_id, name in zip(ids, names) if name in before and before[name] != replica_id]
            for verb, which in (("left", left), ("joined", joined), ("restarted", restarted)):
                if which:
                    changes.append(f"{', '.join(which)} {verb}")
        self._members = ids
        step = max((int(step) for _, step in members), default=0)
        groups = f"{len(names)} replica group{'s' if len(names) != 1 else ''} ({', '.join(names)})"
        tail = f"; {'; '.join(changes)}" if changes else ""
        os.write(1, f"kiln lighthouse: quorum {quorum_id} at committed step {step}: {groups}{tail}\n".encode())

    def close(self) -> None:
        """Give file descriptor 2 back and let the reader finish what is in the pipe."""
        sys.stderr.flush()
        os.dup2(self._stderr, 2)  # the pipe's last write end closes: the reader reaches its end
        self._thread.join(timeout=5)
        os.close(self._stderr)
