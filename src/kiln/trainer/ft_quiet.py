"""What a replica group prints when another group leaves or rejoins: kiln's one line, not torchft's.

A healthy recovery under torchft (:mod:`kiln.trainer.fault_tolerance`) used to read as a crash. Each
message came from its own source, and each is quieted there, only for a process that runs a
replica group:

* torchft's Python loggers (``torchft.manager``, ``torchft.checkpointing.http_transport``, ...):
  the gloo ``RuntimeError ... Connection closed by peer ... GLHF!`` traceback a survivor's failed
  allreduce logs, ``Unable to reset NCCL flight recorder recording`` at every new quorum (a torch
  without NCCL has no flight recorder to reset), the checkpoint server's errors. The ``torchft``
  logger stops propagating (Python's last-resort handler printed its warnings on stderr) and hands
  its records to kiln's logger at DEBUG (``kiln.torchft``): ``kiln train --verbose`` prints them.
* the checkpoint server's access lines (``"GET /checkpoint/115/full HTTP/1.1" 200 -``):
  :class:`http.server.BaseHTTPRequestHandler` writes ``log_message`` to stderr; the server's
  handler class is swapped for a subclass whose ``log_message`` logs to torchft's logger (so DEBUG).
  The same for the traceback :mod:`socketserver` prints when a request fails (``handle_error``:
  a recovering peer that timed out closed its socket, and asks again at the next quorum).
* ``UserWarning: The given buffer is not writable``: torch's streaming load
  (``torch.distributed._serialization``, which torchft's transport calls) wraps the received bytes
  with ``torch.frombuffer``; the tensors are copied into the model and never written. Ignored for
  that message from that module only.

``KILN_DEBUG=1`` leaves all of it as torchft prints it.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterable
from typing import Any

__all__ = ["membership_lines", "quiet_checkpoint_server", "quiet_torchft"]

# torchft.manager logs this at every reconfiguration when torch has no NCCL flight recorder.
FLIGHT_RECORDER = "Unable to reset NCCL flight recorder recording"


class _ToKilnDebug(logging.Handler):
    """Hands a torchft record to kiln's logger (``kiln.torchft``) at DEBUG, with its traceback."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger("kiln.torchft")
        if not target.isEnabledFor(logging.DEBUG):
            return
        debug = logging.makeLogRecord(record.__dict__)
        debug.levelno, debug.levelname = logging.DEBUG, "DEBUG"
        debug.name = target.name
        debug.msg, debug.args = f"[{record.name} {record.levelname}] {record.getMessage()}", None
        target.handle(debug)


class _NoFlightRecorder(logging.Filter):
    """Drops the flight-recorder line on a gloo run, where there is no NCCL to record."""

    def filter(self, record: logging.LogRecord) -> bool:
        return FLIGHT_RECORDER not in record.getMessage()


def quiet_torchft(*, nccl: bool) -> None:
    """Route torchft's Python logging to kiln's DEBUG and drop the warnings a recovery raises.

    Args:
        nccl: the cross-group process group is NCCL; otherwise (gloo) the flight-recorder line,
            which is about NCCL, is dropped even at DEBUG.
    """
    if os.environ.get("KILN_DEBUG") == "1":
        return
    from kiln.launch.logging import get_dist_logger

    get_dist_logger()  # creates kiln's handler, which kiln.torchft's records reach
    torchft = logging.getLogger("torchft")
    if not any(isinstance(h, _ToKilnDebug) for h in torchft.handlers):
        torchft.addHandler(_ToKilnDebug())
        torchft.propagate = False
        if torchft.level == logging.NOTSET:  # a level the user set stays
            # All of them, for kiln's DEBUG (whose level is read at each record: a few a step, and
            # only formatted when kiln's logger is at DEBUG).
            torchft.setLevel(logging.DEBUG)
    manager = logging.getLogger("torchft.manager")
    filters = [f for f in manager.filters if isinstance(f, _NoFlightRecorder)]
    if not nccl and not filters:
        manager.addFilter(_NoFlightRecorder())
    elif nccl:
        for f in filters:
            manager.removeFilter(f)
    warnings.filterwarnings(
        "ignore",
        message="The given buffer is not writable",
        category=UserWarning,
        module=r"torch\.distributed\._serialization",
    )


def quiet_checkpoint_server(transport: Any) -> None:
    """Send the access lines of torchft's checkpoint server (an ``HTTPTransport``) to torchft's logger."""
    if os.environ.get("KILN_DEBUG") == "1":
        return
    # torchft builds its request handler inside HTTPTransport.__init__ and keeps the server in
    # _server; socketserver's RequestHandlerClass is the one place the handler can be chosen.
    server = getattr(transport, "_server", None)
    handler = getattr(server, "RequestHandlerClass", None)
    if server is None or handler is None or getattr(handler, "_kiln_quiet", False):
        return
    log = logging.getLogger("torchft.checkpointing.http_transport")

    def log_message(self: Any, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    server.RequestHandlerClass = type(handler.__name__, (handler,), {"log_message": log_message, "_kiln_quiet": True})

    def handle_error(request: Any, client_address: Any) -> None:
        # socketserver prints a request's exception with its traceback to stderr: a peer that gave
        # up on a transfer (its timeout passed) leaves a BrokenPipeError here, and it retries.
        log.warning("checkpoint request from %s failed", client_address, exc_info=True)

    server.handle_error = handle_error


def membership_lines(
    before: Iterable[int] | None, after: Iterable[int], *, step: int, num_groups: int, seen: set[int]
) -> list[str]:
    """kiln's lines for a quorum whose replica groups changed from ``before`` to ``after`` (group
    indices; ``before`` None: this group's first quorum), at the step about to be trained.
    ``seen`` collects the groups met so far: a group met before *rejoined*, a new one *joined*."""
    now = sorted(set(after))
    lines = []
    if before is None:
        seen.update(now)
        if len(now) < num_groups:
            missing = sorted(set(range(num_groups)) - set(now))
            lines.append(
                f"training from step {step} with {len(now)} of {num_groups} replica groups ({_groups(missing)} not yet in the quorum)"
            )
        return lines
    left = sorted(set(before) - set(now))
    joined = sorted(set(now) - set(before))
    if left:
        lines.append(
            f"{_groups(left)} left the quorum at step {step}; continuing with {len(now)} of {num_groups} groups"
        )
    for verb, groups in (
        ("rejoined", [g for g in joined if g in seen]),
        ("joined", [g for g in joined if g not in seen]),
    ):
        if groups:
            lines.append(f"{_groups(groups)} {verb} the quorum at step {step}; {len(now)} of {num_groups} groups")
    seen.update(now)
    return lines


def _groups(groups: list[int]) -> str:
    if len(groups) == 1:
        return f"replica group {groups[0]}"
    return "replica groups " + ", ".join(map(str, groups[:-1])) + f" and {groups[-1]}"
