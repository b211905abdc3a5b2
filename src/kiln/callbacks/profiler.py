"""ProfilerCallback: ``torch.profiler`` over chosen batches of ``fit()``, with traces for TensorBoard
and Chrome and a memory timeline."""

from __future__ import annotations

import os
import shutil
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.core.callback import Callback

if TYPE_CHECKING:
    from kiln.core.state import State

__all__ = ["ProfilerCallback"]


class ProfilerCallback(Callback):
    """Profile some batches of ``fit()`` with ``torch.profiler`` (Composer's ``Profiler``).

    The schedule counts the batches of each ``fit()`` (``torch.profiler.schedule``): the first
    ``skip_first`` are skipped, then each cycle waits ``wait`` batches, warms up ``warmup`` and
    records ``active``; ``repeat`` cycles (0: until the run ends). The profiler steps at each
    ``BATCH_END``, so a recorded step is one batch from the end of the previous one (data loading,
    forward, backward, optimizer step, callbacks, evaluation when it falls there). At the end of each
    recorded cycle, in ``trace_folder``:

    * ``tensorboard``: ``rank<r>.<ns>.pt.trace.json``, the format of TensorBoard's profiler plugin
      (``tensorboard --logdir <trace_folder>`` with ``torch-tb-profiler``);
    * ``chrome``: ``chrome/rank<r>-ba<batch>.json``, a Chrome trace (``chrome://tracing``,
      https://ui.perfetto.dev), ``<batch>`` being the cycle's last batch;
    * ``memory``: ``memory/rank<r>-ba<batch>.html`` (``.json`` without matplotlib), torch's memory
      timeline by category (parameters, gradients, optimizer state, activations, ...). On the CPU
      it charts the CPU allocator (``device="cpu"``); on a GPU, that GPU. It needs shapes, memory
      and stacks recorded, which ``memory=True`` turns on. torch marks ``export_memory_timeline``
      deprecated in favour of CUDA memory snapshots, which have no CPU form; kiln keeps it for that.

    Args:
        trace_folder: where the traces go (created on the first trace).
        skip_first, wait, warmup, active, repeat: the schedule, in batches.
        chrome, tensorboard, memory: which files to write (see above).
        record_shapes, profile_memory, with_stack: what the profiler records (``memory=True`` sets
            all three).
        ranks: the ranks that profile (``None``: all; each writes its own files).
        **profiler_kwargs: passed on to ``torch.profiler.profile`` (``activities``, ``with_flops``, ...).

    Example::

        profiler = kiln.callbacks.ProfilerCallback("runs/prof", wait=1, warmup=1, active=3)
        trainer = kiln.Trainer(model, ..., callbacks=[profiler])   # traces of batches 3-5
    """

    def __init__(
        self,
        trace_folder: str | os.PathLike[str] = "profiler_traces",
        *,
        skip_first: int = 0,
        wait: int = 0,
        warmup: int = 1,
        active: int = 4,
        repeat: int = 1,
        chrome: bool = True,
        tensorboard: bool = True,
        memory: bool = False,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        ranks: Sequence[int] | None = None,
        **profiler_kwargs: Any,
    ) -> None:
        for name, value, least in (
            ("skip_first", skip_first, 0),
            ("wait", wait, 0),
            ("warmup", warmup, 0),
            ("active", active, 1),
            ("repeat", repeat, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"ProfilerCallback {name}={value!r} must be an integer >= {least} (batches)")
        if not (chrome or tensorboard or memory):
            raise ValueError("ProfilerCallback writes nothing with chrome=tensorboard=memory=False; enable one")
        self.trace_folder = Path(trace_folder)
        self.schedule_args = {"skip_first": skip_first, "wait": wait, "warmup": warmup, "active": active}
        self.schedule_args["repeat"] = repeat
        self.chrome, self.tensorboard, self.memory = chrome, tensorboard, memory
        self.profiler_kwargs = {
            "record_shapes": record_shapes or memory,
            "profile_memory": profile_memory or memory,
            "with_stack": with_stack or memory,
            **profiler_kwargs,
        }
        self.ranks = None if ranks is None else set(ranks)
        self.traces: list[Path] = []
        """Every file written so far."""
        self._profiler: Any = None
        self._state: Any = None

    def fit_start(self, state: State, logger: Any) -> None:
        if self.ranks is not None and state.rank not in self.ranks:
            return
        from torch import profiler

        activities = [profiler.ProfilerActivity.CPU]
        if state.device.type == "cuda":
            activities.append(profiler.ProfilerActivity.CUDA)
        kwargs = dict(self.profiler_kwargs)
        self._state = state
        self._profiler = profiler.profile(
            activities=kwargs.pop("activities", activities),
            schedule=profiler.schedule(**self.schedule_args),
            on_trace_ready=self._trace_ready,
            **kwargs,
        )
        self._profiler.start()

    def batch_end(self, state: State, logger: Any) -> None:
        if self._profiler is not None:
            self._profiler.step()

    def fit_end(self, state: State, logger: Any) -> None:
        self._stop()

    def close(self, state: State, logger: Any) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.stop()  # a cycle still recording is written now

    def _trace_ready(self, prof: Any) -> None:
        state = self._state
        rank, batch = state.rank, state.timestamp.batch.value
        folder = self.trace_folder
        folder.mkdir(parents=True, exist_ok=True)
        # A profile's trace can be exported once: the Chrome trace is a copy of the TensorBoard one.
        trace = None
        if self.tensorboard:
            trace = folder / f"rank{rank}.{time.time_ns()}.pt.trace.json"  # tensorboard_trace_handler's naming
            prof.export_chrome_trace(str(trace))
            self.traces.append(trace)
        if self.chrome:
            chrome = folder / "chrome" / f"rank{rank}-ba{batch}.json"
            chrome.parent.mkdir(exist_ok=True)
            if trace is not None:
                shutil.copyfile(trace, chrome)
            else:
                prof.export_chrome_trace(str(chrome))
            self.traces.append(chrome)
        if self.memory:
            self.traces.append(self._memory_timeline(prof, folder / "memory", f"rank{rank}-ba{batch}", state))

    @staticmethod
    def _memory_timeline(prof: Any, folder: Path, name: str, state: Any) -> Path:
        import importlib.util

        folder.mkdir(exist_ok=True)
        html = importlib.util.find_spec("matplotlib") is not None  # the HTML chart is drawn with matplotlib
        path = folder / f"{name}.{'html' if html else 'json'}"
        device = state.device
        device_name = "cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}"
        with warnings.catch_warnings():
            # Deprecated for CUDA memory snapshots, which cannot chart the CPU: see the class docstring.
            warnings.filterwarnings("ignore", message=".*export_memory_timeline.*", category=FutureWarning)
            prof.export_memory_timeline(str(path), device=device_name)
        return path
