"""A tiny Llama with tied embeddings (float64) cut into pipeline stages, against one process.

Usage: kiln run -n N pipeline_tied_worker.py OUT CASE ... Every case trains a fresh 1-layer Llama with
``tie_word_embeddings=True`` for ``STEPS`` SGD steps through the Engine's four-line loop, with
gradient accumulation over ``ACCUM`` backwards and the gradient norm clipped to ``CLIP`` (below the
norm: every step clips). Rank 0 computes the one-process reference (the same model, data,
accumulation, clipping and SGD, no collective) and hands it to the others. Rank 0 writes OUT/pipeline_tied.json: {case:
{"losses", "ref_losses", "norms", "ref_norms", "copies": {name: [max |copy - reference weight| of
each rank's copy]}}}: each copy of the tied weight after the last step, on the rank that holds it.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.fx.config

import kiln
from hf_common import batches
from hf_common import make_model as make_llama
from kiln.parallel import Hybrid, Pipeline

STEPS, ACCUM, GLOBAL_BATCH, CLIP, LR = 2, 2, 8, 0.5, 0.5
TIED = ("model.model.embed_tokens.weight", "model.lm_head.weight")  # in a HuggingFaceModel
# one layer (the trace is most of a case's cost): the first stage is the embedding alone
LAYER, NORM = "model.model.layers.0", "model.model.norm"
LAYERS = {"pp_zbv": 2}  # the cases that need more

CASES = {
    # 2 stages on 2 ranks, 1F1B: the embedding on rank 0, the head on rank 1 (a group of the two)
    "pp": lambda: Pipeline([LAYER], microbatches=2),
    # ZBV's V: rank 0 holds stages 0 (the embedding) and 3 (the norm and the head), both copies (the
    # sum is local, no group); two layers (a stage of the norm alone fails torch's split backward)
    "pp_zbv": lambda: Pipeline([LAYER, "model.model.layers.1", NORM], schedule="zbv", microbatches=4),
    # FSDP inside each of 2 stages: the copies' gradients are dp_shard-sharded DTensors
    "pp_fsdp": lambda: Hybrid(pp=2, dp_shard=2, split_points=[LAYER], microbatches=2),
    # tensor parallelism inside the stages (with sequence parallelism, kiln's default, which leaves a
    # tied embedding and head whole on every tp rank); not in the test's launches (its cost), by hand
    "pp_tp": lambda: Hybrid(pp=2, tp=2, split_points=[LAYER], microbatches=2),
}


def make_model(layers):
    return make_llama(num_hidden_layers=layers, tie_word_embeddings=True)


def micro_batches():
    """``STEPS * ACCUM`` global batches: each optimizer step accumulates ``ACCUM`` of them."""
    return batches(STEPS * ACCUM, GLOBAL_BATCH)


def reference(layers):
    model = make_model(layers)
    assert model.model.lm_head.weight is model.model.model.embed_tokens.weight
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for index, batch in enumerate(micro_batches()):
        if index % ACCUM == 0:
            opt.zero_grad()
        loss = model.loss(model(batch), batch)
        (loss / ACCUM).backward()
        losses.append(loss.item())
        if index % ACCUM == ACCUM - 1:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
            opt.step()
    return losses, norms, model.model.lm_head.weight.detach().clone()


def run(strategy, layers):
    model = make_model(layers)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    engine = kiln.Engine(model, opt, model.loss, strategy=strategy, gradient_accumulation=ACCUM, clip_grad_norm=CLIP)
    rank, size = engine.data_parallel_rank, engine.data_parallel_size
    losses, norms = [], []
    for batch in micro_batches():
        mine = {k: v.chunk(size)[rank] for k, v in batch.items()}
        engine.zero_grad()
        loss = engine.criterion(engine(mine), mine)
        engine.backward(loss)
        if engine.step():
            norms.append(float(engine.last_grad_norm))
        losses.append(loss.item())
    return engine, losses, norms


def copies(engine, weight):
    """{name: max |copy - weight|} of the tied weight's copies this rank holds (whole, gathered)."""
    from torch.distributed.tensor import DTensor

    found = {}
    for name, p in engine.model.named_parameters(remove_duplicate=False):
        if name in TIED:
            full = p.full_tensor() if isinstance(p, DTensor) else p
            found[name] = (full.detach() - weight).abs().max().item()
    return found


def main():
    out, cases = sys.argv[1], sys.argv[2:]
    ctx = kiln.launch_from_torch(seed=0)
    # the source stack fx records for each traced node, and prints into each stage's code, is for a
    # reader of the graph, which nothing here is: without it a pipeline's trace costs less CPU
    torch.fx.config.do_not_emit_stack_traces = True
    references = {}
    results = {}
    for name in cases:
        layers = LAYERS.get(name, 1)
        if layers not in references:
            box = [reference(layers) if ctx.rank == 0 else None]  # computed once, read by every rank
            dist.broadcast_object_list(box, src=0)
            references[layers] = box[0]
        ref_losses, ref_norms, ref_weight = references[layers]
        engine, losses, norms = run(CASES[name](), layers)
        # every rank of a pipeline has its loss: the mean over all ranks is the mean over data-parallel ones
        t = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(t)
        held: list = [None] * ctx.world_size
        dist.all_gather_object(held, copies(engine, ref_weight))
        results[name] = {
            "losses": (t / ctx.world_size).tolist(),
            "ref_losses": ref_losses,
            "norms": norms,
            "ref_norms": ref_norms,
            "copies": {n: [part[n] for part in held if n in part] for n in TIED},
        }
    cpu: list = [None] * ctx.world_size
    dist.all_gather_object(cpu, time.process_time())
    results["cpu_seconds"] = sum(cpu)  # the ranks' own (the warm fork server's imports not counted)
    if ctx.rank == 0:
        with open(os.path.join(out, "pipeline_tied.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
