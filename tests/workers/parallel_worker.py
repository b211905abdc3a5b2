"""Parity of every strategy with one process: same data order, AdamW, global batch 16, 4 steps.

Usage: parallel_worker.py OUT CASE[:VARIANT,...] ... (VARIANT: plain, accum2, clip, all three
without one; accum2_clip only when named). Each rank also trains the single-process reference
itself (no collective), so one launch checks many strategies. Rank 0 writes OUT/parity.json:
{case: {variant: {"max_diff", "norm", "ref_norm", "loss", "ref_loss"}}}. The zero3 case also saves a
DCP checkpoint to OUT/ckpt_zero3 (and its full weights to OUT/zero3_full.pt) and loads it back on
all ranks under ddp; the deepspeed_zero2/3 cases do the same. The deepspeed cases run in float32
(KILN_PARITY_DTYPE=float32) against kiln's ddp, see main().
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import kiln
from kiln.cost.memory import plan_table
from kiln.parallel import Auto, full_model_state_dict, full_pipeline_state_dict
from parallel_model import STRATEGIES, make_data, make_model

CASES = {
    **STRATEGIES,
    "zero3_offload": lambda: kiln.parallel.Zero3(cpu_offload=True),
    "zero3_amp_bf16": lambda: ("zero3", "amp_bf16"),
    "auto_big": lambda: Auto(memory_budget=1e12),
    **{f"deepspeed_zero{stage}": (lambda stage=stage: _deepspeed(stage)) for stage in range(4)},
    "auto_small": lambda: Auto(memory_budget=_zero3_bytes() + 1),
}


def _deepspeed(stage):
    from kiln.parallel.deepspeed import DeepSpeed

    return DeepSpeed({"zero_optimization": {"stage": stage}, "steps_per_print": 10**9})


def _zero3_bytes():
    # a budget only zero3 fits: replicating anything more would not
    rows = plan_table(make_model(), torch.optim.AdamW, world_size=2, budget=1e12)
    return next(r.total for r in rows if r.strategy == "zero3")


VARIANTS = {"plain": (1, None), "accum2": (2, None), "clip": (1, 0.05)}
# run only when a case names it ("case:plain,accum2_clip"): accumulation and clipping in one run,
# for launches that would rather not pay for both apart (the recorded norm, taken before clipping,
# still sees a lost 1/accumulation)
NAMED_ONLY = {"accum2_clip": (2, 0.05)}
GLOBAL_BATCH, STEPS = 16, 4


def build(spec, accum=1, clip=None, seed=0):
    strategy, precision = spec if isinstance(spec, tuple) else (spec, None)
    model = make_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)  # built on the user's optimizer
    engine = kiln.Engine(
        model,
        opt,
        nn.CrossEntropyLoss(),
        strategy=strategy,
        gradient_accumulation=accum,
        clip_grad_norm=clip,
        precision=precision,
    )
    return engine, sched


def train(strategy, accum, clip, dp_rank=None, dp_size=1):
    """4 optimizer steps; returns (engine, last loss, last grad norm)."""
    engine, sched = build(strategy, accum, clip)
    if dp_rank is None:
        # ranks of one tensor-parallel group or one pipeline read the same batch; ddp/zero1 split it
        dp_rank, dp_size = engine.data_parallel_rank, engine.data_parallel_size
    x, y = make_data(STEPS, GLOBAL_BATCH)
    micro = GLOBAL_BATCH // accum
    per_rank = micro // dp_size
    loss = None
    for step in range(STEPS):
        for m in range(accum):
            start = step * GLOBAL_BATCH + m * micro + dp_rank * per_rank
            xb, yb = x[start : start + per_rank], y[start : start + per_rank]
            engine.zero_grad()
            loss = engine.criterion(engine(xb), yb)
            engine.backward(loss)
            loss = loss.item()
            if engine.step():
                sched.step()
    norm = engine.last_grad_norm
    return engine, loss, None if norm is None else float(norm)


def full_weights(engine):
    if getattr(engine.strategy, "pipeline", None) is not None:
        return full_pipeline_state_dict(engine.model)
    return full_model_state_dict(engine)


def check_checkpoint(engine, out, tag):
    """Save through the strategy (DCP, every rank) -> load under ddp on every rank: same weights
    and Adam state. The checkpoint layer uses the same strategy hooks."""
    import torch.distributed.checkpoint as dcp

    path = os.path.join(out, f"ckpt_{tag}")
    dcp.save(engine.strategy.state_dict(engine.model, engine.optimizer), checkpoint_id=path)
    full = {k: v.cpu() for k, v in full_weights(engine).items()}
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(out, f"{tag}_full.pt"))
    model = make_model(seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ddp = kiln.Engine(model, opt, nn.CrossEntropyLoss(), strategy="ddp")
    state = ddp.strategy.state_dict(ddp.model, ddp.optimizer)
    dcp.load(state, checkpoint_id=path)
    ddp.strategy.load_state_dict(ddp.model, ddp.optimizer, state)
    loaded = full_model_state_dict(ddp.model)
    diff = max((loaded[k] - full[k]).abs().max().item() for k in full)
    steps = {float(s["step"]) for s in ddp.optimizer.state.values()}
    return {"weights_diff": diff, "adam_steps": sorted(steps), "lr": ddp.optimizer.param_groups[0]["lr"]}


def check_roundtrip(engine, spec, out, tag):
    """DCP save, load into a fresh engine of the same strategy (before its first step), then one
    more step on both: the weights must match exactly. Goes through the strategy's state_dict hooks,
    as the checkpoint layer does."""
    import torch.distributed.checkpoint as dcp

    path = os.path.join(out, f"ckpt_{tag}")
    dcp.save(engine.strategy.state_dict(engine.model, engine.optimizer), checkpoint_id=path)
    fresh, _ = build(spec, seed=7)
    state = fresh.strategy.state_dict(fresh.model, fresh.optimizer)
    dcp.load(state, checkpoint_id=path)
    fresh.strategy.load_state_dict(fresh.model, fresh.optimizer, state)
    dp_rank = engine.data_parallel_rank
    n = GLOBAL_BATCH // engine.data_parallel_size
    x, y = make_data(STEPS, GLOBAL_BATCH)
    for e in (engine, fresh):
        e.train()
        e.zero_grad()
        e.backward(e.criterion(e(x[dp_rank * n : (dp_rank + 1) * n]), y[dp_rank * n : (dp_rank + 1) * n]))
        e.step()
    a, b = full_weights(engine), full_weights(fresh)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def main():
    out, cases = sys.argv[1], sys.argv[2:]
    ctx = kiln.launch_from_torch(seed=0)
    results = {}
    # A reference run depends only on its strategy, accumulation and clipping (fixed seeds and
    # data): trained once per combination and reused by every case that compares with it.
    references = {}
    for name in cases:
        name, _, only = name.partition(":")  # "case:variant,variant" runs only those variants
        results[name] = {}
        chosen = {v: {**VARIANTS, **NAMED_ONLY}[v] for v in only.split(",")} if only else VARIANTS
        for variant, (accum, clip) in chosen.items():
            t = time.perf_counter()
            if name.startswith("deepspeed"):
                # DeepSpeed reduces float32 at most, where Adam turns summation-order noise in tiny
                # gradients into 1e-4 differences from one process (ddp included). Its reference is
                # therefore kiln's ddp on the same ranks and accumulation: both sum the same parts.
                key = ("ddp", accum, clip)
                if key not in references:
                    references[key] = train("ddp", accum=accum, clip=clip)
            else:
                key = ("single", 1, clip)
                if key not in references:
                    references[key] = train("single", accum=1, clip=clip, dp_rank=0, dp_size=1)
            ref, ref_loss, ref_norm = references[key]
            engine, loss, norm = train(CASES[name](), accum, clip)
            weights = full_weights(engine)
            reference = full_weights(ref)
            diff = max((weights[k].cpu() - reference[k]).abs().max().item() for k in reference)
            missing = sorted(set(reference) - set(weights))
            results[name][variant] = {
                "max_diff": diff,
                "missing": missing,
                "loss": loss,
                "ref_loss": ref_loss,
                "norm": norm,
                "ref_norm": ref_norm,
                "seconds": time.perf_counter() - t,
            }
            if isinstance(engine.strategy, Auto):
                results[name]["chosen"] = engine.strategy.chosen.name
                results[name]["reason"] = engine.strategy.reason
            if variant == "plain":  # the trained model's forward in eval mode, on every rank
                dp_size = engine.data_parallel_size
                x = make_data(STEPS, GLOBAL_BATCH)[0][: GLOBAL_BATCH // dp_size]
                engine.eval()
                with torch.no_grad():
                    results[name]["eval_diff"] = (engine(x) - ref.model.eval()(x)).abs().max().item()
            if name in ("zero3", "deepspeed_zero2", "deepspeed_zero3") and variant == "plain":
                results[name]["checkpoint"] = check_checkpoint(engine, out, name)
            if (name in ("zero1", "pp_1f1b", "hybrid_fsdp_tp") or name.startswith("deepspeed")) and variant == "plain":
                results[name]["roundtrip_diff"] = check_roundtrip(engine, CASES[name](), out, name)
    if ctx.rank == 0:
        with open(os.path.join(out, "parity.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
