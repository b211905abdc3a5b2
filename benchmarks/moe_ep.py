"""Tokens/s of kiln.models.MoELlama under expert parallelism against the same model on one process.

    OMP_NUM_THREADS=1 python benchmarks/moe_ep.py                 # one process, all experts local
    OMP_NUM_THREADS=1 kiln run -n 2 benchmarks/moe_ep.py          # Hybrid(ep=2): 2 ranks, 4 experts each

The model is examples/moe_pretrain.yaml's (dim 128, 4 layers, the first dense, 8 experts of hidden
256, top-2, a shared expert; fp32), AdamW, ``--batch`` sequences of ``--seq`` tokens per rank, so
EP 2 trains twice the tokens per step. Prints tokens/s of the run (all ranks) and per rank, the
step time, and how much of it went to the expert all-to-alls (their wall time, measured around
``torch.distributed.all_to_all_single``, and the bytes each rank sent per step).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import kiln

MODEL = dict(
    vocab_size=256,
    dim=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    max_seq_len=128,
    num_dense_layers=1,
    num_experts=8,
    top_k=2,
    moe_hidden_dim=256,
    num_shared_experts=1,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    ctx = kiln.launch_from_torch(seed=0) if "RANK" in os.environ else kiln.launch(seed=0)
    torch.manual_seed(0)
    model = kiln.models.MoELlama(**MODEL)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    strategy = "single" if ctx.world_size == 1 else kiln.parallel.Hybrid(dp_shard=-1, ep=ctx.world_size)
    engine = kiln.Engine(model, optimizer, strategy=strategy)

    # time and bytes of the experts' all-to-alls
    a2a = {"seconds": 0.0, "bytes": 0}
    original = dist.all_to_all_single

    def timed(output, input, *rest, **kwargs):
        start = time.perf_counter()
        result = original(output, input, *rest, **kwargs)
        a2a["seconds"] += time.perf_counter() - start
        a2a["bytes"] += input.numel() * input.element_size()
        return result

    dist.all_to_all_single = timed
    g = torch.Generator().manual_seed(ctx.rank)
    data = torch.randint(0, MODEL["vocab_size"], (args.steps + args.warmup, args.batch, args.seq), generator=g)
    for step in range(args.steps + args.warmup):
        if step == args.warmup:
            if dist.is_initialized():
                dist.barrier()
            a2a["seconds"], a2a["bytes"] = 0.0, 0
            start = time.perf_counter()
        engine.zero_grad()
        loss = model.loss(engine(data[step]), data[step])
        engine.backward(loss)
        engine.step()
    loss.item()
    elapsed = time.perf_counter() - start
    tokens = args.steps * args.batch * args.seq * ctx.world_size
    if ctx.rank == 0:
        print(
            f"moe_ep: {ctx.world_size} rank(s), {strategy}: {tokens / elapsed:,.0f} tok/s "
            f"({tokens / elapsed / ctx.world_size:,.0f} per rank), {elapsed / args.steps * 1e3:.0f} ms/step, "
            f"all-to-all {a2a['seconds'] / args.steps * 1e3:.1f} ms/step "
            f"({a2a['seconds'] / elapsed:.0%}), {a2a['bytes'] / args.steps / 1e6:.2f} MB sent per rank per step, "
            f"loss {loss.item():.3f}",
            flush=True,
        )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
