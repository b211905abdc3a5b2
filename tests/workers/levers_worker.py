"""Compile and activation checkpointing under every strategy, on 2 ranks, with the tiny transformer.

Usage: kiln run -n 2 levers_worker.py OUT. For each strategy of ``levers_model.STRATEGIES``:

* float64, the losses of 3 AdamW steps with ``activation_checkpointing`` None, ``"full"``,
  ``"selective"``, ``"selective:2"`` and a callable (tests/test_levers.py: all identical);
* float32, the losses eager, with ``compile=True`` and with both (the test: within 1e-5 of eager),
  the number of graphs dynamo compiled, and the model and optimizer keys of the strategy's state
  dict with and without the levers;
* a DCP checkpoint of the engine trained under compile (zero3) or eagerly (tp), loaded by a fresh
  engine of the same strategy the other way: the full weights equal those saved.

Rank 0 writes OUT/levers.json: [rank 0's {strategy: {case: value}}, rank 1's].
"""

import json
import os
import sys

import torch
import torch._inductor.config
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import kiln
from kiln.parallel import full_model_state_dict, get_strategy
from kiln.parallel.transforms.levers import applied_levers
from kiln.parallel.transforms.parallelize import ParallelizeOptions
from levers_model import STRATEGIES, lm_loss, make_data, make_model

AC_CASES = {"full": "full", "selective": "selective", "selective:2": "selective:2", "callable": "callable"}


def _is_layer(module):
    return type(module).__name__ == "Layer"


def engine_for(name, dtype, **options):
    if options.get("activation_checkpointing") == "callable":
        options["activation_checkpointing"] = _is_layer
    strategy = get_strategy(STRATEGIES[name]())
    strategy.parallelize_options = ParallelizeOptions(**options)
    model = make_model(dtype)
    return kiln.Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), lm_loss, strategy=strategy)


def train(engine, steps=3, global_batch=8):
    x, y = make_data(steps, global_batch)
    rank, size = engine.data_parallel_rank, engine.data_parallel_size
    losses = []
    for step in range(steps):
        batch = slice(step * global_batch, (step + 1) * global_batch)
        xb, yb = x[batch].chunk(size)[rank], y[batch].chunk(size)[rank]
        engine.zero_grad()
        loss = engine.criterion(engine(xb), yb)
        engine.backward(loss)
        engine.step()
        loss = loss.detach().clone()
        if engine.data_parallel_size > 1:  # the mean over the ranks that read different batches
            dist.all_reduce(loss)
            loss /= engine.data_parallel_size
        losses.append(loss.item())
    return losses


def levers_of(engine):
    """{block: the levers on its forward} for the blocks this rank holds."""
    module = engine.strategy.unwrap(engine.model)
    return {
        name: applied_levers(m)
        for name, m in module.named_modules()
        if name.startswith("layers.") and name.count(".") == 1
    }


def state_keys(engine):
    state = engine.strategy.state_dict(engine.model, engine.optimizer)
    optimizer_state = state["optimizer"]["state"] if "state" in state["optimizer"] else state["optimizer"]
    return {"model": sorted(state["model"]), "optimizer": sorted(map(str, optimizer_state))}


def round_trip(out, name, saved, load_options):
    """Save the trained engine ``saved`` with DCP; a fresh engine under ``load_options`` loads it."""
    folder = os.path.join(out, f"ckpt_{name}")
    dcp.save(saved.strategy.state_dict(saved.model, saved.optimizer), checkpoint_id=folder)
    loaded = engine_for(name, torch.float32, **load_options)
    state = loaded.strategy.state_dict(loaded.model, loaded.optimizer)
    dcp.load(state, checkpoint_id=folder)
    loaded.strategy.load_state_dict(loaded.model, loaded.optimizer, state)
    a, b = full_model_state_dict(saved.model), full_model_state_dict(loaded.model)
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def main():
    out = sys.argv[1]
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(STRATEGIES)
    # inductor compiles in this process: by default (2 CPUs here) it starts a pool of compile
    # workers per rank, fresh interpreters that import torch, which costs more than they save
    torch._inductor.config.compile_threads = 1
    ctx = kiln.launch_from_torch(seed=0)
    results = {}
    for name in names:
        r = results[name] = {"none64": train(engine_for(name, torch.float64))}
        for case, value in AC_CASES.items():
            engine = engine_for(name, torch.float64, activation_checkpointing=value)
            r[case], r[f"{case}_levers"] = train(engine), levers_of(engine)
        eager = engine_for(name, torch.float32)
        r["eager32"], r["eager_keys"] = train(eager), state_keys(eager)
        torch._dynamo.reset()  # compile afresh for each strategy: a graph cached from the last one would hide this one's
        torch._dynamo.utils.counters.clear()
        compiled = engine_for(name, torch.float32, compile=True)
        r["compile"], r["compile_keys"], r["compile_levers"] = (
            train(compiled),
            state_keys(compiled),
            levers_of(compiled),
        )
        r["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        # the DCP round trips save the engines just trained (no run of their own): written under
        # compile and loaded eagerly (zero3), written eagerly and loaded under compile (tp)
        if name == "zero3":
            r["compiled_to_eager"] = round_trip(out, name, compiled, {})
        if name == "tp":
            r["eager_to_compiled"] = round_trip(out, name, eager, {"compile": True})
        both = engine_for(name, torch.float32, compile=True, activation_checkpointing="full")
        r["compile_full"], r["both_keys"], r["both_levers"] = train(both), state_keys(both), levers_of(both)
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, results)
    if ctx.rank == 0:
        with open(os.path.join(out, "levers.json"), "w") as f:
            json.dump(everyone, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
