"""Pretrain a small Llama-style model on real text that ships on every machine: the Python standard
library's own sources, as byte tokens (examples/lm_data.py). The twin of examples/lm_pretrain.yaml.

    kiln run -n 4 examples/lm_pretrain.py                         # zero3 x tp (2 x 2), compile, checkpointing
    kiln run -n 2 examples/lm_pretrain.py --tp 1 --no-compile     # zero3 over 2 ranks, eager
    kiln run -n 1 examples/lm_pretrain.py --steps 20 --no-compile

Prints the loss, tokens/s and MFU (``--peak-tflops`` gives the device's peak where kiln's table
does not know it, e.g. on a CPU).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

import kiln

sys.path.insert(0, str(Path(__file__).parent))
from lm_data import stdlib_text  # noqa: E402


class Kept(kiln.loggers.LoggerDestination):
    """Writes nothing: with it, the Trainer's logger keeps each metric's last value (``latest``)."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass


def schedule() -> kiln.optim.CosineAnnealingWithWarmupScheduler:
    """Warmup over the first tenth of the run, then cosine to 0 (lm_pretrain.yaml's lr_scheduler)."""
    return kiln.optim.CosineAnnealingWithWarmupScheduler(t_warmup="0.1dur")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per data-parallel rank")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (the rest of the world shards)")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--activation-checkpointing", default="full", help="full, selective, selective:N or none")
    parser.add_argument("--max-bytes", type=int, default=2_000_000, help="how much of the standard library to read")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's peak, for MFU")
    return parser.parse_args()


def choose_strategy(world_size: int, tp: int) -> kiln.parallel.Strategy | str:
    """``tp``-way tensor parallelism with the rest of the world sharding parameters, gradients and
    optimizer state (zero3): what the YAML twin's ``compute_config`` (``tp``, ``dp_shard: -1``)
    asks for too. One process: nothing to split."""
    if world_size == 1:
        return "single"
    return kiln.parallel.Hybrid(dp_shard=-1, tp=tp)


def main() -> dict[str, float]:
    args = parse_args()
    ctx = kiln.launch_from_torch(seed=0) if "RANK" in os.environ else kiln.launch(seed=0)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,  # bytes
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq_len,
    )
    model = kiln.models.HuggingFaceModel(LlamaForCausalLM(config))
    train, val = stdlib_text(seq_len=args.seq_len, max_bytes=args.max_bytes)
    strategy = choose_strategy(ctx.world_size, args.tp)
    peak = None if args.peak_tflops is None else args.peak_tflops * 1e12
    ac = None if args.activation_checkpointing == "none" else args.activation_checkpointing
    trainer = kiln.Trainer(
        model,
        train_dataloader=torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True),
        eval_dataloader=torch.utils.data.DataLoader(val, batch_size=args.batch_size),
        max_duration=f"{args.steps}ba",
        eval_interval=f"{args.steps}ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1),
        schedulers=schedule(),
        strategy=strategy,
        compile=args.compile,
        activation_checkpointing=ac,
        clip_grad_norm=1.0,
        callbacks=[kiln.callbacks.SpeedMonitor(window_size=10, peak_flops_per_sec=peak)],
        loggers=[Kept()],  # the logged values, for the closing summary; the progress lines print
        seed=0,  # progress as kiln train prints it: a line at each tenth of the run (a bar on a terminal)
    )
    trainer.fit()
    # what the Trainer logged last (the loss of the progress line that closed the run; throughput,
    # MFU) and the evaluation's values
    values = {**trainer.state.metrics, **trainer.logger.latest}
    metrics = {k: float(v) for k, v in values.items() if isinstance(v, (int, float, torch.Tensor))}
    if ctx.rank == 0:
        wanted = ("train/loss", "eval/loss", "eval/LanguagePerplexity", "throughput/tokens_per_sec", "throughput/mfu")
        summary = ", ".join(f"{k} {metrics[k]:.4g}" for k in wanted if k in metrics)
        print(f"lm_pretrain: {ctx.world_size} ranks, strategy {trainer.engine.strategy.name}, {summary}", flush=True)
    return metrics


if __name__ == "__main__":
    main()
