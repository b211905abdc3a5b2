"""Failures that read themselves: what each rank of ``kiln run`` died of, and the one line that says it.

A worker started by ``kiln run`` (through :mod:`kiln.launch.worker`) that ends with an uncaught
exception writes a :class:`Report` before it prints anything: the exception's type, the first line
of its message and the ``file:line`` of the innermost frame of the user's code, with the rank,
node, host and pid. It goes into the error file torchrun gives each worker
(``TORCHELASTIC_ERROR_FILE``, in torch's ``@record`` format with kiln's report beside it), and, for a
rank that failed on its own, into the job's c10d store too, where ranks on other nodes can read it.

Each report is classified:

* ``error``: the rank failed on its own (the cause; the summary names it first).
* ``lost_peer``: the rank died only because another rank vanished: a connection reset or closed
  by the peer, a store error, a collective that timed out (:func:`is_peer_loss`). Such a rank is
  never blamed; its report carries the first ``error`` report of another rank it could read from
  the store (``peer``), which is how the surviving node of a multi-node job learns which node went
  away and why.
* ``interrupted``: the rank was stopped by Ctrl-C.

A report is ``brief`` when its one line says all there is to say, so no traceback is shown for it:
a ``SyntaxError`` (named at its own ``file:line``), and a ``ValueError`` or ``kiln.LaunchError``
that kiln itself raised about what it was given (``strategy="ddpp"``: the user's line that made the
call is the ``where``; kiln's frames below it would say nothing more).

Under ``kiln run`` the workers print no traceback of their own (:data:`LAUNCHER_PRINTS_ENV`): it is
in their error file, and the launcher reads the reports after torchrun has stopped every worker
and prints the traceback of the rank that failed on its own first, once, then one line
(:func:`explain`); ranks that failed the same way, lost their peer or were stopped are grouped in
that line, so its length does not grow with the world size::

    [rank1]: Traceback (most recent call last):
    [rank1]:   File "/home/me/model.py", line 12, in forward
    [rank1]:     raise RuntimeError("boom")
    [rank1]: RuntimeError: boom
    kiln run: rank 1 (node 0, host h, pid 812) failed first: RuntimeError: boom (model.py:12); rank 0 lost its peer
    kiln run: node 1 (host h2) went away: its rank 1 (pid 77) failed first: RuntimeError: boom (model.py:12); rank 0 here lost its peer
    kiln run: rank 0 (node 0, host h, pid 812) failed first: ValueError: strategy='ddpp' is not known; ... (train.py:9); ranks 1-7 failed the same way
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = [
    "ERROR_FILE_ENV",
    "LAUNCHER_PRINTS_ENV",
    "Report",
    "Summary",
    "describe",
    "explain",
    "find_failures",
    "is_peer_loss",
    "publish",
    "read",
    "read_peer_failure",
    "read_traceback",
    "find_reports",
    "print_line",
    "summarize",
    "summarize_reports",
    "write",
]

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # torchrun sets it per worker: <log dir>/attempt_N/<local rank>/error.json
# Set by `kiln run` for its workers: the launcher prints the first failure's traceback from the
# error files, so a worker that wrote its report prints none (at 512 ranks, 512 would scroll by).
LAUNCHER_PRINTS_ENV = "KILN_RUN_PRINTS_TRACEBACKS"
# One line of JSON per rank that failed on its own, per torchrun attempt (a restarted group keeps
# the store, and an earlier attempt's failure is not this one's).
_STORE_KEY = "kiln/failures/attempt{}"
_STORE_SECONDS = 2.0  # a store whose host went away must not hold a dying rank longer than this
_MESSAGE_CHARS = 300

# Errors from c10d and its backends that mean "another rank went away", not "this rank is wrong".
# Matched only on exceptions that come from torch.distributed (DistError, or gloo/NCCL/c10d text),
# so a user's own ConnectionResetError (a download) still counts as the rank's failure.
_PEER_TEXT = re.compile(
    r"connection (closed|reset) by (peer|remote)|broken pipe|connection refused|socket timeout"
    r"|(send|recv)(bytes|value) failed|remote process exited|timed out|timeout",
    re.IGNORECASE,
)
_FROM_C10D = re.compile(r"gloo|nccl|c10d|tcpstore", re.IGNORECASE)
# "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed..."
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|c|h|hpp):\d+\]\s*")


@dataclass
class Report:
    """What one rank died of (see the module docstring for ``kind``)."""

    kind: str
    type: str
    message: str
    where: str | None
    rank: int | None
    local_rank: int | None
    node: int | None
    num_nodes: int | None
    host: str
    pid: int
    time: float
    gone: str | None = None  # a lost_peer rank's guess at what went away ("node 1"), when it can tell
    peer: dict[str, Any] | None = None  # a lost_peer rank: the first report of a rank that failed on its own
    brief: bool = False  # the line says it all (a SyntaxError, a bad argument kiln refused): no traceback

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Report:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def text(self) -> str:
        """``RuntimeError: boom``."""
        return f"{self.type}: {self.message}" if self.message else self.type

    def how(self) -> str:
        """``RuntimeError: boom (model.py:12)``."""
        return f"{self.text()} ({self.where})" if self.where else self.text()


# ----------------------------------------------------------------------------- in the worker


def is_peer_loss(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) says another rank vanished."""
    import torch.distributed as dist

    from kiln.launch.heartbeat import CollectiveTimeout

    for error in _chain(exc):
        if isinstance(error, CollectiveTimeout):
            return True
        if isinstance(error, (dist.DistNetworkError, dist.DistStoreError)):
            return True
        from_c10d = isinstance(error, dist.DistError) or (
            isinstance(error, RuntimeError) and bool(_FROM_C10D.search(str(error)))
        )
        if from_c10d and _PEER_TEXT.search(str(error)):
            return True
    return False


def describe(exc: BaseException, tb: TracebackType | None, interrupted: bool = False) -> Report:
    """The report of this process for ``exc``, raised with traceback ``tb``."""
    env = os.environ
    if interrupted or any(isinstance(e, KeyboardInterrupt) for e in _chain(exc)):
        kind = "interrupted"
    elif is_peer_loss(exc):
        kind = "lost_peer"
    else:
        kind = "error"
    node, num_nodes = _int(env.get("GROUP_RANK")), _int(env.get("GROUP_WORLD_SIZE"))
    # "invalid syntax (train.py, line 3)": the place goes to where, as for any other error
    syntax = exc if isinstance(exc, SyntaxError) and exc.filename and exc.lineno else None
    report = Report(
        kind=kind,
        type=type(exc).__qualname__,
        message=_short_message(exc, sentence=kind == "lost_peer", text=syntax.msg if syntax else None),
        where=f"{os.path.basename(syntax.filename or '')}:{syntax.lineno}" if syntax else _where(tb),
        rank=_int(env.get("RANK")),
        local_rank=_int(env.get("LOCAL_RANK")),
        node=node,
        num_nodes=num_nodes,
        host=socket.gethostname(),
        pid=os.getpid(),
        time=time.time(),
    )
    if kind == "lost_peer":
        report.gone = _guess_gone(exc, node, num_nodes)
    report.brief = kind == "error" and _is_brief(exc, tb)
    return report


def _is_brief(exc: BaseException, tb: TracebackType | None) -> bool:
    """Whether ``exc``'s one line says it all: a syntax error, or an argument kiln refused.

    kiln raises ``ValueError`` (``ConfigError`` is one) and ``LaunchError`` for what it was given,
    naming the key, the value and the fix (STYLE.md 6); the user's frame that made the call is the
    report's ``where``. Only when kiln's own code raised it, not torch's or the user's below, and
    not ``raise ... from`` another error, whose traceback may be the story.
    """
    from kiln.launch.environments import LaunchError

    if isinstance(exc, SyntaxError):
        return True
    if not isinstance(exc, (ValueError, LaunchError)) or exc.__cause__ is not None or tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    kiln_root = os.path.join(str(Path(__file__).resolve().parents[1]), "")
    return os.path.realpath(tb.tb_frame.f_code.co_filename).startswith(kiln_root)


def write(report: Report, traceback_text: str, path: str | None = None) -> bool:
    """Write ``report`` to torchrun's error file for this worker (atomically); False without one."""
    path = path or os.environ.get(ERROR_FILE_ENV)
    if not path:
        return False
    data = {
        # torch's own format (torch.distributed.elastic.multiprocessing.errors): torchrun parses it
        "message": {
            "message": report.text(),
            "extraInfo": {"py_callstack": traceback_text, "timestamp": str(int(report.time))},
        },
        "kiln": asdict(report),
    }
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, target)
    return True


def publish(report: Report) -> None:
    """Add ``report`` to the job's c10d store, where ranks on other nodes read it (best effort)."""
    line = json.dumps(asdict(report)) + "\n"
    _with_store(lambda store: store.append(_store_key(), line))


def read_peer_failure(rank: int | None) -> dict[str, Any] | None:
    """The earliest report in the store of a rank other than ``rank`` that failed on its own."""

    def read(store: Any) -> list[dict[str, Any]]:
        if not store.check([_store_key()]):
            return []
        return [json.loads(line) for line in bytes(store.get(_store_key())).decode().splitlines() if line]

    reports = [r for r in _with_store(read) or [] if r.get("rank") != rank and r.get("kind") == "error"]
    return min(reports, key=lambda r: r.get("time", 0.0)) if reports else None


def _store_key() -> str:
    return _STORE_KEY.format(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _chain(exc: BaseException) -> Iterable[BaseException]:
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _int(value: str | None) -> int | None:
    return int(value) if value is not None and value.lstrip("-").isdigit() else None


def _short_message(exc: BaseException, sentence: bool, text: str | None = None) -> str:
    text = str(exc if text is None else text).strip()
    first = _SOURCE_PREFIX.sub("", text.splitlines()[0] if text else "")
    if sentence:  # gloo's "... by peer [127.0.0.1]:4242. This is typically caused by ..." : the first sentence
        first = first.split(". ", 1)[0].rstrip(".")
    return first if len(first) <= _MESSAGE_CHARS else first[: _MESSAGE_CHARS - 3] + "..."


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.add(str(Path(__file__).resolve().parents[1]))  # kiln itself: the user's line is more useful
    return tuple(os.path.join(os.path.realpath(r), "") for r in roots)


def _where(tb: TracebackType | None) -> str | None:
    """``file.py:line`` of the innermost frame in the user's code (else the innermost frame)."""
    frames = []
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    if not frames:
        return None
    roots = _library_roots()

    def user(filename: str) -> bool:
        return not filename.startswith("<") and not os.path.realpath(filename).startswith(roots)

    filename, line = next((f for f in reversed(frames) if user(f[0])), frames[-1])
    return f"{os.path.basename(filename)}:{line}"


def _guess_gone(exc: BaseException, node: int | None, num_nodes: int | None) -> str | None:
    """What went away, as far as this rank can tell without a report from it."""
    from kiln.launch.heartbeat import CollectiveTimeout

    local = _int(os.environ.get("LOCAL_WORLD_SIZE"))
    for error in _chain(exc):
        if isinstance(error, CollectiveTimeout) and error.missing and num_nodes and num_nodes > 1 and local:
            # torchrun numbers ranks node after node; a late rank of this node is not a node gone
            nodes = sorted({r // local for r in error.missing} - {node})
            return _plural("node", nodes) if nodes else None
    if num_nodes == 2 and node in (0, 1):
        return f"node {1 - node}"
    return "another node" if num_nodes and num_nodes > 1 else None  # one node: nothing went away, a rank did


def _with_store(work: Callable[[Any], Any]) -> Any:
    """``work(store)`` on a connection of its own to the default group's store, within a few seconds."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        # torch has no public accessor for the store a group was made with (heartbeat.py uses it too)
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: nothing to share
        return None
    result: list[Any] = []

    def run() -> None:
        try:
            own = store.clone()  # type: ignore[attr-defined]  # torch's stubs lack Store.clone
            own.set_timeout(timedelta(seconds=_STORE_SECONDS))
            result.append(work(own))
        except Exception:  # noqa: BLE001 - the store's host may be the node that went away
            pass

    # A thread: connecting to a host that vanished can block past the store's own timeout.
    thread = threading.Thread(target=run, name="kiln-failure-report", daemon=True)
    thread.start()
    thread.join(_STORE_SECONDS + 1)
    return result[0] if result else None


# ----------------------------------------------------------------------------- in the launcher


@dataclass
class Summary:
    """What the launcher prints for a failed attempt: ``traceback`` (if any), then ``line``.

    ``traceback`` is the one of the rank that failed on its own first, each line prefixed
    ``[rankN]: `` as torch prefixes a rank's traceback; None when that rank's report is brief,
    or when it left none (killed by a signal) or no rank failed on its own.
    """

    line: str
    traceback: str | None = None


@dataclass
class _Failure:
    """The part of torchrun's ``ProcessFailure`` that :func:`explain` reads."""

    pid: int
    exitcode: int
    timestamp: float
    error_file: str


@dataclass
class _Rank:
    rank: int
    pid: int
    exitcode: int
    timestamp: float
    report: Report | None
    traceback: str | None = None

    @property
    def kind(self) -> str:
        if self.report is not None:
            return self.report.kind
        # torchrun stops the surviving ranks with SIGTERM once one fails: those are not a cause
        return "stopped" if self.exitcode in (-signal.SIGTERM, -signal.SIGINT) else "error"

    @property
    def time(self) -> float:
        return self.report.time if self.report is not None else self.timestamp

    def how(self) -> str:
        if self.report is not None:
            return self.report.how()
        if self.exitcode < 0:
            try:
                return f"killed by {signal.Signals(-self.exitcode).name}"
            except ValueError:
                return f"killed by signal {-self.exitcode}"
        return f"exit code {self.exitcode}"


def read(error_file: str | None) -> Report | None:
    """kiln's report in a worker's error file (None: no file, or one written by something else)."""
    if not error_file or not os.path.isfile(error_file):
        return None
    try:
        data = json.loads(Path(error_file).read_text())
        return Report.from_dict(data["kiln"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_traceback(error_file: str | None) -> str | None:
    """The traceback a worker wrote into its error file (torch's ``py_callstack``), if any."""
    if not error_file or not os.path.isfile(error_file):
        return None
    try:
        text = json.loads(Path(error_file).read_text())["message"]["extraInfo"]["py_callstack"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return text if isinstance(text, str) and text.strip() else None


def _last_attempt(log_dir: str | os.PathLike[str]) -> list[Path]:
    files = sorted(Path(log_dir).glob("*/attempt_*/*/error.json"), key=lambda f: int(f.parts[-3].split("_")[1]))
    return [f for f in files if f.parts[-3] == files[-1].parts[-3]] if files else []


def find_reports(log_dir: str | os.PathLike[str]) -> list[Report]:
    """The reports of the last attempt under torchrun's ``--log-dir`` (``<run>/attempt_N/<local rank>/error.json``)."""
    return [r for r in map(read, map(str, _last_attempt(log_dir))) if r is not None and r.rank is not None]


def find_failures(log_dir: str | os.PathLike[str]) -> dict[int, _Failure]:
    """:func:`explain`'s input from the error files of the last attempt under ``log_dir`` alone,
    for when torchrun's agent ended on another error before it saw its workers fail."""
    found: dict[int, _Failure] = {}
    for path in _last_attempt(log_dir):
        report = read(str(path))
        if report is not None and report.rank is not None:
            found[report.rank] = _Failure(report.pid, 1, report.time, str(path))
    return found


def summarize(failures: Mapping[int, Any], single_node: bool = False) -> str:
    """One line from torchrun's failures (``ChildFailedError.failures``: rank -> ``ProcessFailure``).

    The rank that failed on its own first is named with its exception and ``file:line``; ranks
    that failed the same way, failed otherwise, lost their peer or were stopped follow, grouped.
    When every rank here only lost its peer, the line says which node went away (from the peer's
    report in the store).
    """
    return explain(failures, single_node).line


def explain(failures: Mapping[int, Any], single_node: bool = False) -> Summary:
    """:func:`summarize`'s line, with the traceback of the rank it names as failing first."""
    ranks = []
    for rank, f in sorted(failures.items()):
        error_file = getattr(f, "error_file", None)
        ranks.append(_Rank(rank, f.pid, f.exitcode, float(f.timestamp), read(error_file), read_traceback(error_file)))
    return _summary(ranks, single_node)


def summarize_reports(reports: Iterable[Report], single_node: bool = False) -> str | None:
    """:func:`summarize` from the workers' reports alone (torchrun's agent ended on another error
    before it saw its workers fail); None without reports."""
    ranks = [_Rank(r.rank, r.pid, 1, r.time, r) for r in reports if r.rank is not None]
    return _summary(sorted(ranks, key=lambda r: r.rank), single_node).line if ranks else None


def _summary(ranks: list[_Rank], single_node: bool) -> Summary:
    if not ranks:
        return Summary("the job failed, but torchrun reported no failing rank")
    host = next((r.report.host for r in ranks if r.report), socket.gethostname())
    node = next((r.report.node for r in ranks if r.report and r.report.node is not None), 0 if single_node else None)

    def who(r: _Rank) -> str:
        place = f"node {node}, " if node is not None else ""
        return f"rank {r.rank} ({place}host {host}, pid {r.pid})"

    own = [r for r in ranks if r.kind == "error"]
    lost = [r for r in ranks if r.kind == "lost_peer"]
    if own:
        first = min(own, key=lambda r: (r.time, r.rank))
        line = f"{who(first)} failed first: {first.how()}"
        # the same error on every rank (a misspelt strategy, a missing file) is one clause, not N
        by_how: dict[str, list[int]] = {}
        for r in sorted(own, key=lambda r: (r.time, r.rank)):
            if r is not first:
                by_how.setdefault(r.how(), []).append(r.rank)
        same = by_how.pop(first.how(), [])
        line += f"; {_group(same, 'failed the same way', 'failed the same way')}" if same else ""
        line += "".join(f"; {_group(numbers, 'also failed', 'also failed')}: {how}" for how, numbers in by_how.items())
        return Summary(line + _tail(ranks, skip=first), _traceback_of(first))
    if lost:
        first = min(lost, key=lambda r: (r.time, r.rank))
        peer = _first_peer(lost)
        if peer is not None and peer.node is not None and peer.node != node:
            line = (
                f"node {peer.node} (host {peer.host}) went away: its rank {peer.rank} (pid {peer.pid}) failed first: "
            )
            return Summary(line + peer.how() + _tail(ranks, where=" here"))
        if peer is not None:
            line = f"rank {peer.rank} (pid {peer.pid}) failed first: {peer.how()}"
            return Summary(line + _tail(ranks))
        # No rank's own failure is known: the others first, then this rank's error, whose text
        # (a heartbeat's "rank 1 did not arrive ...; last events: ...") ends the line.
        report = first.report
        assert report is not None  # lost_peer comes from a report
        gone = f"{report.gone} went away: " if report.gone else ""
        others = _tail(ranks, skip=first).removeprefix("; ")
        at = f" at {report.where}" if report.where else ""
        return Summary(f"{gone}{others + '; ' if others else ''}{who(first)} lost its peer{at}: {report.text()}")
    first = min(ranks, key=lambda r: (r.time, r.rank))
    line = f"{who(first)} {'was interrupted' if first.kind == 'interrupted' else 'ended first: ' + first.how()}"
    return Summary(line + _tail(ranks, skip=first))


def _traceback_of(first: _Rank) -> str | None:
    """``first``'s traceback as torch prints a rank's (``[rank1]: `` before each line); None when brief."""
    if first.traceback is None or first.report is None or first.report.brief:
        return None
    prefix = f"[rank{first.rank}]: "
    return "\n".join(prefix + line if line else line for line in first.traceback.rstrip("\n").split("\n"))


def _first_peer(lost: list[_Rank]) -> Report | None:
    peers = [Report.from_dict(r.report.peer) for r in lost if r.report is not None and r.report.peer]
    return min(peers, key=lambda p: p.time) if peers else None


def _tail(ranks: list[_Rank], skip: _Rank | None = None, where: str = "") -> str:
    """``; rank 0 lost its peer; ranks 2-3 were stopped`` for the ranks other than ``skip``."""
    words = {
        "lost_peer": ("lost its peer", "lost their peer"),
        "stopped": ("was stopped", "were stopped"),
        "interrupted": ("was interrupted", "were interrupted"),
    }
    parts = []
    for kind, (one, many) in words.items():
        numbers = [r.rank for r in ranks if r.kind == kind and r is not skip]
        if numbers:
            parts.append(_group(numbers, one, many) + where)
    return "".join(f"; {p}" for p in parts)


def _group(numbers: list[int], one: str, many: str) -> str:
    return f"{_plural('rank', numbers)} {one if len(numbers) == 1 else many}"


def _plural(noun: str, numbers: Iterable[int]) -> str:
    """``rank 3`` / ``ranks 0, 2-5``."""
    values = sorted(set(numbers))
    spans: list[str] = []
    start = prev = values[0]
    for v in [*values[1:], None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return f"{noun}{'s' if len(values) > 1 else ''} {', '.join(spans)}"


def print_line(text: str) -> None:
    """Write one whole line to stderr with one ``write`` (a kill between text and newline glues lines)."""
    try:
        os.write(sys.stderr.fileno(), (text + "\n").encode(errors="replace"))
    except (OSError, ValueError, AttributeError):
        print(text, file=sys.stderr, flush=True)
