"""What ``kiln run`` starts in each worker: ``python -m kiln.launch.worker [-m] TARGET [ARGS ...]``.

Before the script's first line, three things, then the script exactly as ``python TARGET ARGS``
(or ``python -m TARGET ARGS``) would run it: its own ``__main__`` module, ``sys.argv``, and the
script's folder first on ``sys.path``.

1. The parent-death signal (:mod:`kiln.launch.parent_death`): the worker dies with ``kiln run``,
   even when that is killed with SIGKILL.
2. Ctrl-C: ``kiln run`` forwards SIGINT to every worker (torchrun does). The worker raises
   ``KeyboardInterrupt`` in the script as Python would, and from then on prints nothing: no
   traceback, and no second one from a collective that failed because a peer stopped first. The
   launcher prints the one line. A SIGINT that arrives while the process is already ending (in
   ``sys.excepthook``, in ``atexit``) is recorded, not raised, so it cannot interrupt the report.
3. The failure report (:mod:`kiln.launch.failures`): an uncaught exception is written, with its
   traceback, to torchrun's error file for the launcher's summary before anything is printed (a
   SIGTERM from torchrun in the meantime waits for it). Under ``kiln run`` the worker then prints
   nothing: the launcher prints the traceback of the rank that failed first, once, and one line
   (every rank of a job given a misspelt strategy fails the same way; 512 copies of one traceback
   say nothing the first does not). Started otherwise (``python -m kiln.launch.worker``), a rank
   that failed on its own prints its traceback as Python would; one that only lost its peer (or
   was interrupted) prints nothing either way. ``KILN_DEBUG=1`` prints every rank's.
4. A quick end after a failure: the launcher restarts or stops the job when this process has
   ended, and Python's final garbage collection of torch's objects takes 1-3 s of a loaded CPU
   (an elastic job stepping again after a node's death waits for it); so a rank that failed or
   exits with a non-zero status (a preempted run) freezes the collector at exit
   (:func:`_end_quickly`).

Tracebacks start at the script: the frames of this module and of runpy are left out.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib.util
import os
import signal
import sys
import threading
import traceback
import types
from collections.abc import Iterator
from typing import Any

from kiln.launch import failures, parent_death

__all__ = ["install", "main", "run_target"]

_interrupted = False
_previous_hook: Any = sys.__excepthook__


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv == ["-m"]:
        raise SystemExit("usage: python -m kiln.launch.worker [-m] TARGET [ARGS ...]")
    parent_death.arm()
    install()
    module = argv[0] == "-m"
    try:
        run_target(argv[1 if module else 0], argv[2 if module else 1 :], module=module)
    except SystemExit as exc:
        if exc.code not in (None, 0):  # e.g. a preempted run's 75, the agent stopping it to restart
            atexit.register(_end_quickly)
        raise


def install() -> None:
    """The SIGINT handler and the failure-reporting ``sys.excepthook`` (once, main thread only)."""
    global _previous_hook
    if sys.excepthook is _excepthook or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_interrupt)
    _previous_hook = sys.excepthook
    sys.excepthook = _excepthook


def run_target(target: str, args: list[str], module: bool = False) -> None:
    """Run ``target`` (a path, or a module with ``module=True``) as ``__main__`` with ``sys.argv[1:] = args``."""
    main_module = types.ModuleType("__main__")
    if module:
        spec = importlib.util.find_spec(target)
        if spec is not None and spec.submodule_search_locations is not None:  # a package: its __main__
            spec = importlib.util.find_spec(f"{target}.__main__")
        if spec is None or spec.loader is None:
            raise SystemExit(f"{sys.executable}: No module named {target}")
        code = spec.loader.get_code(spec.name)  # type: ignore[attr-defined]  # source and sourceless loaders
        main_module.__spec__ = spec
        main_module.__file__ = spec.origin
        main_module.__loader__ = spec.loader
        main_module.__package__ = spec.parent
        sys.argv = [spec.origin or target, *args]
    else:
        path = os.path.abspath(target)
        with open(path, "rb") as f:
            code = compile(f.read(), path, "exec", dont_inherit=True)
        main_module.__file__ = path
        main_module.__package__ = None
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.realpath(path))  # python puts the script's folder first
    main_module.__builtins__ = __builtins__  # type: ignore[attr-defined]
    # Stays installed after the script: pickles of its classes and multiprocessing's spawn find it.
    sys.modules["__main__"] = main_module
    _run(code, main_module.__dict__)


def _run(code: types.CodeType, namespace: dict[str, Any]) -> None:
    exec(code, namespace)  # the frame _inside_script() looks for


def _inside_script(frame: types.FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code is _run.__code__:
            return True
        frame = frame.f_back
    return False


def _on_interrupt(signum: int, frame: types.FrameType | None) -> None:
    global _interrupted
    _interrupted = True
    if _inside_script(frame):
        raise KeyboardInterrupt
    # else: the process is already ending (excepthook, atexit): let it finish quietly


def _excepthook(kind: type[BaseException], value: BaseException, tb: types.TracebackType | None) -> None:
    tb = _script_frames(tb, value)
    value.__traceback__ = tb  # Python's hook prints the exception's own traceback, not its tb argument
    try:
        with _sigterm_deferred():
            report = failures.describe(value, tb, interrupted=_interrupted)
            text = "".join(traceback.format_exception(kind, value, tb))
            written = failures.write(report, text)
            if report.kind == "error":
                failures.publish(report)  # before this process exits and its peers notice
            elif report.kind == "lost_peer":
                report.peer = failures.read_peer_failure(report.rank)
                written = failures.write(report, text)
    except Exception as exc:  # noqa: BLE001 - the report must never hide the error itself
        report, written = None, False
        failures.print_line(f"kiln: could not write the failure report: {type(exc).__name__}: {exc}")
    # Ctrl-C, or a peer that vanished: the launcher's summary line says it, once; and under
    # kiln run the launcher prints the first failure's traceback from the error file just written
    launcher_prints = written and os.environ.get(failures.LAUNCHER_PRINTS_ENV) == "1"
    quiet = report is not None and (report.kind in ("interrupted", "lost_peer") or launcher_prints)
    if not quiet or os.environ.get("KILN_DEBUG") == "1":
        _previous_hook(kind, value, tb)
    atexit.register(_end_quickly)  # registered last, so it runs first of the exit handlers


def _end_quickly() -> None:
    """Skip the interpreter's last cyclic garbage collection over torch's objects.

    Finalisation collects every generation before it clears the modules: on 2 loaded cores that
    walk over the million or so objects torch creates took 1-3 s of the 3-4 s between a peer's
    death and torchrun seeing this rank exit (measured with gdb in ``gc_collect_main``), time an
    elastic restart waits for. Frozen objects are left out of that walk; they are still freed by
    reference counting when the modules are cleared, and Python never promised finalizers of
    objects alive at exit anyway. Only a rank that failed or exits non-zero does this: a
    successful exit is as Python makes it.
    """
    gc.freeze()


def _script_frames(tb: types.TracebackType | None, value: BaseException | None = None) -> types.TracebackType | None:
    """``tb`` without its leading frames of this module and runpy (all of it if nothing is left,
    but for the script's own syntax error, which Python shows without frames: ``File "x.py", line 3``)."""
    start = tb
    while start is not None and _is_bootstrap(start.tb_frame.f_code.co_filename):
        start = start.tb_next
    return start if start is not None or isinstance(value, SyntaxError) else tb


def _is_bootstrap(filename: str) -> bool:
    return filename == __file__ or "runpy" in os.path.basename(filename)


@contextlib.contextmanager
def _sigterm_deferred() -> Iterator[None]:
    """Hold a SIGTERM (torchrun stopping this rank after a peer failed) until the report is written."""
    received: list[int] = []
    try:
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if received:
            if previous == signal.SIG_DFL:
                os.kill(os.getpid(), signal.SIGTERM)
            elif callable(previous):
                previous(signal.SIGTERM, None)


if __name__ == "__main__":
    main()
