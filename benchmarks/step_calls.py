"""Collectives and host reads per training step: a raw DDP loop, kiln's Engine and kiln's Trainer.

    python benchmarks/step_calls.py                     # launches itself on 2 processes (gloo on CPU)
    python benchmarks/step_calls.py --steps 12 --log-interval 4 --out result.json

Each rank trains one tiny MLP three times on the same per-rank batches: a raw
``DistributedDataParallel`` loop, the Engine loop of ``kiln.initialize`` and ``Trainer.fit`` with
the progress bar drawn (on a stream that says it is a terminal), the progress lines a log file
gets, a ``ConsoleLogger`` and a ``FileLogger``. Each loop runs inside :class:`StepCalls`, which counts per step:

* **collectives**: every c10d operation, seen by ``torch.profiler`` as the dispatcher op
  ``c10d::<op>``; so DDP's gradient all-reduce (issued from C++ by its reducer, one per bucket)
  and its bucket rebuild after the first step count as well as calls from Python. The calls made
  through ``torch.distributed``'s functions (all_reduce, broadcast, barrier, ``*_object``, ...) are
  also recorded with the kiln (or script) line that made them;
* **store operations** on the training thread (``set``, ``get``, ``add``, ``wait``, ...);
* **host reads**: a tensor's value read into Python (``item``, ``float()``/``int()``/``bool()``,
  ``tolist``, ``numpy``, ``cpu``, formatting) seen by a ``TorchFunctionMode`` on the training
  thread, with the line that made them.

Step k runs from the k-th batch fetched to the next one; the last step runs to the end of the
loop (``fit()``'s end included), and "setup" is what ran before the first batch. The summary is
printed by rank 0; ``--out`` writes every rank's counts as JSON. ``tests/test_step_calls.py``
asserts them.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[1]

# The functions of torch.distributed that talk to other ranks. Wrapping the module attributes
# records who called them (kiln and torchmetrics look them up at call time); the profiler counts
# every collective, whatever its caller.
COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_coalesced",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "barrier",
    "monitored_barrier",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
)
STORE_OPS = ("set", "get", "add", "compare_set", "wait", "check", "delete_key", "multi_get", "multi_set", "append")
# Tensor methods that hand a tensor's value to Python: on an accelerator each waits for the device.
HOST_READS = frozenset(
    {
        "item",
        "__float__",
        "__int__",
        "__bool__",
        "__index__",
        "__complex__",
        "tolist",
        "numpy",
        "cpu",
        "__format__",
        "__repr__",
        "__str__",
        "__array__",
        "equal",
        "allclose",
        "is_nonzero",
    }
)
_MARK = "step_calls.step:"
_HERE = str(Path(__file__).resolve())
_SKIP = (os.path.dirname(torch.__file__), os.path.dirname(threading.__file__), _HERE)


def call_site() -> str:
    """The innermost frame outside torch and the standard library: ``kiln/trainer/progress.py:48 (update)``."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_SKIP) and "site-packages" not in name:
            short = name.split("/src/kiln/")[-1]
            short = ("kiln/" + short) if short != name else os.path.basename(name)
            return f"{short}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "?"


class _HostReads(TorchFunctionMode):
    def __init__(self, on_read: Callable[[str], None]) -> None:
        super().__init__()
        self.on_read = on_read

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS or (name == "to" and _to_cpu(args, kwargs or {})):
            self.on_read(name)
        return func(*args, **(kwargs or {}))


def _to_cpu(args: tuple, kwargs: dict) -> bool:
    device = kwargs.get("device", args[1] if len(args) > 1 else None)
    return (
        isinstance(device, (str, torch.device))
        and torch.device(device).type == "cpu"
        and isinstance(args[0], torch.Tensor)
        and args[0].device.type != "cpu"
    )


class StepCalls:
    """Count collectives, store operations and host reads per training step.

    Example::

        with StepCalls() as calls:
            for x, y in batches:
                calls.next_step()
                ...
        calls.per_step()   # [{"step": "setup", ...}, {"step": 1, "collectives": {"c10d::allreduce_": 1}, ...}, ...]
    """

    def __init__(self) -> None:
        self.step = 0
        self.python_calls: list[tuple[int, str, str]] = []  # (step, function, site)
        self.store_ops: list[tuple[int, str, str]] = []
        self.host_reads: list[tuple[int, str, str]] = []
        self._c10d: list[tuple[int, str]] = []
        self._undo: list[Callable[[], None]] = []
        self._thread = threading.get_ident()

    def next_step(self) -> None:
        """A new step starts (call it when the step's batch is fetched)."""
        self.step += 1
        with record_function(f"{_MARK}{self.step}"):
            pass

    def wrap_batches(self, batches: list[Any]) -> Any:
        """``batches`` as an iterable that starts a step on every batch it hands out."""
        return _Marked(batches, self)

    # -- installing the counters -----------------------------------------------------------------
    def __enter__(self) -> StepCalls:
        for name in COLLECTIVES:
            if hasattr(dist, name):
                self._patch(dist, name, self._counted(getattr(dist, name), name, self.python_calls))
        for name in STORE_OPS:
            if hasattr(dist.Store, name):
                self._patch(dist.Store, name, self._counted(getattr(dist.Store, name), name, self.store_ops))
        self._profile = profile(activities=[ProfilerActivity.CPU])
        self._profile.__enter__()
        self._mode = _HostReads(lambda name: self.host_reads.append((self.step, name, call_site())))
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        self._profile.__exit__(*exc)
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        step = 0
        for event in sorted(self._profile.events(), key=lambda e: e.time_range.start):
            if event.name.startswith(_MARK):
                step = int(event.name[len(_MARK) :])
            elif event.name.startswith("c10d::"):
                self._c10d.append((step, event.name))

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        original = getattr(owner, name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, original))

    def _counted(self, original: Callable, name: str, into: list) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == self._thread:  # the heartbeat's thread publishes on its own clock
                into.append((self.step, name, call_site()))
            return original(*args, **kwargs)

        return counted

    # -- results ---------------------------------------------------------------------------------
    def per_step(self) -> list[dict[str, Any]]:
        """One entry per step ("setup" first): counts by operation, and the sites of the Python calls."""

        def at(records: list[tuple[int, str, str]], step: int) -> list[str]:
            return [f"{name} at {site}" for s, name, site in records if s == step]

        return [
            {
                "step": step or "setup",
                "collectives": dict(Counter(name for s, name in self._c10d if s == step)),
                "python_collectives": at(self.python_calls, step),
                "store_ops": at(self.store_ops, step),
                "host_reads": at(self.host_reads, step),
            }
            for step in range(self.step + 1)
        ]


class _Marked:
    def __init__(self, batches: list[Any], calls: StepCalls) -> None:
        self.batches, self.calls = batches, calls

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.batches:
            self.calls.next_step()
            yield batch


class TerminalStream(io.StringIO):
    """A text stream that says it is a terminal, so kiln's progress bar draws its tqdm bar into it."""

    def isatty(self) -> bool:
        return True


# -- the three loops ---------------------------------------------------------------------------------
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def _batches(steps: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        out.append((x, (x[:, 0] > 0).long()))
    return out


def raw_ddp(steps: int, rank: int) -> StepCalls:
    model = nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss()
    with StepCalls() as calls:
        for x, y in calls.wrap_batches(_batches(steps, rank)):
            opt.zero_grad(set_to_none=True)
            loss = crit(model(x), y)
            loss.backward()
            opt.step()
    return calls


def engine(steps: int, rank: int) -> StepCalls:
    import kiln

    model = _model()
    eng, *_ = kiln.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), config={})
    with StepCalls() as calls:
        for x, y in calls.wrap_batches(_batches(steps, rank)):
            eng.zero_grad()
            loss = eng.criterion(eng(x), y)
            eng.backward(loss)
            eng.step()
    return calls


def trainer(
    steps: int, epoch_batches: int, rank: int, log_interval: int, folder: str
) -> tuple[StepCalls, dict[str, Any]]:
    import kiln
    from kiln.loggers import ConsoleLogger, FileLogger

    model = _model()
    console = io.StringIO()
    calls = StepCalls()
    tr = kiln.Trainer(
        model,
        train_dataloader=calls.wrap_batches(_batches(epoch_batches, rank)),
        max_duration=f"{steps}ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=nn.CrossEntropyLoss(),
        log_interval=f"{log_interval}ba",
        loggers=[ConsoleLogger(stream=console), FileLogger(f"{folder}/metrics.jsonl")],
        console_interval="1h",  # lines at each tenth of the run only: the same steps on every machine
    )
    # progress_bar=True is the default; the bar draws only on a terminal, so it is given a stream
    # that says it is one; the lines a log file gets go to a stream that is not (a line at each tenth).
    bar = tr.progress.stream = TerminalStream()
    lines = tr.progress.console_stream = io.StringIO()
    with calls:
        tr.fit()
    tr.close()
    return calls, {
        "console": console.getvalue(),
        "bar": bar.getvalue(),
        "lines": lines.getvalue(),
        "bar_enabled": tr.progress.enabled,
        "bar_shows_logged": getattr(tr.progress, "logger", None) is tr.logger,
    }


def worker(args: argparse.Namespace) -> None:
    import kiln

    ctx = kiln.launch_from_torch(seed=0)
    with tempfile.TemporaryDirectory() as folder:
        loops = {"raw": raw_ddp(args.steps, ctx.rank), "engine": engine(args.steps, ctx.rank)}
        loops["trainer"], shown = trainer(args.steps, args.epoch_batches, ctx.rank, args.log_interval, folder)
        logged = Path(folder, "metrics.jsonl").read_text() if ctx.rank == 0 else ""
    result = {
        "rank": ctx.rank,
        "steps": args.steps,
        "epoch_batches": args.epoch_batches,
        "log_interval": args.log_interval,
        "logged": logged,
        **shown,
        "loops": {name: calls.per_step() for name, calls in loops.items()},
    }
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, f"rank{ctx.rank}.json").write_text(json.dumps(result, indent=1))
    if ctx.rank == 0:
        print(summary(result))
    dist.destroy_process_group()


def summary(result: dict[str, Any]) -> str:
    """Per loop: the steps grouped by what they did."""
    head = (
        f"rank {result['rank']}: {result['steps']} steps; the Trainer's epochs {result['epoch_batches']} batches, "
        f"log_interval {result['log_interval']}ba"
    )
    lines = [head]
    for name, steps in result["loops"].items():
        groups: dict[str, list[Any]] = {}
        for entry in steps:
            parts = [", ".join(f"{n} {op}" for op, n in sorted(entry["collectives"].items())) or "no collective"]
            parts += [f"{n} x {call}" for call, n in Counter(entry["python_collectives"]).items()]
            parts += [f"{n} x host read {read}" for read, n in Counter(entry["host_reads"]).items()]
            parts += [f"{n} x store {op}" for op, n in Counter(entry["store_ops"]).items()]
            groups.setdefault("; ".join(parts), []).append(entry["step"])
        lines.append(f"  {name}:")
        lines += [f"    {_steps_text(numbers)}: {what}" for what, numbers in groups.items()]
    return "\n".join(lines)


def _steps_text(steps: list[Any]) -> str:
    """``setup, steps 1, 3-5``."""
    words = [str(s) for s in steps if not isinstance(s, int)]
    numbers = [s for s in steps if isinstance(s, int)]
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    if runs:
        spans = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
        words.append(("steps " if len(numbers) > 1 else "step ") + spans)
    return ", ".join(words)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--epoch-batches", dest="epoch_batches", type=int, default=6, help="the Trainer's batches per epoch")
    p.add_argument("--log-interval", dest="log_interval", type=int, default=4)
    p.add_argument("--out", default=None, help="write each rank's counts as OUT/rank<r>.json")
    args = p.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return 0
    # Not under torchrun yet: launch this file on --nproc processes with `kiln run`.
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "kiln.cli.main", "run", "-n", str(args.nproc), __file__, *sys.argv[1:]]
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
