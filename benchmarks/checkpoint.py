"""Checkpoint throughput and training stall, kiln vs ``torch.save`` of the same state, in one process.

    python benchmarks/checkpoint.py [--params 100e6] [--rounds 3] [--folder /tmp/kiln-ckpt-bench]

Model: a stack of square Linear layers with ~``--params`` parameters, after one AdamW step (so
the optimizer holds exp_avg and exp_avg_sq: 3x the parameter bytes in all). Median and best of
``--rounds`` interleaved rounds; MB = 1e6 bytes of model + optimizer tensors. Loads read files the
page cache still holds, for kiln and torch alike.

- save: ``torch.save(state_dict)`` (no fsync, as users call it), ``torch.save`` + fsync, and kiln
  ``save_checkpoint`` sharded (DCP write, fsync, sha256 of every file, manifest, atomic rename);
- load: ``torch.load(weights_only=True)`` + ``load_state_dict``, and kiln ``load_checkpoint``
  (sha256 verification included, then with ``verify=False``);
- stall: how long a training step is blocked by a checkpoint, ``CheckpointSaver`` synchronous vs
  ``save_async=True`` (the blocked time is staging to CPU memory; the rest overlaps training).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import kiln
from kiln.checkpoint import CheckpointSaver, load_checkpoint, save_checkpoint


def build(params: float, seed: int = 0):
    torch.manual_seed(seed)
    width = 2048
    layers = max(1, round(params / (width * width + width)))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine = kiln.Engine(model, optimizer, nn.MSELoss())
    state = kiln.State(model, optimizers=[optimizer])
    state.engine = engine
    return state, width


def step(state, width: int) -> None:
    engine = state.engine
    x = torch.randn(4, width)
    engine.zero_grad()
    engine.backward(engine.criterion(engine(x), x))
    engine.step()
    state.timestamp.advance_batch(4)


def tensor_bytes(state) -> int:
    sd = {"model": state.model.state_dict(), "optimizer": state.engine.optimizer.state_dict()}
    total = 0
    for part in (sd["model"].values(), (v for s in sd["optimizer"]["state"].values() for v in s.values())):
        total += sum(t.numel() * t.element_size() for t in part if isinstance(t, torch.Tensor))
    return total


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(cases: dict, rounds: int) -> dict[str, list[float]]:
    """Each round runs every case once, so a disk that is busier for a while (a shared machine)
    slows all of them alike instead of whichever happened to run then."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            times[name].append(timed(fn))
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", type=float, default=100e6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--folder", default="/tmp/kiln-ckpt-bench")
    args = p.parse_args()
    root = Path(args.folder)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    state, width = build(args.params)
    step(state, width)
    size = tensor_bytes(state)
    n_params = sum(p.numel() for p in state.model.parameters())
    mb = size / 1e6
    print(
        f"model: {n_params / 1e6:.1f}M parameters, model + AdamW state {mb:.0f} MB, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    )

    plain = root / "plain.pt"

    def torch_save(sync: bool) -> None:
        sd = {"model": state.model.state_dict(), "optimizer": state.engine.optimizer.state_dict()}
        with open(plain, "wb") as f:
            torch.save(sd, f)
            if sync:
                f.flush()
                os.fsync(f.fileno())

    def kiln_save() -> None:
        state.timestamp.advance_batch(0)  # a new step, so a new ep{E}-ba{B} folder, as in training
        save_checkpoint(root / "kiln", state)

    results = interleaved(
        {
            "torch.save": lambda: torch_save(False),
            "torch.save + fsync": lambda: torch_save(True),
            "kiln sharded save": lambda: kiln_save(),
        },
        args.rounds,
    )
    fresh, _ = build(args.params, seed=1)

    def torch_load() -> None:
        sd = torch.load(plain, weights_only=True)
        fresh.model.load_state_dict(sd["model"])
        fresh.engine.optimizer.load_state_dict(sd["optimizer"])

    results.update(
        interleaved(
            {
                "torch.load + load_state_dict": torch_load,
                "kiln load (sha256 verified)": lambda: load_checkpoint(root / "kiln" / "last", fresh),
                "kiln load (verify=False)": lambda: load_checkpoint(root / "kiln" / "last", fresh, verify=False),
            },
            args.rounds,
        )
    )
    print(f"{'':<32} {'median':>9} {'MB/s':>7}   {'best':>7} {'MB/s':>7}")
    for name, times in results.items():
        med, low = statistics.median(times), min(times)
        print(f"{name:<32} {med:7.2f} s {mb / med:7.0f}   {low:5.2f} s {mb / low:7.0f}")

    # -- the training stall: seconds the step loop is blocked by one checkpoint --------------
    step_time = min(timed(lambda: step(state, width)) for _ in range(args.rounds))
    for save_async in (False, True):
        folder = root / ("async" if save_async else "sync")
        saver = CheckpointSaver(folder, interval="1ba", save_async=save_async, preemption_signals=())
        saver.run_event(kiln.Event.FIT_START, state, None)
        stalls = []
        for _ in range(args.rounds):
            step(state, width)
            start = time.perf_counter()
            saver.save(state)
            stalls.append(time.perf_counter() - start)
            overlapped = time.perf_counter()
            while saver._pending is not None and not saver._pending.done():
                step(state, width)  # training goes on while the files are written
            overlapped = time.perf_counter() - overlapped
        saver.run_event(kiln.Event.FIT_END, state, None)
        kind = "save_async=True" if save_async else "synchronous"
        extra = f"; the write then overlapped {overlapped:.1f} s of training" if save_async else ""
        stall = statistics.median(stalls)
        print(
            f"stall per checkpoint, {kind:<16} median {stall:5.2f} s = {stall / step_time:5.1f} training steps "
            f"of {step_time * 1e3:.0f} ms (best {min(stalls):.2f} s{extra})"
        )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
