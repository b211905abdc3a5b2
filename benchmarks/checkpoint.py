"""Checkpoint throughput and training stall, kiln vs ``torch.save`` of the same state, in one process.

    python benchmarks/checkpoint.py [--params 100e6] [--rounds 3] [--folder /tmp/kiln-ckpt-bench] [--no-s3]

Model: a stack of square Linear layers with ~``--params`` parameters, after one AdamW step (so
the optimizer holds exp_avg and exp_avg_sq: 3x the parameter bytes in all). Median and best of
``--rounds`` interleaved rounds; MB = 1e6 bytes of model + optimizer tensors.

Every save writes new files, as training does (``ckpt-<step>.pt`` for torch, ``ep{E}-ba{B}/`` for
kiln), and the previous one is deleted outside the timed region, for both alike: overwriting one
file again and again is cheaper than writing new ones on most filesystems, and would flatter torch.

- save: ``torch.save(state_dict)`` (no fsync, as users call it), ``torch.save`` + fsync, and kiln
  ``save_checkpoint`` sharded (DCP write with checksums taken while writing, fsync, manifest,
  atomic rename, ``last``);
- load: ``torch.load(weights_only=True)`` + ``load_state_dict``, and kiln ``load_checkpoint``
  (every file's checksum verified, then with ``verify=False``); from the page cache, and cold:
  the files dropped from the page cache first (``posix_fadvise(DONTNEED)``, no root needed), as
  a resume on a restarted machine reads them;
- stall: how long a training step is blocked by a checkpoint, ``CheckpointSaver`` synchronous vs
  ``save_async=True`` (the blocked time is staging to CPU memory; the rest overlaps training);
- the same against a local S3 server (moto on 127.0.0.1, when ``moto[server]`` and ``s3fs`` are
  installed): ``torch.save`` to memory + one PUT, ``torch.load`` of one GET, kiln to ``s3://``.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import socket
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import kiln
from kiln.checkpoint import CheckpointSaver, layout, load_checkpoint, save_checkpoint


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


def interleaved(cases: dict, rounds: int, between=None) -> dict[str, list[float]]:
    """Each round runs every case once, so a disk that is busier for a while (a shared machine)
    slows all of them alike instead of whichever happened to run then. ``between()`` runs untimed
    after each case (deleting the previous checkpoint)."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            times[name].append(timed(fn))
            if between is not None:
                between()
    return times


class Bench:
    """One storage's measurements: save and load cases, printed with MB/s and ratios."""

    def __init__(self, state, fresh, mb: float, rounds: int) -> None:
        self.state, self.fresh, self.mb, self.rounds = state, fresh, mb, rounds
        self.results: dict[str, list[float]] = {}

    def sd(self):
        return {"model": self.state.model.state_dict(), "optimizer": self.state.engine.optimizer.state_dict()}

    def apply(self, sd) -> None:
        self.fresh.model.load_state_dict(sd["model"])
        self.fresh.engine.optimizer.load_state_dict(sd["optimizer"])

    def kiln_save(self, folder) -> None:
        self.state.timestamp.advance_batch(0)  # a new step, so a new ep{E}-ba{B} folder, as in training
        save_checkpoint(folder, self.state)

    def report(self, title: str, ratios: list[tuple[str, str]]) -> None:
        print(f"\n{title}")
        print(f"{'':<34} {'median':>9} {'MB/s':>7}   {'best':>7} {'MB/s':>7}")
        for name, times in self.results.items():
            med, low = statistics.median(times), min(times)
            print(f"{name:<34} {med:7.2f} s {self.mb / med:7.0f}   {low:5.2f} s {self.mb / low:7.0f}")
        for kiln_case, torch_case in ratios:
            tk, tt = statistics.median(self.results[kiln_case]), statistics.median(self.results[torch_case])
            # per round too: the two ran back to back, under the same load on a shared machine
            pairs = [t / k for k, t in zip(self.results[kiln_case], self.results[torch_case])]
            print(
                f"  {kiln_case} vs {torch_case}: {tt / tk:4.2f}x the throughput "
                f"(median; per round {', '.join(f'{p:.2f}' for p in pairs)})"
            )


def local_disk(bench: Bench, root: Path) -> None:
    saves = {"n": 0}

    def torch_save(sync: bool) -> None:
        saves["n"] += 1
        with open(root / f"ckpt-{saves['n']}.pt", "wb") as f:
            torch.save(bench.sd(), f)
            if sync:
                f.flush()
                os.fsync(f.fileno())

    def forget_old() -> None:  # keep only the newest of each, as a run with retention 1 does
        plain = sorted(root.glob("ckpt-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
        for p in plain[:-1]:
            p.unlink()
        layout.apply_retention(root / "kiln", 1)

    bench.results = interleaved(
        {
            "torch.save": lambda: torch_save(False),
            "torch.save + fsync": lambda: torch_save(True),
            "kiln sharded save": lambda: bench.kiln_save(root / "kiln"),
        },
        bench.rounds,
        forget_old,
    )
    newest = max(root.glob("ckpt-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    last = (root / "kiln" / "last").resolve()

    def torch_load(cold: bool = False) -> None:
        if cold:
            evict([newest])
        bench.apply(torch.load(newest, weights_only=True))

    def kiln_load(cold: bool = False, verify: bool = True) -> None:
        if cold:
            evict(p for p in last.iterdir() if p.is_file())
        load_checkpoint(last, bench.fresh, verify=verify)

    bench.results.update(
        interleaved(
            {
                "torch.load + load_state_dict": torch_load,
                "kiln load (checksums verified)": kiln_load,
                "kiln load (verify=False)": lambda: kiln_load(verify=False),
                "cold: torch.load + load_state_dict": lambda: torch_load(cold=True),
                "cold: kiln load (verified)": lambda: kiln_load(cold=True),
            },
            bench.rounds + 1,  # the first round pays for memory the process has not touched yet
        )
    )
    for times in bench.results.values():
        if len(times) > bench.rounds:
            del times[0]
    bench.report(
        f"local disk ({root})",
        [
            ("kiln sharded save", "torch.save + fsync"),
            ("kiln load (checksums verified)", "torch.load + load_state_dict"),
            ("cold: kiln load (verified)", "cold: torch.load + load_state_dict"),
        ],
    )


def evict(files) -> None:
    """Drop ``files`` from the page cache, so the next read comes from the disk (untimed: the timer
    starts before, but this takes microseconds; the files were fsynced, so nothing is written)."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def s3(bench: Bench) -> str | None:
    """The same on a local S3 server; returns the bucket URL (None when moto or s3fs is missing)."""
    try:
        import s3fs  # noqa: F401
        from moto.server import ThreadedMotoServer
    except ImportError:
        print("\nS3: skipped (pip install 'moto[server]' s3fs)")
        return None
    import logging

    from kiln.checkpoint.storage import as_path

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    bucket = as_path("s3://bench")
    bucket.fs.mkdir("bench")
    plain = bucket / "plain.pt"

    def torch_put() -> None:
        buffer = io.BytesIO()
        torch.save(bench.sd(), buffer)
        plain.write_bytes(buffer.getvalue())

    bench.results = interleaved(
        {"torch.save + PUT": torch_put, "kiln sharded save to s3://": lambda: bench.kiln_save("s3://bench/kiln")},
        bench.rounds,
        lambda: layout.apply_retention("s3://bench/kiln", 1),
    )
    bench.results.update(
        interleaved(
            {
                "GET + torch.load + load_state_dict": lambda: bench.apply(
                    torch.load(io.BytesIO(plain.read_bytes()), weights_only=True)
                ),
                "kiln load from s3:// (verified)": lambda: load_checkpoint("s3://bench/kiln", bench.fresh),
            },
            bench.rounds,
        )
    )
    bench.report(
        f"S3 (moto on 127.0.0.1:{port}; the server keeps objects in memory)",
        [
            ("kiln sharded save to s3://", "torch.save + PUT"),
            ("kiln load from s3:// (verified)", "GET + torch.load + load_state_dict"),
        ],
    )
    return "s3://bench"


def stalls(state, width: int, rounds: int, folders: dict[str, str]) -> None:
    """Seconds the step loop is blocked by one checkpoint, sync vs async, on each storage."""
    step_time = min(timed(lambda: step(state, width)) for _ in range(rounds))
    print(f"\nstall per checkpoint (a training step takes {step_time * 1e3:.0f} ms)")
    for where, folder in folders.items():
        for save_async in (False, True):
            saver = CheckpointSaver(
                f"{folder}/{'async' if save_async else 'sync'}",
                interval="1ba",
                save_async=save_async,
                num_checkpoints_to_keep=1,
                preemption_signals=(),
            )
            saver.run_event(kiln.Event.FIT_START, state, None)
            blocked, overlapped = [], 0.0
            for _ in range(rounds):
                step(state, width)
                start = time.perf_counter()
                saver.save(state)
                blocked.append(time.perf_counter() - start)
                start = time.perf_counter()
                while saver._pending is not None and not saver._pending.done():
                    step(state, width)  # training goes on while the files are written
                overlapped = time.perf_counter() - start
            saver.run_event(kiln.Event.FIT_END, state, None)
            stall = statistics.median(blocked)
            kind = "save_async=True" if save_async else "synchronous"
            extra = f"; the write then overlapped {overlapped:.1f} s of training" if save_async else ""
            print(
                f"  {where:<10} {kind:<16} median {stall:5.2f} s = {stall / step_time:5.1f} steps "
                f"(best {min(blocked):.2f} s{extra})"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", type=float, default=100e6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--folder", default="/tmp/kiln-ckpt-bench")
    p.add_argument("--no-s3", action="store_true", help="skip the local S3 server")
    args = p.parse_args()
    root = Path(args.folder)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    state, width = build(args.params)
    step(state, width)
    mb = tensor_bytes(state) / 1e6
    n_params = sum(p.numel() for p in state.model.parameters())
    print(
        f"model: {n_params / 1e6:.1f}M parameters, model + AdamW state {mb:.0f} MB, "
        f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    fresh, _ = build(args.params, seed=1)
    bench = Bench(state, fresh, mb, args.rounds)
    try:
        local_disk(bench, root)
        bucket = None if args.no_s3 else s3(bench)
        stalls(state, width, args.rounds, {"local": str(root), **({"s3": bucket} if bucket else {})})
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
