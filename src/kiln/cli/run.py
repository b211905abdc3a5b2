"""`kiln run -n N [torchrun options] script.py [args]`: torch.distributed.run underneath.

kiln spawns nothing itself: it translates its short form into torchrun's arguments and runs
torchrun's agent in this process, so elastic restarts, rendezvous and signal handling are torch's.
Each worker is ``python -m kiln.launch.worker script.py args`` (:mod:`kiln.launch.worker`), which
runs the script unchanged after arming what torchrun lacks:

* Stopping. Every worker dies with this process, whatever ends it (SIGKILL included: the
  parent-death signal). Ctrl-C reaches every worker through torchrun, which waits for them; the
  workers print nothing and this process prints one line and exits 130 (128 + the signal).
* Failures. A script that does not compile is one line before any worker starts. Each failed
  worker leaves a report and its traceback in its error file and prints nothing
  (:mod:`kiln.launch.failures`); this process prints the traceback of the rank that failed on its
  own first, once, then one line naming that rank, its exception, message and ``file:line``, with
  the other ranks grouped (failed the same way, lost their peer, were stopped), at any world size.
  An argument kiln refused (``strategy="ddpp"``) is that line alone, at the user's line that made
  the call. Ranks that only lost their peer are never blamed, and in a multi-node job the
  surviving node says which node went away. torch's own lines that the summary replaces (closing
  signals, "failed (exitcode ...)") are left out. With ``--redirects``/``--tee`` (or
  ``KILN_DEBUG=1``) each failed rank prints its own traceback, into its log, as before.
* Restarts (``--max-restarts``): the same traceback and line for the attempt that failed, naming
  the rank that died first and how (``killed by SIGKILL``, as the OOM killer leaves it), then the
  restart.
* Preemption. SIGUSR1 (SLURM's warning ahead of a time limit) is passed on to the workers, which
  torchrun does not do; workers that checkpointed and exited with the preemption status (75) are
  said to have been preempted, and this process exits 75 too.
* Elastic jobs (``--nnodes MIN:MAX``): fast rendezvous settings, a store per rendezvous round
  (:func:`run`), and a line for each node that leaves or joins.
* Goodput. At the end (whatever the exit status) one line with the run's goodput account, over all
  its launches: ``kiln run: goodput 81.2% of 14.3 s over 2 launches: ...``. The workers' rank 0
  writes the path of its account (``goodput.json`` in the save folder, see :mod:`kiln.report.goodput`)
  into a file named by ``KILN_GOODPUT_POINTER``, which this process sets; with no account (no
  Trainer, ``goodput=False``, neither a local save folder nor a File logger, or rank 0 on another
  node) nothing is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["add_parser", "torchrun_args", "run", "describe_failure"]

WORKER_MODULE = "kiln.launch.worker"


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
    p.add_argument(
        "--rdzv-conf",
        "--rdzv_conf",
        dest="rdzv_conf",
        default=None,
        help="rendezvous settings KEY=VALUE,...; for MIN:MAX jobs they override kiln's fast defaults "
        f"({_ELASTIC_RDZV_CONF})",
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
        conf = rdzv_conf(args.nnodes, args.rdzv_conf)
        if conf:
            out.append(f"--rdzv-conf={conf}")
        # The c10d rendezvous numbers the nodes itself and ignores --node-rank (torch warns):
        # it is passed only to the static rendezvous, which needs it.
        if args.node_rank is not None and (args.rdzv_endpoint is None or args.rdzv_backend == "static"):
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
    # every worker starts in kiln's bootstrap, which runs the script (or module) unchanged
    out += ["--module", WORKER_MODULE, *(["-m"] if args.module else [])]
    return [*out, args.script, *args.script_args]


# Rendezvous settings of an elastic (MIN:MAX) job, in seconds. torch's defaults take ~47 s from a
# node's death to the next step on the nodes left: 15 s before the dead node's heartbeat expires
# (keep_alive_interval 5 x keep_alive_max_attempt 3), then a 30 s last call for nodes to join the
# smaller group. Here a node is declared dead after 3 missed heartbeats of 1 s: not 2, because an
# agent sends one only when its last is a whole interval old, so on torch's 1 s timer they come 1
# to 2 s apart, and with 2 a live node's agent was declared dead here (its own job split in two).
# The last call waits 2 s: the nodes left notice a loss within a second of each other (their
# workers fail at once) and nodes started together meet well within it; a node that misses it is
# taken in by a restart. torch takes whole seconds. A user's --rdzv-conf key wins.
_ELASTIC_RDZV_CONF = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=2,close_timeout=5"


def is_elastic(nnodes: str) -> bool:
    """Whether ``--nnodes`` lets the number of nodes change while the job runs (``MIN:MAX``, MIN < MAX)."""
    low, _, high = str(nnodes).partition(":")
    return bool(high) and low != high


def rdzv_conf(nnodes: str, user: str | None) -> str | None:
    """The --rdzv-conf for torchrun: kiln's fast defaults under the user's keys for MIN:MAX jobs."""
    pairs = dict(item.split("=", 1) for item in _ELASTIC_RDZV_CONF.split(",")) if is_elastic(nnodes) else {}
    for item in (user or "").split(","):
        if item.strip():
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--rdzv-conf item {item!r} is not KEY=VALUE (e.g. last_call_timeout=10)")
            pairs[key.strip()] = value.strip()
    return ",".join(f"{k}={v}" for k, v in pairs.items()) or None


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    if not args.module and not Path(args.script).is_file():
        print(
            f"kiln run: script {args.script!r} does not exist (pass a Python file, or -m for a module)", file=sys.stderr
        )
        return 2
    if not args.module:
        # Found here in a moment, not by N workers after importing torch (~20 s), each with a traceback
        error = compile_error(args.script)
        if error is not None:
            print(f"kiln run: {error}; no worker was started", file=sys.stderr)
            return 1
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
    from kiln.launch.parent_death import PARENT_PID_ENV

    os.environ[PARENT_PID_ENV] = str(os.getpid())  # the workers' parent: see kiln.launch.parent_death
    if is_elastic(args.nnodes):
        # torch's agents share one store with the workers by default, created by the first
        # round's rank-0 node; when a node joins later the rounds disagree about it (a new node
        # given rank 0 starts a store of its own, the others keep theirs: every worker then hangs
        # connecting to peers that are not there; pytorch/pytorch#135712). torch's own switch
        # gives each round a store of its own, hosted by its rank 0 worker.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if "OMP_NUM_THREADS" not in os.environ and args.nproc_per_node != "1":
        # what torchrun does for several workers per node, without its four-line banner about it
        os.environ["OMP_NUM_THREADS"] = "1"
    from kiln.launch.failures import LAUNCHER_PRINTS_ENV

    # The workers' tracebacks go to their error files and this process prints the first one;
    # with --redirects/--tee a rank's log is where its traceback belongs, so each prints its own.
    # Set for torchrun's workers only: this process (a test, kiln train) may start others after.
    tracebacks = args.redirects is None and args.tee is None and os.environ.get("KILN_DEBUG") != "1"
    saved = os.environ.pop(LAUNCHER_PRINTS_ENV, None)
    if tracebacks:
        os.environ[LAUNCHER_PRINTS_ENV] = "1"
    _quiet_replaced_torch_lines()
    # Without a folder of the user's, one of our own: the workers' error files are found there even
    # when torchrun's agent ends on another error, and it is removed afterwards (torch leaves a
    # torchelastic_* folder). The user's is left as torchrun leaves it.
    ours = args.log_dir is None and args.redirects is None and args.tee is None
    log_dir = tempfile.mkdtemp(prefix="kiln-run-") if ours else None
    pointer = _goodput_pointer()
    try:
        if log_dir is not None:
            argv = torchrun_args(argparse.Namespace(**{**vars(args), "log_dir": log_dir}))
        return _launch(argv, log_dir, _single_node(args), tracebacks, lambda: _print_goodput(pointer[0]))
    finally:
        _goodput_pointer(pointer)
        if log_dir is not None:
            shutil.rmtree(log_dir, ignore_errors=True)
        os.environ.pop(LAUNCHER_PRINTS_ENV, None)
        if saved is not None:
            os.environ[LAUNCHER_PRINTS_ENV] = saved


def _goodput_pointer(made: tuple[str, str | None] | None = None) -> tuple[str, str | None]:
    """Make (or, given what it made, remove) the file into which the workers' rank 0 writes the
    path of its goodput account (:mod:`kiln.report.goodput`); set for the workers only."""
    from kiln.report.goodput import POINTER_ENV

    if made is not None:
        with contextlib.suppress(OSError):
            os.unlink(made[0])
        if made[1] is None:
            os.environ.pop(POINTER_ENV, None)
        else:
            os.environ[POINTER_ENV] = made[1]
        return made
    fd, path = tempfile.mkstemp(prefix="kiln-goodput-", suffix=".txt")
    os.close(fd)
    saved = os.environ.get(POINTER_ENV)
    os.environ[POINTER_ENV] = path
    return path, saved


def _print_goodput(pointer: str) -> None:
    line = goodput_line(pointer)
    if line is not None:
        from kiln.launch.failures import print_line

        print_line(line)


def goodput_line(pointer: str) -> str | None:
    """``kiln run: goodput 81.2% of 14.3 s over 2 launches: ...`` from the account whose path rank 0
    wrote into ``pointer``; None when it wrote none (no Trainer, ``goodput=False``, no save folder
    nor File logger, or rank 0 ran on another node)."""
    from kiln.report.goodput import read_account, summary_line

    try:
        with open(pointer, encoding="utf-8") as f:
            account = f.read().strip()
    except OSError:
        return None
    launches = read_account(account) if account else []
    return f"kiln run: {summary_line(launches, account)}" if launches else None


def compile_error(script: str) -> str | None:
    """``SyntaxError: invalid syntax (train.py:3)`` when ``script`` does not compile; None when it does.

    Compiled as the worker compiles it (:func:`kiln.launch.worker.run_target`), named as the user
    gave it on the command line.
    """
    import warnings

    try:
        with open(script, "rb") as f:
            source = f.read()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a SyntaxWarning: each worker shows it, as python would
            compile(source, script, "exec", dont_inherit=True)
    except SyntaxError as exc:
        where = f"{exc.filename or script}:{exc.lineno}" if exc.lineno else exc.filename or script
        return f"{type(exc).__name__}: {exc.msg} ({where})"
    except (ValueError, OSError) as exc:  # null bytes in the source (3.11); an unreadable file
        return f"{type(exc).__name__}: {exc} ({script})"
    return None


def _single_node(args: argparse.Namespace) -> bool:
    return str(args.nnodes) in ("1", "1:1")


def _launch(
    argv: list[str],
    log_dir: str | None,
    single_node: bool,
    tracebacks: bool = False,
    before_last: Callable[[], None] = lambda: None,
) -> int:
    """torchrun's agent in this process; the exit status, after one line on failure or a signal
    (after the first failed rank's traceback too, with ``tracebacks``: the workers printed none).
    ``before_last`` runs before that closing line (or at the end of a job that succeeded): the
    goodput line, so the line that says how the job ended stays the last."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    from kiln.launch.failures import explain, find_failures, print_line

    _ElasticNews.install(log_dir, single_node, tracebacks)  # after torch's import, which sets its loggers' levels
    forwarding = _forward_sigusr1()
    try:
        # torchrun's run(), not its @record main(): that would log the failing rank's error file
        # (its whole traceback) once more
        torchrun(parse_args(argv))
    except SystemExit as exc:  # torchrun exits with the workers' status
        before_last()
        return int(exc.code or 0)
    except SignalException as exc:  # torchrun forwarded the signal and waited for every worker
        name = exc.sigval.name + (" (Ctrl-C)" if exc.sigval == signal.SIGINT else "")
        before_last()
        print_line(f"kiln run: stopped by {name}; every worker has ended")
        return 128 + int(exc.sigval)
    except Exception as exc:  # noqa: BLE001 - one line, not torch's traceback
        # A worker failed (ChildFailedError), possibly hidden behind the error of the rendezvous
        # shutdown that followed it; or the agent ended on another error (the node hosting the
        # rendezvous store went away) after stopping workers that left their reports.
        failed = next((e for e in _chain(exc) if isinstance(e, ChildFailedError)), None)
        if failed is not None and _preempted(failed):
            from kiln.checkpoint.preemption import PREEMPTED_EXIT_CODE

            before_last()
            print_line(
                f"kiln run: preempted: the workers saved a checkpoint and exited {PREEMPTED_EXIT_CODE}; "
                "the same command resumes from it (autoresume)"
            )
            return PREEMPTED_EXIT_CODE
        found = getattr(failed, "failures", None) or (find_failures(log_dir) if log_dir is not None else None)
        if found:
            before_last()
            print_summary(explain(found, single_node), tracebacks)
            return 1
        if os.environ.get("KILN_DEBUG") == "1":
            raise
        before_last()
        print_line(f"kiln run: {describe_failure(failed or exc)} (KILN_DEBUG=1 shows the traceback)")
        return 1
    finally:
        if forwarding is not None:
            signal.signal(signal.SIGUSR1, forwarding)
    before_last()
    return 0


def print_summary(summary: Any, tracebacks: bool, after: str = "") -> None:
    """The traceback (with ``tracebacks``) and the ``kiln run:`` line of a
    :class:`kiln.launch.failures.Summary`, in one write: nothing of another process lands between."""
    from kiln.launch.failures import print_line

    line = f"kiln run: {summary.line}{after}"
    print_line(f"{summary.traceback}\n{line}" if tracebacks and summary.traceback else line)


def _preempted(failed: Any) -> bool:
    """Whether the workers ended preempted: some exited with kiln's preemption status (their
    checkpoint committed) and the rest too, or by the SIGTERM the agent sent once the first left."""
    from kiln.checkpoint.preemption import PREEMPTED_EXIT_CODE

    codes = {getattr(f, "exitcode", None) for f in (getattr(failed, "failures", None) or {}).values()}
    return PREEMPTED_EXIT_CODE in codes and codes <= {PREEMPTED_EXIT_CODE, -signal.SIGTERM}


def _forward_sigusr1() -> Any:
    """Pass SIGUSR1 on to the workers; returns the handler it replaced (None if not installed).

    SLURM's warning ahead of the time limit (``#SBATCH --signal=USR1@120``) reaches the task that
    ``srun`` started, this process; torchrun's agent forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT
    to its workers but not SIGUSR1, whose default action would end this process (and with it the
    workers, unsaved). The workers, in sessions of their own, are this process's children.
    """
    if threading.current_thread() is not threading.main_thread():
        return None

    def forward(signum: int, frame: Any) -> None:
        for pid in _children(os.getpid()):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:  # ended meanwhile
                pass

    return signal.signal(signal.SIGUSR1, forward)


def _children(parent: int) -> list[int]:
    """The pids whose parent is ``parent``, from /proc (none where there is no /proc)."""
    found: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()  # after the command name, which may hold spaces
        except OSError:
            continue
        if len(fields) > 1 and fields[1] == str(parent):
            found.append(int(entry))
    return found


def _chain(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    error: BaseException | None = exc
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def describe_failure(exc: BaseException, single_node: bool = False) -> str:
    """One line naming the rank that failed first and how, from torchrun's ``ChildFailedError``
    (see :func:`kiln.launch.failures.summarize`); other errors as ``Type: message (cause)``."""
    from kiln.launch.failures import summarize

    failures = getattr(exc, "failures", None)
    if failures:
        return summarize(failures, single_node=single_node)
    line = _first_line(exc)
    return line if exc.__cause__ is None else f"{line} ({_first_line(exc.__cause__)})"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


# Lines of torch's elastic agent that the summary line replaces (by their format strings).
_REPLACED = (
    "Sending process %s closing signal %s",
    "Received %s death signal, shutting down workers",
    "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
)


class _Replaced(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in _REPLACED


def _quiet_replaced_torch_lines() -> None:
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Replaced) for f in logger.filters):
            logger.addFilter(_Replaced())


class _ElasticNews(logging.Filter):
    """One line from the agent's own log records when the worker group restarts: which rank failed
    first and how (or which node went away), after its traceback, the restart, nodes waiting to
    join, and the world size the job continues with when it changed. torch logs these at INFO,
    below what it shows by default."""

    _FAILED = "[%s] Worker group %s. %s/%s attempts left; will restart worker group"
    _JOINING = "[%s] Detected %s new nodes from group_rank=%s; will restart worker group"
    _AGENT = "torch.distributed.elastic.agent.server.api"
    # The failures the agent saw last (rank -> ProcessFailure, exit status and error file), kept by
    # _remember_failures: the restart record does not carry them, and the error files alone miss a
    # rank killed by a signal (the OOM killer's SIGKILL leaves none), naming instead its peer.
    failures: dict[int, Any] = {}  # one agent per process

    def __init__(self, log_dir: str | None, single_node: bool, shown: int, tracebacks: bool) -> None:
        super().__init__()
        self.log_dir, self.single_node, self.shown, self.tracebacks = log_dir, single_node, shown, tracebacks
        self.world: tuple[int, int] | None = None  # (nodes, processes) of the last rendezvous

    @classmethod
    def install(cls, log_dir: str | None, single_node: bool, tracebacks: bool = False) -> None:
        import torch.distributed.elastic.agent.server.api  # noqa: F401 - its import sets the logger's level

        logger = logging.getLogger(cls._AGENT)
        for old in [f for f in logger.filters if isinstance(f, cls)]:
            logger.removeFilter(old)
        logger.addFilter(cls(log_dir, single_node, logger.getEffectiveLevel(), tracebacks))
        logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))
        _remember_failures()

    def filter(self, record: logging.LogRecord) -> bool:
        from kiln.launch.failures import explain, find_failures, print_line

        args: Any = record.args
        try:
            if record.msg == self._FAILED:
                _, state, left, most = args
                found = self.failures or (find_failures(self.log_dir) if self.log_dir else {})
                summary = explain(found, self.single_node) if found else None
                restart = f"; restarting the workers ({int(left) - 1} of {most} restarts left after this one)"
                if summary is None:
                    print_line(f"kiln run: the worker group is {state}{restart}")
                else:
                    print_summary(summary, self.tracebacks, after=restart)
            elif record.msg == self._JOINING:
                joined = int(args[1])
                print_line(
                    f"kiln run: {_count(joined, 'node')} joined; "
                    f"restarting the workers to take {'it' if joined == 1 else 'them'} in"
                )
            elif str(record.msg).startswith("[%(role)s] Rendezvous complete") and isinstance(args, dict):
                sizes = args.get("global_world_sizes") or [0]
                world = (int(args["group_world_size"]), int(sizes[0]))
                if self.world is not None and world != self.world:
                    print_line(
                        f"kiln run: the job continues on {_count(world[0], 'node')}, world size {world[1]} "
                        f"(was {_count(self.world[0], 'node')}, world size {self.world[1]})"
                    )
                self.world = world
        except Exception:  # noqa: BLE001, S110 - news must never stop the agent
            pass
        return record.levelno >= self.shown


def _remember_failures() -> None:
    """Keep what torch's agent found when it last looked at its workers in ``_ElasticNews.failures``.

    ``LocalElasticAgent._monitor_workers`` returns the failures (by global rank) to a loop that
    logs the restart without them; torch has no hook for them, so its method is wrapped, in this
    process only (kiln run's own). Without the method (another torch), the restart line is made
    from the workers' error files alone.
    """
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monitor = getattr(LocalElasticAgent, "_monitor_workers", None)
    if monitor is None or getattr(monitor, "_kiln_remembers", False):
        return

    def _monitor_workers(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = monitor(self, *args, **kwargs)
        _ElasticNews.failures = dict(getattr(result, "failures", None) or {})
        return result

    _monitor_workers._kiln_remembers = True  # type: ignore[attr-defined]  # a mark, so it is wrapped once
    LocalElasticAgent._monitor_workers = _monitor_workers  # type: ignore[method-assign]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"
