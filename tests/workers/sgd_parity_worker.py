"""Gradient and weight parity of every strategy with one process, under plain SGD in float64.

Usage: sgd_parity_worker.py OUT CASE ... Rank 0 writes OUT/sgd_parity.json:
{case: {variant: {...}}} (see ``run_case``). Each rank computes the one-process reference itself,
with a plain torch loop (no Engine) on the whole global batch, so a bug shared by the Engine's
single-device path and a strategy cannot hide.

Why SGD: Adam divides each gradient by its own running RMS, so a constant factor on every gradient
(a lost or doubled ``1/accumulation``, a norm summed twice over replicated shards) barely moves
its weights. SGD without momentum or weight decay moves each weight by exactly ``lr * grad``: a
gradient twice too large is a step twice too long. Float64 keeps the honest differences (other
summation orders on other layouts) near 1e-16.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.fx.config
from torch import nn

import kiln
from kiln.parallel import full_model_state_dict, full_pipeline_state_dict
from parallel_model import STRATEGIES, make_data, make_model

CASES = STRATEGIES
# (gradient_accumulation, clip_grad_norm). CLIP is well below the gradient norm of every step
# (0.9-1.6 here), so every step clips; the test checks that from the reference norms.
CLIP = 0.05
# Accumulation and clipping run together: the first step's gradients, read before clipping, see
# a lost or doubled 1/accumulation (and so do the norms), the applied gradient a wrong clip
# coefficient. One run instead of two halves the traced pipelines, the cost of this launch.
VARIANTS = {"plain": (1, None), "accum2_clip": (2, CLIP)}
# a power of two: the first step's weight change divided by LR is the applied gradient exactly
LR = 0.5
GLOBAL_BATCH, STEPS = 16, 2


def _data():
    # STEPS batches to train on and one more to evaluate on
    x, y = make_data(STEPS + 1, GLOBAL_BATCH)
    return x[:-GLOBAL_BATCH], y[:-GLOBAL_BATCH], x[-GLOBAL_BATCH:], y[-GLOBAL_BATCH:]


def _clone(state):
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def reference(clip, lr=LR):
    """One process, plain torch: the whole global batch per step, torch's own clipping.

    Returns the model, the first step's gradients (before clipping), the weights after the first
    step and after all steps, and each step's gradient norm."""
    x, y, _, _ = _data()
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0, weight_decay=0.0)
    criterion = nn.CrossEntropyLoss()
    grads, first, norms = None, None, []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        batch = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        criterion(model(x[batch]), y[batch]).backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        params = list(model.parameters())
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in params])))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        if step == 0:
            first = _clone(model.state_dict())
    return model, grads, first, _clone(model.state_dict()), norms


def full_grads(engine):
    """Every parameter's whole gradient on every rank, by original name: DTensor shards (FSDP, TP)
    are gathered with ``full_tensor()``, pipeline stages with an all-gather over the pipeline group."""
    from torch.distributed.tensor import DTensor

    grads = {}
    for name, p in engine.module.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[name] = g.detach().cpu().clone()
    pipeline = getattr(engine.strategy, "pipeline", None)
    if pipeline is not None:
        parts = [None] * pipeline.pp_size
        dist.all_gather_object(parts, grads, group=pipeline.group)
        grads = {k: v for part in parts for k, v in part.items()}
    return grads


def full_weights(engine):
    if getattr(engine.strategy, "pipeline", None) is not None:
        return full_pipeline_state_dict(engine.model)
    return full_model_state_dict(engine)


def _diff(got, want):
    """(max abs difference, that over max |want|, names missing from got)."""
    missing = sorted(set(want) - set(got))
    common = [k for k in want if k in got]
    if not common:
        return float("inf"), float("inf"), missing
    abs_diff = max((got[k].to(want[k].dtype) - want[k]).abs().max().item() for k in common)
    scale = max(want[k].abs().max().item() for k in common)
    return abs_diff, abs_diff / scale, missing


def run_case(spec, accum, clip, ref):
    """Train ``spec`` for STEPS steps of the global batch, split over data-parallel ranks and
    ``accum`` micro-steps; compare with the reference ``ref`` (see ``reference``)."""
    ref_model, ref_grads, ref_first, ref_last, ref_norms = ref
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.0, weight_decay=0.0)
    engine = kiln.Engine(
        model, opt, nn.CrossEntropyLoss(), strategy=spec, gradient_accumulation=accum, clip_grad_norm=clip
    )
    dp_rank, dp_size = engine.data_parallel_rank, engine.data_parallel_size
    x, y, x_eval, y_eval = _data()
    micro = GLOBAL_BATCH // accum
    per_rank = micro // dp_size
    grads = first = None
    norms = []
    for step in range(STEPS):
        for m in range(accum):
            start = step * GLOBAL_BATCH + m * micro + dp_rank * per_rank
            xb, yb = x[start : start + per_rank], y[start : start + per_rank]
            engine.zero_grad()
            engine.backward(engine.criterion(engine(xb), yb))
            if step == 0 and m == accum - 1:
                grads = full_grads(engine)  # summed over ranks and micro-steps, not yet clipped or applied
            engine.step()
        if clip is not None:
            norms.append(float(engine.last_grad_norm))
        if step == 0:
            first = _clone(full_weights(engine))  # ddp/tp state dicts alias the live parameters
    last = _clone(full_weights(engine))

    init = make_model(0).state_dict()
    # the gradient the first step applied (after clipping): (w0 - w1) / lr, exact for lr = 2**-1
    applied = {k: (init[k] - v) / LR for k, v in first.items()}
    ref_applied = {k: (init[k] - v) / LR for k, v in ref_first.items()}
    result = {}
    for key, got, want in (("grad", grads, ref_grads), ("update", applied, ref_applied), ("weight", last, ref_last)):
        result[f"{key}_abs"], result[f"{key}_rel"], result[f"{key}_missing"] = _diff(got, want)
    if clip is not None:
        result["norms"], result["ref_norms"] = norms, ref_norms

    # eval-mode forward and loss on every rank: each rank its data-parallel share of a fresh batch,
    # shaped like a training micro-batch (a pipeline keeps the shapes it traced)
    xe = x_eval[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    ye = y_eval[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    engine.eval()
    ref_model.eval()
    with torch.no_grad():
        out = engine(xe)
        loss = engine.criterion(out, ye)
        ref_out = ref_model(xe)
        ref_loss = nn.functional.cross_entropy(ref_out, ye)
    mine = {
        "rank": dist.get_rank(),
        "out_abs": (out.cpu() - ref_out).abs().max().item(),
        "loss_abs": abs(loss.item() - ref_loss.item()),
        "rows": int(xe.shape[0]),
    }
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    result["eval"] = every
    return result


def main():
    out, cases = sys.argv[1], sys.argv[2:]
    ctx = kiln.launch_from_torch(seed=0)
    # the source stack fx records for each traced node, and prints into each stage's code, is for a
    # reader of the graph, which nothing here is: without it a pipeline's trace costs less CPU
    torch.fx.config.do_not_emit_stack_traces = True
    results = {"lr": LR, "clip": CLIP, "steps": STEPS, "global_batch": GLOBAL_BATCH}
    # what a gradient scaled by 2 would do: the reference run with 2 * LR (SGD, no momentum: the
    # same weights as 2 * every gradient), and its first gradients doubled
    refs, scale2 = {}, {}
    for variant, (_, clip) in VARIANTS.items():
        refs[variant] = reference(clip)
        _, grads, first, last, norms = refs[variant]
        _, _, first2, last2, _ = reference(clip, lr=2 * LR)
        scale2[variant] = {
            "grad_abs": max(g.abs().max().item() for g in grads.values()),
            "weight_abs": _diff(last2, last)[0],
            "ref_norms": norms,
        }
    results["scale2"] = scale2
    for name in cases:
        results[name] = {}
        for variant, (accum, clip) in VARIANTS.items():
            t = time.perf_counter()
            results[name][variant] = run_case(CASES[name](), accum, clip, refs[variant])
            results[name][variant]["seconds"] = time.perf_counter() - t
    if ctx.rank == 0:
        with open(os.path.join(out, "sgd_parity.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
