"""Trainer.eval and Trainer.predict under every strategy, on an eval set that splits unevenly.

Usage: eval_even_worker.py OUT CASE ... with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set (one process
per rank, see tests/distributed.py run_ranks). The eval set has 9 samples in batches of 4: over two
data-parallel ranks rank 0 reads batches of 4 and 1 samples, rank 1 one batch of 4, and under a
pipeline the last batch (1 sample) is shorter than the traced shape. The process group times out
after KILN_TEST_PG_TIMEOUT seconds, so a rank left waiting in a collective fails the run instead of
hanging it.

Each rank writes OUT/rank<r>.json: {case: {"eval": trainer.eval(), "ref": the one-process numbers of
the same weights, "predict_diff": max |gathered - one-process| (rank 0), "predict_none": whether this
rank got None from predict(gather=True), "shard": its predict(gather=False) outputs' row count,
"batches": how many eval batches this rank ran (events), "forwards": forward calls (module hook),
"tiny"/"tiny_ref": eval() and the one-process numbers on the first sample alone, "seconds"; zero3 also
"list"/"generator": eval() of a list / a generator of this rank's own (uneven) batches; ddp also
"drop_last_diff": predict(gather=True) of a drop_last loader against the one-process first two batches}}.
"""

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import kiln
from kiln.metrics import Accuracy
from kiln.parallel import Hybrid, Pipeline, TensorParallel
from parallel_model import DTYPE, PLAN, make_model

NUM_SAMPLES, BATCH = 9, 4
CASES = {
    "ddp": lambda: "ddp",
    "zero2": lambda: "zero2",
    "zero3": lambda: "zero3",
    "fsdp": lambda: "fsdp",
    "tp": lambda: TensorParallel(PLAN),
    "pp": lambda: Pipeline(["blocks.2"], schedule="1f1b", microbatches=2),
    "hybrid_fsdp_tp": lambda: Hybrid(dp_shard=2, tp=2, tp_plan=PLAN),
    "hybrid_pp_fsdp": lambda: Hybrid(pp=2, dp_shard=2, split_points=["blocks.2"], microbatches=2),
}


def eval_data(num_samples=NUM_SAMPLES):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(NUM_SAMPLES, 8, generator=g, dtype=DTYPE)
    y = torch.randint(0, 4, (NUM_SAMPLES,), generator=g)
    return TensorDataset(x[:num_samples], y[:num_samples])


class CountBatches(kiln.Callback):
    def __init__(self):
        self.batches = 0

    def eval_batch_end(self, state, logger):
        self.batches += 1


def reference(seed, num_samples=NUM_SAMPLES):
    """The one-process numbers for the same weights: no process group involved."""
    model = make_model(seed).eval()
    x, y = eval_data(num_samples).tensors
    with torch.no_grad():
        logits = model(x)
        batched = [model(xb) for xb in x.split(BATCH)]
    acc = Accuracy(sync_on_compute=False)  # a local metric: the one-process value
    acc.update(logits, y)
    return {"eval/loss": F.cross_entropy(logits, y).item(), "eval/Accuracy": acc.compute().item()}, batched


def run_case(name, seed):
    counter = CountBatches()
    model = make_model(seed)
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))  # every forward of the root module
    trainer = kiln.Trainer(
        model,
        criterion=nn.CrossEntropyLoss(),
        strategy=CASES[name](),
        progress_bar=False,
        eval_metrics={"Accuracy": Accuracy()},
        callbacks=[counter],
    )
    loader = DataLoader(eval_data(), batch_size=BATCH)
    metrics = trainer.eval(loader)
    ref, batched = reference(seed)
    gathered = trainer.predict(loader, gather=True)
    shard = trainer.predict(loader)
    result = {
        "eval": metrics,
        "ref": ref,
        "batches": counter.batches,
        "forwards": len(forwards),
        "predict_none": gathered is None,
        "shard": sum(o.shape[0] for o in shard),
    }
    if gathered is not None:
        result["predict_shapes"] = [list(o.shape) for o in gathered]
        result["predict_diff"] = (
            max((g.cpu() - b).abs().max().item() for g, b in zip(gathered, batched))
            if len(gathered) == len(batched)
            else float("inf")
        )
    # one sample: the second data-parallel rank's shard is empty, its padding batch comes from the dataset
    result["tiny"] = trainer.eval(DataLoader(eval_data(1), batch_size=BATCH))
    result["tiny_ref"] = reference(seed, 1)[0]
    if name == "ddp":  # drop_last: each shard drops its own short batch; the rest comes back in order
        kept = trainer.predict(DataLoader(eval_data(), batch_size=BATCH, drop_last=True), gather=True)
        if kept is not None:
            result["drop_last_diff"] = (
                [(k - b).abs().max().item() for k, b in zip(kept, batched)]
                if len(kept) == 2
                else ["wrong batch count", [list(k.shape) for k in kept]]
            )
    if name == "zero3":  # loaders kiln does not shard: this rank's own batches, 2 on rank 0 and 1 on rank 1
        x, y = eval_data().tensors
        rank, world = dist.get_rank(), dist.get_world_size()
        own = list(zip(x[rank::world].split(BATCH), y[rank::world].split(BATCH)))
        result["list"] = trainer.eval(own)  # has a len: one all-reduce agrees on the count
        result["generator"] = trainer.eval(b for b in own)  # no len: the ranks agree batch by batch
    trainer.close()
    return result


def main():
    out, cases = sys.argv[1], sys.argv[2:]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    kiln.launch(
        rank=rank,
        world_size=world,
        host=os.environ["MASTER_ADDR"],
        port=os.environ["MASTER_PORT"],
        timeout=timedelta(seconds=float(os.environ.get("KILN_TEST_PG_TIMEOUT", "60"))),
    )
    results = {}
    for seed, name in enumerate(cases):
        start = time.perf_counter()
        results[name] = run_case(name, seed)
        results[name]["seconds"] = time.perf_counter() - start
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:  # what finished, should a later case fail
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
