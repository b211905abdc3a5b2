"""Tokens/s and peak memory of kiln's Trainer against a raw torch loop with the same levers, in the
same run: a Llama-style model (transformers config) on byte tokens of the standard library.

    python benchmarks/lm.py [--sizes tiny small] [--steps 40] [--rounds 2] [--precision amp_bf16]
    kiln run -n 2 benchmarks/lm.py        # FSDP2: fully_shard per block in both loops, every row
    python benchmarks/lm.py --sizes 125m --precision amp_bf16 --json lm.json   # what make gpu-check runs

For each size and lever set (none, compile, activation checkpointing, both) both loops train the
same model from the same weights on the same batches. The raw loop applies the levers by hand the
way kiln's parallelize pipeline does, per decoder layer and in its order: the layer's forward wrapped
in ``torch.utils.checkpoint`` (non-reentrant), then that forward ``torch.compile``d (one function
for every layer, called with the layer as its first argument, so the layers share compiled code),
then ``fully_shard`` on each layer and the root when there is more than one rank. kiln gets the same
through ``Trainer(strategy=, activation_checkpointing=, compile=)``.

Timing, paired: the two loops run side by side in one process, step for step (the raw loop's step
``i`` runs while kiln's loader fetches batch ``i``, and is subtracted from kiln's step), so each pair
of steps sees the same load from the machine's other processes. The table gives the median of the
per-step ratios kiln / raw (tokens/s: aim >= 0.98) with their quartiles, over all rounds; the first
two steps of each round compile and are not timed.

The ``control`` row pairs the raw loop with a second raw loop in kiln's place: two identical
loops, so its ratio is what the pairing gives by itself. On one rank it is 1; with FSDP over two
ranks of a loaded CPU the loop in kiln's place (timed from one step's end to the next, less the
nested step) came out a few percent slower (0.94-0.97), so read kiln's rows against it.

``--precision amp_bf16`` runs both loops' forward under bf16 autocast (kiln's ``amp_bf16``). MFU
is the step's model FLOPs (counted once per size by kiln's ``TrainingFlopCounter`` on a step of the
plain model: forward and backward matmuls and attention, no recomputation) over the median step
time, against the device's dense peak for the matmul dtype (:mod:`kiln.callbacks.device_flops`);
"n/a" where the table has no peak (CPUs). ``--json PATH`` writes the table's rows as they come.

Validity: dynamo's caches are reset before every round and every memory run, and all batches have
one shape, so nothing compiles in the timed steps; a round that does is counted in the table's
last column. (Within a round, compile alone compiles the same function in both loops, the layer
class's forward, so the loop that runs second may find the graph the first one compiled in its
warm-up: both then run that graph.)

Peak memory comes from more short runs of each loop alone: on a GPU the CUDA allocator's peak; on
a CPU the CPU allocator's peak of the bytes allocated during the run (``torch.profiler`` with
``profile_memory=True`` counts every allocation and free made while it records, and the whole run,
model and optimizer included, is inside). The busiest rank counts. On one rank the CPU number
repeats to the byte; with several ranks it moves from run to run (gloo's threads free the
collectives' tensors when they finish, so what is alive at the peak depends on the timing), and
the table gives each loop's median over ``--memory-runs`` runs with its range.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import MethodType
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import kiln  # noqa: E402
from kiln.callbacks.device_flops import describe_peak, peak_flops_per_sec  # noqa: E402
from kiln.callbacks.speed_monitor import TrainingFlopCounter  # noqa: E402
from lm_data import stdlib_text  # noqa: E402

SIZES = {  # hidden, layers, heads, kv heads, seq, batch
    "tiny": (64, 2, 4, 2, 64, 8),
    "small": (256, 4, 8, 4, 128, 8),
    "125m": (768, 12, 12, 12, 1024, 8),
}
WARMUP = 2  # untimed steps: the first compiles, both warm the allocator
LEVER_SETS = ["control", "none", "compile", "ckpt", "ckpt+compile"]
PRECISIONS = {"fp32": None, "amp_bf16": torch.bfloat16}  # kiln's name -> the raw loop's autocast dtype
Batch = dict[str, torch.Tensor]


def build(size: str) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv, seq, _ = SIZES[size]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=seq)  # fmt: skip
    return LlamaForCausalLM(config)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled so far (a recompile counts again)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- the raw loop -----------------------------------------------------------------------------------
def raw_levers(model: nn.Module, levers: set[str], sharded: bool) -> None:
    """Per decoder layer, in kiln's order: checkpointing, then compile, then fully_shard."""
    from torch.utils.checkpoint import checkpoint

    layers = model.model.layers
    forward: Callable[..., Any] = type(layers[0]).forward  # unbound: the layer comes in as `self`
    if "ckpt" in levers:
        inner = forward

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return checkpoint(inner, self, *args, use_reentrant=False, **kwargs)

    if "compile" in levers:
        forward = torch.compile(forward)
    if levers & {"ckpt", "compile"}:
        for layer in layers:
            layer.forward = MethodType(forward, layer)  # FSDP's hooks (in __call__) stay outside
    if sharded:
        from torch.distributed.fsdp import fully_shard

        for layer in layers:
            fully_shard(layer)
        fully_shard(model)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    dtype = PRECISIONS[precision]
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def raw_step_fn(size: str, levers: set[str], device: torch.device, precision: str = "fp32") -> Callable[[Batch], None]:
    """One training step of the raw loop, as a function of the batch."""
    model = build(size).to(device)
    raw_levers(model, levers, sharded=kiln.context().world_size > 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

    def step(batch: Batch) -> None:
        batch = {k: v.to(device) for k, v in batch.items()}
        optimizer.zero_grad(set_to_none=True)
        with autocast(device, precision):
            loss = model(**batch, use_cache=False).loss
        loss.backward()
        optimizer.step()

    return step


def raw_loop(size: str, levers: set[str], batches: list[Batch], device: torch.device, precision: str = "fp32") -> None:
    step = raw_step_fn(size, levers, device, precision)
    for batch in batches:
        step(batch)


def flops_per_step(size: str, batch: Batch, device: torch.device, precision: str) -> float:
    """Model FLOPs of one training step on ``batch`` (this rank's), counted on the plain model."""
    model = build(size).to(device)
    with TrainingFlopCounter() as counter:
        with autocast(device, precision):
            loss = model(**{k: v.to(device) for k, v in batch.items()}, use_cache=False).loss
        loss.backward()
    del model
    return float(counter.get_total_flops())


# -- kiln -------------------------------------------------------------------------------------------
def kiln_trainer(
    size: str, levers: set[str], loader: Any, num_steps: int, callbacks: list[Any], precision: str = "fp32"
) -> kiln.Trainer:
    model = kiln.models.HuggingFaceModel(build(size))
    return kiln.Trainer(
        model,
        train_dataloader=loader,
        max_duration=f"{num_steps}ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True),
        precision=precision,
        strategy="fsdp" if kiln.context().world_size > 1 else "single",
        activation_checkpointing="full" if "ckpt" in levers else None,
        compile="compile" in levers,
        callbacks=callbacks,
        progress_bar=False,
    )


def kiln_loop(size: str, levers: set[str], batches: list[Batch], device: torch.device, precision: str = "fp32") -> None:  # fmt: skip
    kiln_trainer(size, levers, batches, len(batches), [], precision).fit()


# -- the paired run ---------------------------------------------------------------------------------
class PairedLoader:
    """kiln's training loader: before it hands kiln batch ``i`` it runs (and times) the raw loop's
    step on the same batch, so the two loops alternate step by step."""

    def __init__(self, batches: list[Batch], raw_step: Callable[[Batch], None], device: torch.device) -> None:
        self.batches, self.raw_step, self.device = batches, raw_step, device
        self.raw_seconds: list[float] = []

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Batch]:
        for batch in self.batches:
            start = time.perf_counter()
            self.raw_step(batch)
            sync(self.device)
            self.raw_seconds.append(time.perf_counter() - start)
            yield batch


def paired_round(
    size: str, levers: set[str], batches: list[Batch], device: torch.device, precision: str = "fp32"
) -> tuple[list[float], list[float], int]:
    """Seconds of each timed step of the raw loop and of kiln, and the graphs compiled while timing."""
    torch._dynamo.reset()  # neither loop may run code compiled in an earlier round
    loader = PairedLoader(batches, raw_step_fn(size, levers, device, precision), device)
    ends: list[float] = []
    compiled = [0]

    class Clock(kiln.Callback):
        def batch_end(self, state: Any, logger: Any) -> None:
            sync(device)
            ends.append(time.perf_counter())
            if state.timestamp.batch.value == WARMUP:
                compiled[0] = compiled_graphs()

    kiln_trainer(size, levers, loader, len(batches), [Clock()], precision).fit()
    raw = loader.raw_seconds[WARMUP:]
    # between kiln's step ends i-1 and i: the raw step i (in the loader), then kiln's step i
    steps = [b - a - r for a, b, r in zip(ends[WARMUP - 1 :], ends[WARMUP:], raw)]
    return raw, steps, compiled_graphs() - compiled[0]


def control_round(
    size: str, batches: list[Batch], device: torch.device, precision: str = "fp32"
) -> tuple[list[float], list[float], int]:
    """:func:`paired_round` with a second raw loop in kiln's place (a plain loop over the same
    loader, timed the same way): what the pairing itself gives two identical loops."""
    torch._dynamo.reset()
    loader = PairedLoader(batches, raw_step_fn(size, set(), device, precision), device)
    outer = raw_step_fn(size, set(), device, precision)
    ends = []
    for batch in loader:
        outer(batch)
        sync(device)
        ends.append(time.perf_counter())
    raw = loader.raw_seconds[WARMUP:]
    return raw, [b - a - r for a, b, r in zip(ends[WARMUP - 1 :], ends[WARMUP:], raw)], 0


# -- peak memory ------------------------------------------------------------------------------------
def peak_memory(loop: Callable[..., None], size: str, levers: set[str], batches: list[Batch], device: torch.device) -> int:  # fmt: skip
    """Peak bytes the device's allocator held during one run of ``loop`` (everything it allocated:
    model, gradients, optimizer state, activations)."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        loop(size, levers, batches, device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loop(size, levers, batches, device)
    # Allocation events carry the allocator's running total of the bytes it handed out while the
    # profiler recorded (frees of older blocks are not subtracted: it never counted them).
    allocations, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            fields = event.extra_fields
            allocations.append((event.start_time_ns, fields.total_allocated, fields.alloc_size))
    allocations.sort()
    base = allocations[0][1] - allocations[0][2]
    return max(total for _, total, _ in allocations) - base


def peak_memory_per_rank(loop: Callable[..., None], size: str, levers: set[str], batches: list[Batch], device: torch.device, runs: int) -> list[int]:  # fmt: skip
    """The busiest rank's peak in each of ``runs`` runs. With several ranks on a CPU the peak moves
    from run to run: gloo's threads free the collectives' tensors when they finish, so what is
    alive at the peak depends on the timing."""
    peaks = []
    for _ in range(runs):
        peak = torch.tensor(peak_memory(loop, size, levers, batches, device), dtype=torch.int64)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        peaks.append(int(peak))
    return peaks


def memory_text(kiln_peaks: list[int], raw_peaks: list[int]) -> str:
    """kiln / raw of the median peaks, with each loop's median (and range over runs) in MiB."""

    def mib(peaks: list[int]) -> str:
        median = statistics.median(peaks) / 2**20
        spread = f" {min(peaks) / 2**20:.0f}-{max(peaks) / 2**20:.0f}" if max(peaks) - min(peaks) > 2**18 else ""
        return f"{median:.1f}{spread}"

    ratio = statistics.median(kiln_peaks) / statistics.median(raw_peaks)
    return f"{ratio:.3f} ({mib(kiln_peaks)} / {mib(raw_peaks)} MiB)"


def quartiles(values: list[float]) -> str:
    q1, median, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return f"{median:.3f} ({q1:.3f}-{q3:.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=40, help=f"steps per round, the first {WARMUP} untimed")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--levers",
        nargs="+",
        default=LEVER_SETS,
        help="sets like none ckpt compile ckpt+compile; control: raw against raw",
    )
    parser.add_argument(
        "--memory-steps", type=int, default=2, help="timed-size steps of the peak-memory runs (0: none)"
    )
    parser.add_argument(
        "--memory-runs", type=int, default=None, help="peak-memory runs per loop (default 1 on one rank, 3 on more)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads on a CPU (0: torch's default)")
    parser.add_argument("--precision", default="fp32", choices=sorted(PRECISIONS), help="both loops' precision")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here too, each as it is measured")
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must be more than the {WARMUP} warm-up steps")
    if args.threads:
        # One thread per rank: on a shared machine a multi-threaded op waits for its slowest thread.
        torch.set_num_threads(args.threads)
    ctx = kiln.launch_from_torch(seed=0) if "RANK" in os.environ else kiln.launch(seed=0)
    device = ctx.device
    if args.memory_runs is None:  # one rank: the peak repeats to the byte
        args.memory_runs = 1 if ctx.world_size == 1 or device.type == "cuda" else 3
    matmul_dtype = PRECISIONS[args.precision] or torch.float32
    peak = peak_flops_per_sec(device, matmul_dtype)
    report: dict[str, Any] = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world_size": ctx.world_size,
        "precision": args.precision,
        "peak_flops_per_sec": peak,
        "peak": describe_peak(device, matmul_dtype),
        "rows": [],
    }
    if ctx.rank == 0:
        shard = "fully_shard per block in both loops" if ctx.world_size > 1 else "no fully_shard (one rank)"
        print(f"{ctx.world_size} rank(s) on {device.type}, {shard}, {args.precision}; {args.rounds} round(s) of "
              f"{args.steps} paired steps ({WARMUP} untimed); kiln / raw: median (quartiles) of the per-step ratios; "
              f"MFU: {report['peak']}", flush=True)  # fmt: skip
        print(f"{'size':5s} {'levers':13s} {'raw tok/s':>10s} {'kiln tok/s':>10s}  {'tokens/s kiln/raw':22s} "
              f"{'MFU raw/kiln':13s} {'peak memory kiln/raw (kiln / raw)':34s} timed compiles", flush=True)  # fmt: skip
    raw_fit = functools.partial(raw_loop, precision=args.precision)
    kiln_fit = functools.partial(kiln_loop, precision=args.precision)
    for size in args.sizes:
        _, _, _, _, seq, batch = SIZES[size]
        # at least 60 windows' worth: the 2% stdlib_text keeps for validation must hold one window
        train, _ = stdlib_text(seq_len=seq, max_bytes=max(int(seq * batch * args.steps * 1.1) + 2 * seq, 60 * seq))
        loader = torch.utils.data.DataLoader(train, batch_size=batch, drop_last=True)  # one shape: no recompiles
        batches = list(loader)[: args.steps]
        assert len(batches) == args.steps, f"only {len(batches)} batches of text for {args.steps} steps"
        tokens = batches[0]["input_ids"].numel() * ctx.world_size  # per step, all ranks
        flops = flops_per_step(size, batches[0], device, args.precision)  # per step, this rank
        for name in args.levers:
            levers = set() if name == "none" else set(name.split("+"))
            raw: list[float] = []
            ours: list[float] = []
            compiled = 0
            for _ in range(args.rounds):
                run = control_round if name == "control" else functools.partial(paired_round, levers=levers)
                raw_round, kiln_round, compiled_round = run(
                    size, batches=batches, device=device, precision=args.precision
                )
                raw += raw_round
                ours += kiln_round
                compiled += compiled_round
            ratios = [r / k for r, k in zip(raw, ours)]  # tokens/s kiln / raw, step by step
            memory = "n/a"
            raw_peaks, kiln_peaks = [], []
            if args.memory_steps and name != "control":
                short = batches[: WARMUP + args.memory_steps]
                raw_peaks = peak_memory_per_rank(raw_fit, size, levers, short, device, args.memory_runs)
                kiln_peaks = peak_memory_per_rank(kiln_fit, size, levers, short, device, args.memory_runs)
                memory = memory_text(kiln_peaks, raw_peaks)
            torch._dynamo.reset()
            if ctx.rank == 0:
                raw_tps, kiln_tps = tokens / statistics.median(raw), tokens / statistics.median(ours)
                mfu = [flops / statistics.median(seconds) / peak if peak else None for seconds in (raw, ours)]
                mfu_text = "n/a" if peak is None else f"{mfu[0]:.1%}/{mfu[1]:.1%}"
                print(f"{size:5s} {name:13s} {raw_tps:10.0f} {kiln_tps:10.0f}  {quartiles(ratios):22s} {mfu_text:13s} "
                      f"{memory:34s} {compiled}", flush=True)  # fmt: skip
                report["rows"].append({
                    "size": size, "levers": name, "steps": len(raw), "flops_per_step": flops,
                    "raw_tokens_per_sec": raw_tps, "kiln_tokens_per_sec": kiln_tps,
                    "tokens_per_sec_ratio": statistics.median(ratios), "raw_mfu": mfu[0], "kiln_mfu": mfu[1],
                    "raw_peak_bytes": statistics.median(raw_peaks) if raw_peaks else None,
                    "kiln_peak_bytes": statistics.median(kiln_peaks) if kiln_peaks else None,
                    "timed_compiles": compiled,
                })  # fmt: skip
                if args.json is not None:  # rewritten after each row: a run cut short keeps its rows
                    args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
