"""Per-step overhead of kiln's Engine and Trainer over a raw PyTorch loop, in the same process.

    python benchmarks/overhead.py [--steps 300] [--rounds 15]

Each round times a raw loop, the Engine loop, Trainer.fit and a second raw loop over the same
pre-built batches (one thread, interleaved rounds so drift hits all of them alike); the report is
the median per-step time and the median over rounds of its ratio to raw in the same round. The
second raw loop's ratio is the noise floor: on a
shared machine it can sit a few percent from 1, and a Trainer ratio inside that band is noise.
Trainer runs with progress bar and loggers off.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import kiln


def make(sizes: list[int]) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def batches(steps: int, batch: int, dim: int, classes: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(batch, dim, generator=g), torch.randint(0, classes, (batch,), generator=g)) for _ in range(steps)
    ]


def raw_loop(model, opt, crit, data) -> float:
    start = time.perf_counter()
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        loss = crit(model(x), y)
        loss.backward()
        opt.step()
    return time.perf_counter() - start


def engine_loop(engine, data) -> float:
    start = time.perf_counter()
    for x, y in data:
        engine.zero_grad()
        loss = engine.criterion(engine(x), y)
        engine.backward(loss)
        engine.step()
    return time.perf_counter() - start


def trainer_loop(trainer) -> float:
    # One whole epoch of its train_dataloader per fit(): the loader's epoch ends with the loop, as
    # in a real run (a batch count would stop it mid-epoch, and the next fit() would fetch the
    # epoch's rest before starting a new one).
    start = time.perf_counter()
    trainer.fit(duration="1ep")
    return time.perf_counter() - start


def bench(name: str, sizes: list[int], batch: int, optim: str, steps: int, rounds: int) -> dict[str, float]:
    data = batches(steps, batch, sizes[0], sizes[-1])

    def build():
        torch.manual_seed(0)
        model = make(sizes)
        opt = (
            torch.optim.SGD(model.parameters(), lr=0.01)
            if optim == "sgd"
            else torch.optim.AdamW(model.parameters(), lr=1e-3)
        )
        return model, opt

    m_raw, o_raw = build()
    crit = nn.CrossEntropyLoss()
    m_raw2, o_raw2 = build()  # a second raw loop: its ratio to the first is the machine's noise floor
    m_eng, o_eng = build()
    engine, *_ = kiln.initialize(m_eng, o_eng, nn.CrossEntropyLoss(), config={})
    m_tr, o_tr = build()
    trainer = kiln.Trainer(
        m_tr,
        train_dataloader=data,
        optimizers=o_tr,
        criterion=nn.CrossEntropyLoss(),
        progress_bar=False,
        max_duration="1ba",
    )
    loops = {
        "raw": lambda: raw_loop(m_raw, o_raw, crit, data),
        "engine": lambda: engine_loop(engine, data),
        "trainer": lambda: trainer_loop(trainer),
        "raw2": lambda: raw_loop(m_raw2, o_raw2, crit, data),
    }
    for _ in range(2):  # warm up allocator and autograd caches
        for loop in loops.values():
            loop()
    times: dict[str, list[float]] = {k: [] for k in loops}
    order = list(loops)
    for r in range(rounds):
        for loop in order[r % len(order) :] + order[: r % len(order)]:  # rotate, so no loop always runs first
            times[loop].append(loops[loop]() / steps)
    med = {k: statistics.median(v) for k, v in times.items()}
    # Ratios are paired within a round (loops seconds apart), then the median over rounds: slow
    # drifts in the machine's load cancel, which a ratio of medians would not do.
    ratio = {k: statistics.median(t / r for t, r in zip(times[k], times["raw"])) for k in times}
    print(
        f"{name}: raw {med['raw'] * 1e6:.1f} us/step | engine {med['engine'] * 1e6:.1f} us "
        f"({ratio['engine']:.3f}x) | trainer {med['trainer'] * 1e6:.1f} us ({ratio['trainer']:.3f}x)"
        f" | noise floor: raw again {ratio['raw2']:.3f}x"
    )
    # Python function calls per step: a count, so unlike the times it does not move with the
    # machine's load; the difference to raw is kiln's own per-step work.
    calls = {
        "raw": _calls_per_step(lambda: raw_loop(m_raw, o_raw, crit, data), steps),
        "engine": _calls_per_step(lambda: engine_loop(engine, data), steps),
        "trainer": _calls_per_step(lambda: trainer_loop(trainer), steps),
    }
    print(
        f"{' ' * len(name)}  python calls/step: raw {calls['raw']:.1f} | engine {calls['engine']:.1f} "
        f"(+{calls['engine'] - calls['raw']:.1f}) | trainer {calls['trainer']:.1f} (+{calls['trainer'] - calls['raw']:.1f})"
    )
    return med


def _calls_per_step(fn, steps: int) -> float:
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    fn()
    profile.disable()
    return pstats.Stats(profile).total_calls / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--skip-medium", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    bench("tiny MLP 32-64-10, batch 32, SGD", [32, 64, 10], 32, "sgd", args.steps, args.rounds)
    if not args.skip_medium:
        bench(
            "medium MLP 512-2048-2048-10, batch 128, AdamW",
            [512, 2048, 2048, 10],
            128,
            "adamw",
            max(20, args.steps // 10),
            max(5, args.rounds // 3),
        )


if __name__ == "__main__":
    main()
