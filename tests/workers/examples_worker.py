"""Several example scripts in turn in ONE process group (a job of N ranks of examples_worker.py SPEC),
each as its own `kiln run -n N <script> <args>` would run it: tests/test_examples.py's and
tests/test_migrate.py's one job.

SPEC is a JSON file: ``{"out": folder, "scripts": [{"name": ..., "path": ..., "argv": [...]}]}``.
Each script is loaded from its path under a module name of its own (not as ``__main__``, so its
``if __name__ == "__main__"`` block stays idle) and its ``main()`` called with ``sys.argv`` set to
``[path, *argv]``, from the working directory out/<name>, with this rank's stdout and stderr (file
descriptors 1 and 2: print, the dist logger's handler, C++ warnings) going to out/<name>/rank<r>.out
and .err; out/<name>/rank<r>.done marks a script that returned. The torch import, the process group
and DDP's first construction (torch._dynamo's import) are paid once per rank, not once per script.
A script that raises stops the job (its traceback is in its .err file); the scripts before it keep
their results.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path


@contextlib.contextmanager
def _as_its_own_run(folder: Path, rank: int, argv: list[str]):
    """Working directory folder, sys.argv argv, file descriptors 1 and 2 into folder/rank<r>.out and .err."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2), os.getcwd(), sys.argv
    with open(folder / f"rank{rank}.out", "w") as out, open(folder / f"rank{rank}.err", "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        os.chdir(folder)
        sys.argv = argv
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            os.chdir(saved[2])
            sys.argv = saved[3]


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank = int(os.environ["RANK"])
    for index, script in enumerate(spec["scripts"]):
        folder = Path(spec["out"]) / script["name"]
        folder.mkdir(parents=True, exist_ok=True)
        with _as_its_own_run(folder, rank, [script["path"], *script.get("argv", [])]):
            try:
                name = f"example_{index}_{script['name']}"
                loader = importlib.util.spec_from_file_location(name, script["path"])
                module = sys.modules[name] = importlib.util.module_from_spec(loader)
                loader.loader.exec_module(module)
                module.main()
            except BaseException:
                traceback.print_exc()
                raise
        (folder / f"rank{rank}.done").touch()


def one_job(out: Path, scripts: list[dict], **run_args):
    """For a test: run ``scripts`` (dicts of name, path, argv) in one job of this file under ``out``
    (its ranks forked by tests/distributed.py's fork_run, whose nproc, env and timeout it takes).
    Returns the job and a function of a script's name that gives its working directory and its
    ranks' stdout and stderr (rank 0's first), as its own launch would have printed them; it fails, naming the script and showing its
    output, when the script did not return on every rank."""
    from distributed import fork_run

    spec = out / "spec.json"
    spec.write_text(json.dumps({"out": str(out), "scripts": scripts}))
    job = fork_run(__file__, str(spec), cwd=out, **run_args)
    ranks = range(run_args.get("nproc", 2))

    def result(name: str) -> tuple[Path, str, str]:
        folder = out / name
        stdout, stderr = ("".join(_read(folder / f"rank{r}.{kind}") for r in ranks) for kind in ("out", "err"))
        assert all((folder / f"rank{r}.done").exists() for r in ranks), (
            f"{name} did not return on every rank (the job exited {job.returncode})\n"
            f"its stdout:\n{stdout[-3000:]}\nits stderr:\n{stderr[-4000:]}\n"
            f"the job's stdout:\n{job.stdout[-2000:]}\nthe job's stderr:\n{job.stderr[-4000:]}"
        )
        return folder, stdout, stderr

    return job, result


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


if __name__ == "__main__":
    main()
