"""The optimizer step: kiln's default implementation against foreach, the for-loop and fused.

    python benchmarks/optimizer_step.py                       # CPU, one thread, AdamW and SGD
    python benchmarks/optimizer_step.py --device cuda --threads 0 --out result.json

For each model shape and optimizer, the same parameters and gradients are stepped by four
optimizers: ``default`` (built with neither ``foreach`` nor ``fused`` and handed to
:func:`kiln.optim.apply_default_implementation`, as the Trainer does), ``foreach=True``,
``foreach=False`` (torch's per-parameter loop) and ``fused=True``. Rounds alternate between the
four, so machine noise falls on all of them alike; the time of one step is the median over rounds,
and the ratios (``loop / default``: above 1 means the default is faster) come from the same run.
The table also says whether each implementation left the parameters bit-identical to the loop's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kiln.optim.implementation import apply_default_implementation  # noqa: E402

# (name, number of layers, width): many small tensors, a middle size, a few large ones.
SHAPES = [("64 x Linear(64)", 64, 64), ("24 x Linear(256)", 24, 256), ("8 x Linear(1024)", 8, 1024)]
OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}),
    "SGD": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
}
IMPLEMENTATIONS = {
    "default": {},
    "foreach": {"foreach": True},
    "for-loop": {"foreach": False},
    "fused": {"fused": True},
}


def _model(layers: int, width: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench(
    layers: int, width: int, cls: type, kwargs: dict[str, Any], device: torch.device, steps: int, rounds: int
) -> dict[str, Any]:
    """Median seconds per step of each implementation, and whether it matches the loop bit for bit."""
    models, optimizers = {}, {}
    for name, extra in IMPLEMENTATIONS.items():
        model = _model(layers, width, device)
        generator = torch.Generator(device=device).manual_seed(1)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, device=device, generator=generator) * 1e-2
        optimizer = cls(model.parameters(), **kwargs, **extra)
        if name == "default":
            chosen = apply_default_implementation(optimizer)
        models[name], optimizers[name] = model, optimizer
    times: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
    for optimizer in optimizers.values():  # warm up: state creation and first-call costs
        for _ in range(3):
            optimizer.step()
    for _ in range(rounds):
        for name, optimizer in optimizers.items():
            _sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                optimizer.step()
            _sync(device)
            times[name].append((time.perf_counter() - start) / steps)
    loop = [p.detach() for p in models["for-loop"].parameters()]
    same = {
        name: all(torch.equal(a, b) for a, b in zip(loop, (p.detach() for p in model.parameters())))
        for name, model in models.items()
    }
    median = {name: statistics.median(t) for name, t in times.items()}
    return {"seconds": median, "bit_identical_to_loop": same, "default_is": "+".join(chosen) or "unchanged"}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (0: torch's default)")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    results: dict[str, Any] = {"device": str(device), "threads": torch.get_num_threads(), "torch": torch.__version__}
    print(f"optimizer step on {device} ({torch.get_num_threads()} thread(s)), torch {torch.__version__}")
    header = (
        "model",
        "optimizer",
        "default is",
        "default",
        "foreach",
        "for-loop",
        "fused",
        "loop/default",
        "fused/default",
    )
    rows = []
    for shape, layers, width in SHAPES:
        for opt_name, (cls, kwargs) in OPTIMIZERS.items():
            r = bench(layers, width, cls, kwargs, device, args.steps, args.rounds)
            results[f"{shape} {opt_name}"] = r
            s, same = r["seconds"], r["bit_identical_to_loop"]
            rows.append(
                (
                    shape,
                    opt_name,
                    r["default_is"],
                    *(f"{s[n] * 1e3:.3f} ms{'' if same[n] else '*'}" for n in IMPLEMENTATIONS),
                    f"{s['for-loop'] / s['default']:.2f}x",
                    f"{s['fused'] / s['default']:.2f}x",
                )
            )
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    print("* the parameters after the steps differ from the for-loop's in the last bits")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
