"""Tokens/s and peak memory of kiln's Trainer against a raw torch loop with the same levers, in the
same run: a Llama-style model (transformers config) on byte tokens of the standard library.

    python benchmarks/lm.py [--sizes tiny small] [--steps 20] [--rounds 3]
    kiln run -n 2 benchmarks/lm.py        # adds the FSDP2 lever (fully_shard per block)

For each size and lever set (none, activation checkpointing, compile, both; plus fully_shard with
more than one rank) both loops train the same model from the same weights on the same batches:
the raw loop applies the lever by hand (``fully_shard`` per decoder layer, ``torch.utils.checkpoint``
around each layer, ``module.compile()`` per layer), kiln through ``Trainer(strategy=,
activation_checkpointing=, compile=)``. Rounds alternate the order; the report is the median of the
per-round ratios kiln / raw (tokens/s: aim >= 0.98). Peak memory is the CUDA allocator's peak on a
GPU; on a CPU there is no per-loop peak to read, and the script says so.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import kiln  # noqa: E402
from lm_data import stdlib_text  # noqa: E402

SIZES = {  # hidden, layers, heads, kv heads, seq, batch
    "tiny": (64, 2, 4, 2, 64, 8),
    "small": (256, 4, 8, 4, 128, 8),
    "125m": (768, 12, 12, 12, 1024, 8),
}


def build(size: str) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv, seq, _ = SIZES[size]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=seq)  # fmt: skip
    return LlamaForCausalLM(config)


def peak_bytes(device: torch.device) -> int | None:
    """The CUDA allocator's peak since the last reset; None on a CPU, where no per-loop peak exists
    (the process's peak RSS only grows, so the second loop of a round would inherit the first's)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    return None


def raw_loop(size: str, levers: set[str], batches: list[dict], device: torch.device) -> tuple[float, int | None]:
    """The levers by hand, torchtitan's way."""
    model = build(size).to(device)
    layers = model.model.layers
    if "ckpt" in levers:
        from torch.utils.checkpoint import checkpoint

        for layer in layers:
            layer.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(layer.forward)
    if "compile" in levers:
        for layer in layers:
            layer.compile()
    if "fsdp" in levers:
        from torch.distributed.fsdp import fully_shard

        for layer in layers:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    start = None
    for step, batch in enumerate(batches):
        if step == 2:  # the first steps compile and warm the allocator
            start = time.perf_counter()
        batch = {k: v.to(device) for k, v in batch.items()}
        optimizer.zero_grad(set_to_none=True)
        model(**batch, use_cache=False).loss.backward()
        optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, peak_bytes(device)


def kiln_loop(size: str, levers: set[str], batches: list[dict], device: torch.device) -> tuple[float, int | None]:
    model = kiln.models.HuggingFaceModel(build(size))
    times: list[float] = []

    class Clock(kiln.Callback):
        def batch_end(self, state, logger):
            if state.timestamp.batch.value == 2:
                times.append(time.perf_counter())

    trainer = kiln.Trainer(
        model,
        train_dataloader=batches,
        max_duration=f"{len(batches)}ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True),
        strategy="fsdp" if "fsdp" in levers else "single" if kiln.context().world_size == 1 else "ddp",
        activation_checkpointing="full" if "ckpt" in levers else None,
        compile="compile" in levers,
        callbacks=[Clock()],
        progress_bar=False,
    )
    trainer.fit()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - times[0], peak_bytes(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--levers", nargs="+", default=None, help="sets like none ckpt compile ckpt+compile fsdp")
    args = parser.parse_args()
    ctx = kiln.launch_from_torch(seed=0) if "RANK" in os.environ else kiln.launch(seed=0)
    device = ctx.device
    lever_sets = args.levers or ["none", "ckpt", "compile", "ckpt+compile"] + (["fsdp"] if ctx.world_size > 1 else [])
    for size in args.sizes:
        _, _, _, _, seq, batch = SIZES[size]
        train, _ = stdlib_text(seq_len=seq, max_bytes=seq * batch * args.steps * ctx.world_size + seq)
        loader = torch.utils.data.DataLoader(train, batch_size=batch)
        batches = list(loader)[: args.steps]
        tokens = sum(b["input_ids"].numel() for b in batches[2:]) * ctx.world_size
        for name in lever_sets:
            levers = set() if name == "none" else set(name.split("+"))
            ratios, mem = [], []
            for r in range(args.rounds):
                order = [raw_loop, kiln_loop] if r % 2 == 0 else [kiln_loop, raw_loop]
                result = {fn.__name__: fn(size, levers, batches, device) for fn in order}
                ratios.append(result["raw_loop"][0] / result["kiln_loop"][0])  # tokens/s kiln / raw
                kiln_peak, raw_peak = result["kiln_loop"][1], result["raw_loop"][1]
                if kiln_peak is not None and raw_peak:
                    mem.append(kiln_peak / raw_peak)
                torch._dynamo.reset()
            if ctx.rank == 0:
                raw_tps = tokens / result["raw_loop"][0]
                print(f"{size:5s} {name:13s} raw {raw_tps:9.0f} tok/s | kiln/raw tokens/s {statistics.median(ratios):.3f}x"
                      f" | peak memory kiln/raw {f'{statistics.median(mem):.2f}x' if mem else 'n/a (CPU)'}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
