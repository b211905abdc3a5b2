"""Per-step overhead of kiln's Engine and Trainer over a raw loop, in CPU instructions (callgrind).

    python benchmarks/overhead_instructions.py [--steps 200]

``benchmarks/overhead.py`` times the loops; on a shared machine its ratios move by a few percent
from run to run, as much as the overhead it looks for. This script counts instead: it runs the same
loops (tiny MLP 32-64-10, batch 32, SGD, one thread) once inside valgrind's callgrind with its
cache simulator, switching the count on after imports and warm-up, and dumping it after each loop.
Counts do not move with the machine's load. Reported per loop: instructions (Ir), first-level
cache misses (I1 + D1) and last-level misses (LL), an estimate of cycles (``Ir + 10 * L1 misses +
100 * LL misses``, the weights callgrind's docs use) and that estimate's ratio to the raw loop.

What instructions do not see: branch mispredictions and the CPU's out-of-order overlap; the time
ratios of ``overhead.py`` include them. Takes about 3 minutes (valgrind runs Python ~50x slower).

Loops: ``raw`` (zero_grad, forward, loss, backward, step); ``engine`` (the same through
``kiln.initialize``); ``trainer`` (``Trainer.fit`` over the same batches, setup included);
``trainer_loop_sgd`` (the same with ``SGD(foreach=False)``: the optimizer kernels the raw loop
runs, so the difference is the loop alone); ``raw_again`` (the raw loop once more, last: the
first loop measured pays cache misses the others do not, so ratios are taken to this one).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOOPS = ("raw", "engine", "trainer", "trainer_loop_sgd", "raw_again")


def target(steps: int, folder: Path) -> None:
    """The process callgrind runs: builds the loops, then runs each between two handshakes."""
    import warnings

    import torch
    from torch import nn

    sys.path.insert(0, str(Path(__file__).parent))
    from overhead import batches, engine_loop, make, raw_loop

    import kiln

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    data = batches(steps, 32, 32, 10)

    def build(**kwargs):
        torch.manual_seed(0)
        model = make([32, 64, 10])
        return model, torch.optim.SGD(model.parameters(), lr=0.01, **kwargs)

    def trainer(**kwargs):
        model, opt = build(**kwargs)
        return kiln.Trainer(
            model,
            train_dataloader=data,
            optimizers=opt,
            criterion=nn.CrossEntropyLoss(),
            progress_bar=False,
            max_duration="1ep",
        )

    crit = nn.CrossEntropyLoss()
    raw = build()
    engine, *_ = kiln.initialize(*build(), nn.CrossEntropyLoss(), config={})
    tr, tr_loop = trainer(), trainer(foreach=False)
    loops = {
        "raw": lambda: raw_loop(*raw, crit, data),
        "engine": lambda: engine_loop(engine, data),
        # a whole epoch per fit(): the loader's epoch ends with the loop, as in a real run
        "trainer": lambda: trainer_loop_epochs(tr),
        "trainer_loop_sgd": lambda: trainer_loop_epochs(tr_loop),
        "raw_again": lambda: raw_loop(*raw, crit, data),
    }

    def trainer_loop_epochs(t):
        t.fit(duration="1ep")

    for _ in range(2):  # warm up caches, allocator and autograd
        for loop in loops.values():
            loop()
    handshake(folder, "ready")
    for name, loop in loops.items():
        loop()
        handshake(folder, name)


def handshake(folder: Path, tag: str) -> None:
    flag = folder / tag
    flag.touch()
    while flag.exists():  # the controller deletes it once it has switched or dumped the count
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--target", help=argparse.SUPPRESS)  # the folder, in the process callgrind runs
    args = parser.parse_args()
    if args.target:
        target(args.steps, Path(args.target))
        return
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit("valgrind (with callgrind_control) is not installed: apt-get install valgrind")
    folder = Path(tempfile.mkdtemp(prefix="kiln-callgrind-"))
    out = folder / "callgrind.out"
    proc = subprocess.Popen(
        [
            "valgrind",
            "--tool=callgrind",
            "--cache-sim=yes",
            "--instr-atstart=no",
            f"--callgrind-out-file={out}.%p",
            sys.executable,
            __file__,
            "--steps",
            str(args.steps),
            "--target",
            str(folder),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    pid = str(proc.pid)
    for tag in ("ready", *LOOPS):
        while not (folder / tag).exists():
            if proc.poll() is not None:
                sys.exit(f"the loops' process ended early:\n{proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
            time.sleep(0.1)
        if tag == "ready":
            control = [["-i", "on"], ["-z"]]  # count from here, from zero
        else:
            control = [["-d", tag]]  # dump (and zero) the count of the loop that just ran
        for extra in control:
            subprocess.run(["callgrind_control", *extra, pid], check=True, stdout=subprocess.DEVNULL)
        (folder / tag).unlink()
    proc.wait()
    counts = {}
    for dump in folder.glob("callgrind.out.*"):
        text = dump.read_text(errors="replace")
        tag = next((line.split("Trigger: ")[1].split()[-1] for line in text.splitlines() if "Trigger:" in line), "")
        names = next(line.split()[1:] for line in text.splitlines() if line.startswith("events:"))
        values = next(line.split()[1:] for line in text.splitlines() if line.startswith(("summary:", "totals:")))
        if tag in LOOPS:
            counts[tag] = dict(zip(names, map(int, values)))
    shutil.rmtree(folder, ignore_errors=True)
    print(f"tiny MLP 32-64-10, batch 32, SGD, {args.steps} steps per loop; per step:")

    def cycles(c: dict[str, int]) -> int:
        l1 = c["I1mr"] + c["D1mr"] + c["D1mw"]
        ll = c["ILmr"] + c["DLmr"] + c["DLmw"]
        return c["Ir"] + 10 * l1 + 100 * ll

    base = counts["raw_again"]
    for name in LOOPS:
        c = counts[name]
        l1 = c["I1mr"] + c["D1mr"] + c["D1mw"]
        ll = c["ILmr"] + c["DLmr"] + c["DLmw"]
        print(
            f"  {name:17s} Ir {c['Ir'] / args.steps:8.0f} ({c['Ir'] / base['Ir']:.4f}x) | L1 misses "
            f"{l1 / args.steps:6.0f} | LL misses {ll / args.steps:5.1f} | est. cycles {cycles(c) / args.steps:8.0f} "
            f"({cycles(c) / cycles(base):.4f}x)"
        )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
