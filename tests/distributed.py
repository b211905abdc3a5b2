"""Launch real worker processes for multi-process tests (gloo on CPU)."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from kiln.launch.environments import SLURM_PORT_BASE, SLURM_PORT_SPAN

ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).parent / "workers"


# Rendezvous ports: below Linux's ephemeral range (32768-60999), where no connection's local port
# and no port-0 server (torchrun --standalone, gloo) lands, and above the ports kiln derives from a
# SLURM job id (tests/test_launch_join.py); split into one block per pytest-xdist worker (gw0, gw1,
# ...), so two workers' tests are never handed the same port, and each port handed out once per
# session. The walk through a block starts at an offset from the pid, so another pytest on the same
# machine (another checkout) tends to be elsewhere; a port something else holds is passed over.
_PORTS = range(SLURM_PORT_BASE + SLURM_PORT_SPAN, 32768)
_next_port: list[int] = []


def free_port() -> int:
    """A port on 127.0.0.1 that is free now and that no other test of this session is handed."""
    worker = os.environ.get("PYTEST_XDIST_WORKER") or "gw0"
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    size = len(_PORTS) // max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1), index + 1)
    first = _PORTS.start + index * size
    if not _next_port:
        _next_port.append(os.getpid() % size)
    for _ in range(size):
        port = first + _next_port[0] % size
        _next_port[0] += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # held by something else, or still in TIME_WAIT
                continue
        return port
    raise RuntimeError(f"no free port in {first}-{first + size - 1} for pytest-xdist worker {worker}")


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), str(ROOT / "examples"), str(WORKERS), env.get("PYTHONPATH", "")]
    )
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no pool of compile workers (tests/conftest.py)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def kiln_run(
    script: str | Path,
    *args: str,
    nproc: int = 2,
    timeout: float = 180,
    extra: list[str] | None = None,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
) -> subprocess.CompletedProcess:
    """`kiln run -n nproc script args` in a subprocess; returns the completed process.

    Past ``timeout`` it fails with the launch's process tree (state and kernel wait channel of the
    launcher, each rank and their loader workers) and the output so far, then kills the whole tree:
    a hang is diagnosable from the failure alone, and no rank outlives the test."""
    cmd = [sys.executable, "-m", "kiln.cli.main", "run", "-n", str(nproc), *(extra or []), str(script), *args]
    proc = subprocess.Popen(
        cmd, env={**base_env(), **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun starts each rank in a session of its own: the tree is found by parent pid
        pids = _descendants(proc.pid)
        tree = subprocess.run(
            ["ps", "-ww", "-o", "pid,ppid,stat,wchan:24,etime,args", "-p", ",".join(map(str, pids))],
            capture_output=True,
            text=True,
        ).stdout
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        out, err = proc.communicate()
        raise AssertionError(
            f"{' '.join(cmd[3:])} did not finish within {timeout} s; its processes then:\n{tree}\n"
            f"stdout:\n{out[-3000:]}\nstderr:\n{err[-6000:]}"
        ) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@contextlib.contextmanager
def lighthouse_job(min_replicas: int, heartbeat_timeout: float = 5) -> Iterator[tuple[str, list[subprocess.Popen]]]:
    """`kiln lighthouse` (torchft's) on a free port, quiet, for a job of replica groups: yields its
    address and a list for the groups' processes; at the end, kills the groups still running and
    stops the lighthouse."""
    port = free_port()
    cmd = [sys.executable, "-m", "kiln.cli.main", "lighthouse", "--min-replicas", str(min_replicas)]
    cmd += ["--port", str(port), "--join-timeout", "5", "--heartbeat-timeout", str(heartbeat_timeout)]
    cmd += ["--quorum-tick", "0.05"]
    lighthouse = subprocess.Popen(cmd, env=base_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    groups: list[subprocess.Popen] = []
    try:
        yield f"http://127.0.0.1:{port}", groups
    finally:
        for proc in groups:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        lighthouse.send_signal(signal.SIGTERM)
        lighthouse.wait(timeout=30)


def _descendants(root: int) -> list[int]:
    """``root`` and every process below it, parents first."""
    children: dict[int, list[int]] = {}
    for line in subprocess.run(["ps", "-eo", "pid,ppid"], capture_output=True, text=True).stdout.splitlines()[1:]:
        pid, ppid = map(int, line.split())
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        found.append(pid)
        todo += children.get(pid, [])
    return found


def run_ranks(
    script: str | Path, env_for_rank, nproc: int = 2, args: tuple[str, ...] = (), timeout: float = 120
) -> list[subprocess.CompletedProcess]:
    """Start `nproc` python processes of `script`, rank r with the variables env_for_rank(r)."""
    procs = []
    for rank in range(nproc):
        env = {**base_env(), **{k: str(v) for k, v in env_for_rank(rank).items()}}
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


def check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, (
        f"exit {result.returncode}\nstdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
    )
    return result


# -- ranks forked from a warm process ------------------------------------------------------------
# A `kiln run -n 2` costs ~10 CPU-s before the first line of the script on this 2-core machine: the
# launcher's interpreter and torch (1.6 s), then in each rank torch (1.3 s), torch._dynamo (1.1 s,
# which DistributedDataParallel.__init__ imports) and kiln. Tests whose subject is what the ranks
# compute (strategies against one process, resume, checkpoints), not how they were started, fork
# their ranks from a server that imported all that once per pytest worker (multiprocessing's
# forkserver), with torchmetrics (2 s: it imports transformers and scipy when they are installed)
# and transformers' llama (1.5 s), which many workers build, and what pipelines (torch.export, 0.5 s)
# and ZeRO (torch.distributed.optim, 0.7 s) import when first used, and the digits examples' sklearn.
# Each rank is still a process of its own, in a real gloo group, running the script under
# kiln.launch.worker as `kiln run` would; the
# launcher itself is tested by the launch tests, which keep `kiln_run`. A test that checks what a
# fresh process has NOT imported needs a process of its own (tests/test_quiet_imports.py).
_FORK_PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "torch.distributed.fsdp",
                 "torch.distributed.tensor", "torch.distributed.checkpoint", "kiln", "kiln.trainer",
                 "kiln.launch.worker", "kiln.cli.main", "torchmetrics", "transformers.models.llama.modeling_llama",
                 "torch.export._trace", "torch.distributed.pipelining", "torch.distributed.optim",
                 "torch.distributed.checkpoint.state_dict", "sklearn.datasets", "distributed"]  # fmt: skip


@functools.cache
def _forkserver():
    """The forkserver context, its server started (once per pytest worker)."""
    import multiprocessing
    import multiprocessing.forkserver

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_FORK_PRELOAD)
    # The server starts with this environment: the tests' import path (the server imports this
    # module to run _fork_rank) and one OpenMP thread, which libgomp reads when torch loads.
    saved = dict(os.environ)
    os.environ.update({"PYTHONPATH": base_env()["PYTHONPATH"] + os.pathsep + str(Path(__file__).parent),
                       "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"})  # fmt: skip
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return context


def _fork_rank(argv: list[str], worker: bool, env: dict[str, str], out: str, err: str, cwd: str | None) -> None:
    """In a rank forked from the server: the environment, cwd and output files of a fresh process,
    then ``python -m kiln.launch.worker ARGV`` when ``worker`` (as `kiln run` starts a rank), else
    ``python ARGV``; exits with the status that process would have (0, the script's SystemExit
    code, 1 after an uncaught exception)."""
    import atexit
    import multiprocessing
    import runpy

    # The server's child was prepared as a forkserver child, which made forkserver the default
    # start method: a DataLoader's workers would then re-run the script as their __main__.
    multiprocessing.set_start_method("fork", force=True)
    os.environ.clear()
    os.environ.update(env)
    for path, fd in ((out, 1), (err, 2)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(file, fd)
        os.close(file)
    if cwd is not None:
        os.chdir(cwd)
    sys.path[1:1] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or 1))
    from kiln.launch import worker as kiln_worker

    code = 0
    try:
        if worker:
            kiln_worker.main(argv)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as the interpreter would (through kiln's worker hook)
        sys.excepthook(*sys.exc_info())
        code = 1
    atexit._run_exitfuncs()  # the interpreter's exit (kiln's teardown of the group), which os._exit skips
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _fork_job(
    argv: list[str], worker: bool, envs: list[dict[str, str]], timeout: float, cwd: str | Path | None
) -> tuple[list[subprocess.CompletedProcess], int | None]:
    """One process per environment (see _fork_rank), forked from the server; each rank's status and
    output, and the rank that failed first (None when none did).

    As torchrun's agent does, once a rank has failed the others are stopped (SIGTERM, then SIGKILL
    after 10 s) rather than left waiting in a collective for their peer. Past ``timeout`` it fails
    with the output so far."""
    import multiprocessing.connection
    import tempfile

    context = _forkserver()
    with tempfile.TemporaryDirectory(prefix="kiln-fork-") as folder:
        procs = []
        for rank, env in enumerate(envs):
            env = {k: v for k, v in env.items() if k != "KILN_RUN_PID"}  # parent_death: the server is the parent
            files = (os.path.join(folder, f"{rank}.out"), os.path.join(folder, f"{rank}.err"))
            where = None if cwd is None else str(cwd)
            proc = context.Process(target=_fork_rank, args=(argv, worker, env, *files, where))
            proc.start()
            procs.append((proc, files))
        deadline, stop_at, first_failed = time.monotonic() + timeout, None, None
        while any(proc.exitcode is None for proc, _ in procs) and time.monotonic() < deadline:
            multiprocessing.connection.wait([proc.sentinel for proc, _ in procs if proc.exitcode is None], 0.5)
            # 75: the rank checkpointed after a preemption signal and left; its peers agree on the same
            # step and leave with 75 on their own (stopping them could turn a saved exit into -15)
            failed = [rank for rank, (proc, _) in enumerate(procs) if proc.exitcode not in (None, 0, 75)]
            if stop_at is None and failed:
                first_failed = failed[0]  # the job's status: the cause, not the peers stopped for it
                stop_at = time.monotonic() + 10
                for proc, _ in procs:
                    if proc.exitcode is None:
                        proc.terminate()
            if stop_at is not None and time.monotonic() > stop_at:
                break
        late = [rank for rank, (proc, _) in enumerate(procs) if proc.exitcode is None and stop_at is None]
        for proc, _ in procs:
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        results = []
        for proc, (out, err) in procs:
            with open(out, errors="replace") as o, open(err, errors="replace") as e:
                results.append(subprocess.CompletedProcess(["fork", *argv], proc.exitcode, o.read(), e.read()))
    if late:
        raise AssertionError(
            f"{' '.join(argv)} did not finish within {timeout} s (ranks {late} killed)\n"
            f"stdout:\n{''.join(r.stdout for r in results)[-3000:]}\n"
            f"stderr:\n{''.join(r.stderr for r in results)[-6000:]}"
        )
    return results, first_failed


def fork_run(
    script: str | Path,
    *args: str,
    nproc: int = 2,
    timeout: float = 180,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    module: bool = False,
) -> subprocess.CompletedProcess:
    """What ``kiln_run(script, *args, nproc=...)`` returns for a job that runs to its end, with the
    ranks forked from the warm server (each under kiln.launch.worker, with torchrun's variables;
    ``module``: ``script`` is a module, as ``kiln run -m``):
    returncode 0 when every rank exited 0, else the status of the rank that failed first (a rank that
    exits 75, preempted and checkpointed, stops no peer); stdout and
    stderr each rank's in rank order."""
    port, common = str(free_port()), {**base_env(), **(env or {})}
    envs = [
        {
            **common,
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }  # fmt: skip
        for r in range(nproc)
    ]
    argv = [*(["-m"] if module else []), str(script), *args]
    results, first_failed = _fork_job(argv, True, envs, timeout, cwd)
    code = (
        next((r.returncode for r in results if r.returncode), 0)
        if first_failed is None
        else results[first_failed].returncode
    )
    return subprocess.CompletedProcess(
        [f"fork_run -n {nproc}", str(script), *args], code, "".join(r.stdout for r in results),
        "".join(r.stderr for r in results),
    )  # fmt: skip


def fork_train(*argv: str, nproc: int = 2, **kwargs) -> subprocess.CompletedProcess:
    """``kiln train ARGV --nproc-per-node NPROC`` after its relaunch: each rank runs ``kiln train
    ARGV`` (kiln.cli.train relaunches itself as ``kiln run -n NPROC -m kiln.cli.main train ARGV``),
    forked from the warm server. ``kwargs``: fork_run's timeout, env, cwd."""
    return fork_run("kiln.cli.main", "train", *argv, nproc=nproc, module=True, **kwargs)


def fork_ranks(
    script: str | Path, env_for_rank, nproc: int = 2, args: tuple[str, ...] = (), timeout: float = 120
) -> list[subprocess.CompletedProcess]:
    """``run_ranks`` with the ranks forked from the warm server: ``python script args`` in each,
    rank r with the variables env_for_rank(r)."""
    envs = [{**base_env(), **{k: str(v) for k, v in env_for_rank(rank).items()}} for rank in range(nproc)]
    return _fork_job([str(script), *args], False, envs, timeout, None)[0]


class ForkedRank:
    """One rank forked from the warm server and left running: ``python -m kiln.launch.worker CMD``
    (as `kiln run` starts a rank, torchrun's variables in ``env``) in ``cwd``, its output in the files
    ``out`` and ``err``; for drills that start, wait for and signal processes one by one (the
    torchft groups and their Lighthouse, where how they start is not under test)."""

    def __init__(self, cmd: list[str], env: dict[str, str], out: Path, err: Path, cwd: Path | None = None) -> None:
        env = {k: v for k, v in env.items() if k != "KILN_RUN_PID"}  # parent_death: the server is the parent
        where = None if cwd is None else str(cwd)
        self._proc = _forkserver().Process(target=_fork_rank, args=(cmd, True, env, str(out), str(err), where))
        self._proc.start()

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None while it still runs after ``timeout`` seconds."""
        self._proc.join(timeout)
        return self._proc.exitcode

    def stop(self, sig: int) -> None:
        """Send ``sig``; SIGKILL if it still runs 30 s later."""
        if self._proc.exitcode is None:
            os.kill(self._proc.pid, sig)
            self._proc.join(30)
        if self._proc.exitcode is None:
            self._proc.kill()
            self._proc.join()


class ForkedWorker:
    """A process forked from the pytest worker's warm server (what fork_run's ranks are),
    ``python -m kiln.launch.worker CMD`` as `kiln run` starts a rank (with torchrun's variables in
    ``env`` where a drill gives them), with the Popen calls a drill makes. For drills of what
    processes do (die, stop, heal), not of how they start: a fresh interpreter's imports cost ~6
    CPU-s (tests/test_fault_tolerance.py, tests/test_fault_tolerance_kill.py)."""

    def __init__(self, cmd: list[str], env: dict[str, str], out: Path, err: Path) -> None:
        env = {k: v for k, v in env.items() if k != "KILN_RUN_PID"}  # parent_death: the server is the parent
        self._proc = _forkserver().Process(target=_fork_rank, args=(cmd, True, env, str(out), str(err), None))
        self._proc.start()
        self.pid = self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(str(self.pid), timeout)
        return self._proc.exitcode

    def kill(self) -> None:
        if self._proc.exitcode is None:
            self._proc.kill()
            self._proc.join()

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)
