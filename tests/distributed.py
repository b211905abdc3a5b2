"""Launch real worker processes for multi-process tests (gloo on CPU)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).parent / "workers"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), str(ROOT / "examples"), str(WORKERS), env.get("PYTHONPATH", "")]
    )
    env["OMP_NUM_THREADS"] = "1"
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
    """`kiln run -n nproc script args` in a subprocess; returns the completed process."""
    cmd = [sys.executable, "-m", "kiln.cli.main", "run", "-n", str(nproc), *(extra or []), str(script), *args]
    return subprocess.run(
        cmd, env={**base_env(), **(env or {})}, capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


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
