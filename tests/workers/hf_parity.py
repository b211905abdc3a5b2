"""The tiny Llama (float64) under several strategies in one launch, each against one process.

Usage: kiln run -n 4 hf_parity.py OUT CASE ... Every case trains a fresh 2-layer ``HuggingFaceModel`` for
``STEPS`` AdamW steps of a ``GLOBAL_BATCH``-sequence batch, each rank reading its data-parallel
share, then evaluates it: the Trainer cases with ``Trainer.fit``/``Trainer.eval``, the ``engine_``
cases with the Engine's four-line loop. Each rank also computes the one-process reference itself
with a plain loop and no collective (the same model, data and AdamW). Rank 0 writes
OUT/hf_parity.json: {case: {"losses", "ref_losses", "max_loss_diff", "eval", "ref_eval",
"max_eval_diff", "seconds"}}, where a step's loss is the mean over data-parallel ranks of their
batch losses (the loss of the whole batch: every batch has as many tokens).
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.fx.config
from torch.utils.data import DataLoader

import kiln
from hf_common import ByteWindows, batches
from hf_common import make_model as make_llama
from kiln.models import LanguagePerplexity
from kiln.parallel import Hybrid, TensorParallel

# 2 AdamW steps (the second uses the first's optimizer state; the evaluation reads the weights of
# both updates) of a 2-layer Llama (the pipelines' 2 stages: a layer each): a case's cost is its
# steps' DTensor and pipeline overheads, per layer, and the traces of the pipelines' stages
STEPS, GLOBAL_BATCH, EVAL_SAMPLES = 2, 8, 8
MODEL = {"num_hidden_layers": 2}
SPLIT = ["model.model.layers.1"]  # in a HuggingFaceModel


def make_model(**overrides):
    return make_llama(**{**MODEL, **overrides})


CASES = {
    "ddp": lambda: "ddp",
    "zero1": lambda: "zero1",
    "zero3": lambda: "zero3",
    "tp": lambda: TensorParallel(),  # no plan: the model's own config.base_model_tp_plan
    "zero3_tp": lambda: Hybrid(dp_shard=2, tp=2),
    # 2 stages: a Llama's later stages all read the rotary embeddings stage 0 computes, a skip
    # connection torch.distributed.pipelining cannot run backward through (kiln says so)
    "pp": lambda: Hybrid(pp=2, dp_replicate=2, dp_shard=1, split_points=SPLIT, microbatches=2),
    # the Engine's loop under Hybrid(dp_shard=2, tp=2) with the model's own loss (no case of
    # tests/test_hf_models.py any more: tests/test_sequence_parallel.py's llama_fsdp2_tp2 runs it)
    "engine_zero3_tp": lambda: Hybrid(dp_shard=2, tp=2),
    # pp x tp with grouped-query attention (8 heads, 4 key/value heads): the pipeline traces the model
    # as one tensor-parallel rank computes it, so the repeated key/value heads get a rank's counts
    # (kiln.parallel.pipelining.tp_trace); the stages mix tensor-parallel DTensors with plain tensors (the norms),
    # which no foreach step takes. (Full heads take the same path with nothing repeated: the case it
    # replaces, pp_tp_mha, cost the launch as much again.)
    "pp_tp_gqa": lambda: Hybrid(pp=2, tp=2, split_points=SPLIT, microbatches=2),
}
# The model's config where a case changes it (the reference trains the same model).
MODEL_OVERRIDES: dict[str, dict] = {}


def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def eval_batch():
    return batches(1, EVAL_SAMPLES, offset=STEPS * GLOBAL_BATCH)[0]


def reference(**overrides):
    """One process, no kiln in the loop: each step's loss, then the evaluation's loss and perplexity."""
    model = make_model(**overrides)
    opt = optimizer(model)
    losses = []
    for batch in batches(STEPS, GLOBAL_BATCH):
        opt.zero_grad()
        loss = model.loss(model(batch), batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    batch = eval_batch()
    with torch.no_grad():
        out = model(batch)
    ppl = LanguagePerplexity()
    ppl.update(out.logits[:, :-1], batch["labels"][:, 1:])
    return losses, {"eval/loss": out.loss.item(), "eval/LanguagePerplexity": ppl.compute().item()}


class LossLog(kiln.Callback):
    def __init__(self) -> None:
        self.losses = []

    def batch_end(self, state, logger):
        self.losses.append(float(state.loss.detach()))


def run_trainer(strategy, **overrides):
    model = make_model(**overrides)
    log = LossLog()
    trainer = kiln.Trainer(
        model,
        optimizers=optimizer(model),
        strategy=strategy,
        max_duration=f"{STEPS}ba",
        callbacks=[log],
        progress_bar=False,
        seed=0,
    )
    per_rank = GLOBAL_BATCH // trainer.engine.data_parallel_size
    trainer.fit(train_dataloader=DataLoader(ByteWindows(STEPS * GLOBAL_BATCH), batch_size=per_rank))
    metrics = trainer.eval(DataLoader(ByteWindows(EVAL_SAMPLES, offset=STEPS * GLOBAL_BATCH), batch_size=per_rank))
    return log.losses, metrics


def run_engine(strategy, **overrides):
    """The Engine's loop: ``loss = engine.criterion(engine(batch), batch)``, with the model's own loss."""
    model = make_model(**overrides)
    engine = kiln.Engine(model, optimizer(model), model.loss, strategy=strategy)
    rank, size = engine.data_parallel_rank, engine.data_parallel_size

    def share(batch):
        return {k: v.chunk(size)[rank] for k, v in batch.items()}

    losses = []
    for batch in batches(STEPS, GLOBAL_BATCH):
        mine = share(batch)
        engine.zero_grad()
        loss = engine.criterion(engine(mine), mine)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.eval()
    with torch.no_grad():
        mine = share(eval_batch())
        loss = engine.criterion(engine(mine), mine).item()
    return losses, {"eval/loss": mean_over_ranks([loss], dist.get_world_size())[0]}


def mean_over_ranks(values, world):
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / world).tolist()


def main():
    out, cases = sys.argv[1], sys.argv[2:]
    ctx = kiln.launch_from_torch(seed=0)
    # The pipeline cases trace the whole model with torch.export on every rank (most of their CPU): the
    # source stack fx records for each traced node is for a reader of the graph, which nothing here is
    torch.fx.config.do_not_emit_stack_traces = True
    references = {}
    results = {}
    for name in cases:
        start = time.perf_counter()
        overrides = MODEL_OVERRIDES.get(name, {})
        key = tuple(sorted(overrides.items()))
        if key not in references:
            references[key] = reference(**overrides)
        ref_losses, ref_eval = references[key]
        run = run_engine if name.startswith("engine_") else run_trainer
        strategy = CASES[name]()
        losses, metrics = run(strategy, **overrides)
        # every rank of a tensor-parallel group or pipeline has its group's loss: the mean over all
        # ranks is the mean over data-parallel ranks
        losses = mean_over_ranks(losses, ctx.world_size)
        results[name] = {
            "losses": losses,
            "ref_losses": ref_losses,
            "max_loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "eval": metrics,
            "ref_eval": ref_eval,
            "max_eval_diff": max(abs(metrics[k] - ref_eval[k]) for k in metrics),
            "seconds": time.perf_counter() - start,
            # sequence parallelism inside the pipeline's stages (Hybrid's default with pp and tp)
            "sequence_parallel_stages": getattr(strategy, "sequence_parallel_stages", None),
        }
    if ctx.rank == 0:
        with open(os.path.join(out, "hf_parity.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
