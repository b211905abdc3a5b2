"""Pretrain a small Llama-style mixture-of-experts model (kiln.models.MoELlama) on the Python standard
library's own sources, as byte tokens (examples/lm_data.py), with its experts split over ranks.
The twin of examples/moe_pretrain.yaml.

    kiln run -n 4 examples/moe_pretrain.py                  # ep 2 x efsdp 2: experts over 2 ranks, sharded over 2
    kiln run -n 2 examples/moe_pretrain.py                  # ep 2 (x zero3 of the other weights)
    kiln run -n 1 examples/moe_pretrain.py --steps 20       # one process

Prints the loss, tokens/s and the router's imbalance (the busiest expert's tokens over the mean;
1.0 is balanced), which ``kiln.callbacks.MoEMonitor`` logs every ``--log-every`` batches.
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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per data-parallel rank")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel size (taken from the sharding ranks)")
    parser.add_argument("--activation-checkpointing", default="full", help="full, selective, selective:N or none")
    parser.add_argument("--max-bytes", type=int, default=2_000_000, help="how much of the standard library to read")
    parser.add_argument("--log-every", type=int, default=None, help="batches between logged lines (default: steps/10)")
    return parser.parse_args()


def choose_strategy(world_size: int, ep: int) -> kiln.parallel.Strategy | str:
    """``ep``-way expert parallelism, every rank sharding the other weights (zero3), and the
    experts FSDP-sharded over the ``world_size / ep`` ranks holding the same ones: what the YAML
    twin's ``compute_config`` (``ep: 2``, ``dp_shard: -1``) asks for. One process: nothing to split."""
    if world_size == 1:
        return "single"
    return kiln.parallel.Hybrid(dp_shard=-1, ep=ep)


class FirstLoss(kiln.Callback):
    """The first batch's loss (this rank's), to show that it falls."""

    loss = float("nan")

    def batch_end(self, state: kiln.State, logger: object) -> None:
        if state.timestamp.batch.value == 1:
            self.loss = float(state.loss.detach())


def main() -> dict[str, float]:
    args = parse_args()
    ctx = kiln.launch_from_torch(seed=0) if "RANK" in os.environ else kiln.launch(seed=0)
    # the YAML twin's model: DeepSeek-V3's layout at toy size (a dense first block, a shared expert)
    model = kiln.models.MoELlama(
        vocab_size=256,  # bytes
        dim=args.hidden,
        num_layers=args.layers,
        num_heads=4,
        num_kv_heads=2,
        max_seq_len=args.seq_len,
        num_dense_layers=1,
        num_experts=args.experts,
        top_k=2,
        moe_hidden_dim=2 * args.hidden,
        num_shared_experts=1,
        load_balance="aux_loss",
        aux_loss_coef=0.01,
    )
    train, val = stdlib_text(seq_len=args.seq_len, max_bytes=args.max_bytes)
    every = args.log_every or max(1, args.steps // 10)
    ac = None if args.activation_checkpointing == "none" else args.activation_checkpointing
    first = FirstLoss()
    trainer = kiln.Trainer(
        model,
        train_dataloader=torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True),
        eval_dataloader=torch.utils.data.DataLoader(val, batch_size=args.batch_size),
        max_duration=f"{args.steps}ba",
        eval_interval=f"{args.steps}ba",
        optimizers=torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1),
        schedulers=kiln.optim.CosineAnnealingWithWarmupScheduler(t_warmup="0.1dur"),
        strategy=choose_strategy(ctx.world_size, args.ep),
        activation_checkpointing=ac,
        clip_grad_norm=1.0,
        callbacks=[first, kiln.callbacks.MoEMonitor(interval=every), kiln.callbacks.SpeedMonitor(window_size=10)],
        # kiln train's progress lines (as moe_pretrain.yaml prints them), and every logged metric
        # (the router statistics above all) on its interval
        loggers=[kiln.loggers.ConsoleLogger(log_interval=every)],
        log_interval=f"{every}ba",
        seed=0,
    )
    trainer.fit()
    # the last logged value of each metric (the train/loss of the closing progress line), then the evaluation's
    values = {**trainer.state.metrics, **trainer.logger.latest}
    metrics = {k: float(v) for k, v in values.items() if isinstance(v, (int, float, torch.Tensor))}
    metrics["first/loss"] = first.loss
    if ctx.rank == 0:
        wanted = ("first/loss", "train/loss", "eval/loss", "moe/imbalance", "throughput/tokens_per_sec")
        summary = ", ".join(f"{k} {metrics[k]:.4g}" for k in wanted if k in metrics)
        print(f"moe_pretrain: {ctx.world_size} ranks, {trainer.engine.strategy!r}, {summary}", flush=True)
    return metrics


if __name__ == "__main__":
    main()
