"""Zero-bubble pipeline schedules against one process under plain SGD in float64, and a pipeline
under FSDP and amp_bf16 against one process under autocast.

Usage: zero_bubble_worker.py OUT CASE ... Rank 0 writes OUT/zero_bubble.json: {case: {variant: ...}}.
Each rank computes the one-process reference itself with a plain torch loop on the whole global
batch (see sgd_parity_worker.py for why SGD: a gradient twice too large is a step twice too long).

The V schedules (zbv, dualpipev) hold 2 stages per rank, so the model has 2 blocks per rank: 4
blocks on 2 ranks, 8 on 4, cut before every block but the first (stage 0 is the input layer and
block 0, the last stage block N-1 and the head).
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.fx.config
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import kiln
from kiln.parallel import Hybrid, Pipeline
from parallel_model import Net, make_data
from sgd_parity_worker import _clone, _diff, full_grads, full_weights

CLIP = 0.05  # under every step's gradient norm (about 1): every step clips
VARIANTS = {"plain": (1, None), "accum2": (2, None), "clip": (1, CLIP), "accum2_clip": (2, CLIP)}
LR = 0.5  # a power of two: (w0 - w1) / LR is the applied gradient exactly
GLOBAL_BATCH, STEPS = 16, 2


def _splits(blocks):
    return [f"blocks.{i}" for i in range(1, blocks)]


# zbv on 2 ranks: with neither, and with accumulation and clipping in one run (they were three runs:
# the gradients read before clipping and the norms see the accumulation, the applied gradient the clip)
PLAIN_AND_BOTH = ("plain", "accum2_clip")
# where a run costs more (4 ranks, each traced model ~1 s of CPU): accumulation and clipping at once;
# the first-step gradients (summed over micro-steps, before clipping) and the norms still see a 2x
FEW = ("accum2_clip",)
# name: (blocks, strategy factory, precision, dtype, variants)
CASES = {
    "zbv": (4, lambda: Pipeline(_splits(4), schedule="zbv", microbatches=4), None, torch.float64, PLAIN_AND_BOTH),
    "dualpipev": (4, lambda: Pipeline(_splits(4), schedule="dualpipev", microbatches=4), None, torch.float64, FEW),
    "interleaved_zb": (
        4,
        lambda: Pipeline(_splits(4), schedule="interleaved_zb", microbatches=4),
        None,
        torch.float64,
        FEW,
    ),
    "zbv_4": (8, lambda: Pipeline(_splits(8), schedule="zbv", microbatches=8), None, torch.float64, FEW),
    "dualpipev_4": (8, lambda: Pipeline(_splits(8), schedule="dualpipev", microbatches=8), None, torch.float64, FEW),
    "interleaved_zb_4": (
        8,
        lambda: Pipeline(_splits(8), schedule="interleaved_zb", microbatches=8),
        None,
        torch.float64,
        FEW,
    ),
    # FSDP inside the stages of a V: the weight-gradient pass needs the gathered parameters
    "zbv_fsdp": (
        4,
        lambda: Hybrid(pp=2, dp_shard=2, split_points=_splits(4), schedule="zbv", microbatches=4),
        None,
        torch.float64,
        FEW,
    ),
    # the bug of issue 26: pp x FSDP under amp_bf16 sent bfloat16 stage outputs into float32 buffers
    "amp_bf16_fsdp": (
        4,
        lambda: Hybrid(pp=2, dp_shard=2, split_points=["blocks.2"], microbatches=2),
        "amp_bf16",
        torch.float32,
        ("plain",),
    ),
}


def make_model(blocks, dtype):
    torch.manual_seed(0)
    return Net(num_blocks=blocks).to(dtype)


def _data(dtype):
    # STEPS batches to train on and one more to evaluate on, drawn as 4 batches (the data of the 3
    # steps this ran before): the amp_bf16 case's first batch is one where bf16 moves the loss by
    # 7.3e-4 from float32 (the test's "it really ran in bf16"; on the first of 3 batches drawn, 4.9e-5)
    x, y = make_data(max(STEPS + 1, 4), GLOBAL_BATCH)
    return x.to(dtype), y


def reference(blocks, dtype, clip, autocast=False, lr=LR):
    """One process, plain torch on the whole global batch: (first-step gradients, weights after the
    first step, weights after all steps, each step's loss, each step's gradient norm)."""
    x, y = _data(dtype)
    model = make_model(blocks, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    grads = first = None
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        batch = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x[batch])
            loss = nn.functional.cross_entropy(out.float() if autocast else out, y[batch])
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        params = list(model.parameters())
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in params])))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        if step == 0:
            first = _clone(model.state_dict())
    return grads, first, _clone(model.state_dict()), losses, norms


class SentDtypes(TorchDispatchMode):
    """The dtypes of the activations and gradients a pipeline's sends and receives carry (c10d's
    send and recv ops, as kiln.planning.comm_count sees them)."""

    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.c10d.send.default, torch.ops.c10d.recv_.default):
            # activations and their gradients, not torch's one-number set-up exchanges
            self.dtypes.update(str(t.dtype) for t in args[0] if t.numel() > 1)
        return func(*args, **(kwargs or {}))


def run_case(name, accum, clip):
    """Train case ``name`` for STEPS steps; return what the test compares with the reference."""
    blocks, make_strategy, precision, dtype, _ = CASES[name]
    model = make_model(blocks, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    engine = kiln.Engine(
        model,
        opt,
        nn.CrossEntropyLoss(),
        strategy=make_strategy(),
        precision=precision,
        gradient_accumulation=accum,
        clip_grad_norm=clip,
    )
    dp_rank, dp_size = engine.data_parallel_rank, engine.data_parallel_size
    x, y = _data(dtype)
    micro = GLOBAL_BATCH // accum
    per_rank = micro // dp_size
    grads = first = None
    losses, norms = [], []
    for step in range(STEPS):
        step_loss = 0.0
        for m in range(accum):
            start = step * GLOBAL_BATCH + m * micro + dp_rank * per_rank
            engine.zero_grad()
            loss = engine.criterion(engine(x[start : start + per_rank]), y[start : start + per_rank])
            engine.backward(loss)
            step_loss += loss.item() / accum
            if step == 0 and m == accum - 1:
                grads = full_grads(engine)
            engine.step()
        # the loss of the global batch: the mean over the data-parallel shares (equal sizes); every
        # rank of a pipeline reports its pipeline's loss, so the mean over the world is that mean
        total = torch.tensor([step_loss], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
        if clip is not None:
            norms.append(float(engine.last_grad_norm))
        if step == 0:
            first = _clone(full_weights(engine))
            outputs = _eval(engine, x, dp_rank * per_rank, per_rank)  # then train on: the schedule is restored
    last = _clone(full_weights(engine))
    return {"grads": grads, "first": first, "last": last, "losses": losses, "norms": norms, "eval": outputs}


def _eval(engine, x, start, rows):
    """The eval-mode forward (a forward-only schedule) of each rank on its data-parallel share of a
    new batch shaped like a training microbatch: [(first row, output)] of every rank."""
    engine.eval()
    rows = slice(STEPS * GLOBAL_BATCH + start, STEPS * GLOBAL_BATCH + start + rows)
    with torch.no_grad():
        out = engine(x[rows]).detach().cpu()
    engine.train()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (rows.start, rows.stop, out))
    return every


def compare(got, ref, blocks, dtype):
    ref_grads, ref_first, ref_last, ref_losses, ref_norms = ref
    init = make_model(blocks, dtype).state_dict()
    applied = {k: (init[k] - v) / LR for k, v in got["first"].items()}
    ref_applied = {k: (init[k] - v) / LR for k, v in ref_first.items()}
    result = {}
    for key, mine, want in (
        ("grad", got["grads"], ref_grads),
        ("update", applied, ref_applied),
        ("weight", got["last"], ref_last),
    ):
        result[f"{key}_abs"], result[f"{key}_rel"], result[f"{key}_missing"] = _diff(mine, want)
    result["loss_abs"] = max(abs(a - b) for a, b in zip(got["losses"], ref_losses, strict=True))
    result["losses"], result["ref_losses"] = got["losses"], ref_losses
    # every rank's eval output against the reference model after the first step
    model = make_model(blocks, dtype)
    model.load_state_dict(ref_first)
    x, _ = _data(dtype)
    with torch.no_grad():
        result["eval_abs"] = [(out - model(x[start:stop])).abs().max().item() for start, stop, out in got["eval"]]
    result["norms"], result["ref_norms"] = got["norms"], ref_norms
    return result


def main():
    out, cases = sys.argv[1], sys.argv[2:]
    ctx = kiln.launch_from_torch(seed=0)
    # the source stack fx records for each traced node, and prints into each stage's code, is for a
    # reader of the graph, which nothing here is: without it a pipeline's trace costs less CPU
    torch.fx.config.do_not_emit_stack_traces = True
    results = {"steps": STEPS, "clip": CLIP}
    refs = {}
    for name in cases:
        blocks, _, precision, dtype, variants = CASES[name]
        results[name] = {}
        if precision == "amp_bf16":
            # the same run under autocast on one process, and in float32: how far bf16 moves the
            # numbers, which the pipeline's distance from the autocast run must stay well under
            # the stages send, receive and compute gradients in FSDP's bf16 (traced in it)
            with SentDtypes() as sent:
                got = run_case(name, 1, None)
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, sorted(sent.dtypes))
            results[name]["p2p_dtypes"] = sorted({d for rank in every for d in rank})
            ref_amp, ref_fp32 = reference(blocks, dtype, None, autocast=True), reference(blocks, dtype, None)
            results[name]["amp"] = compare(got, ref_amp, blocks, dtype)
            results[name]["fp32"] = compare(got, ref_fp32, blocks, dtype)
            results[name]["amp_vs_fp32"] = compare(
                {
                    "grads": ref_amp[0],
                    "first": ref_amp[1],
                    "last": ref_amp[2],
                    "losses": ref_amp[3],
                    "norms": [],
                    "eval": [],
                },
                ref_fp32,
                blocks,
                dtype,
            )
            continue
        for variant in variants:
            accum, clip = VARIANTS[variant]
            key = (blocks, variant)
            if key not in refs:
                refs[key] = reference(blocks, dtype, clip)
            t = time.perf_counter()
            results[name][variant] = compare(run_case(name, accum, clip), refs[key], blocks, dtype)
            results[name][variant]["seconds"] = time.perf_counter() - t
    if "scale2" not in results and any(CASES[c][2] is None for c in cases):
        # what a gradient twice too large would do, per variant: the reference with 2 * LR
        blocks = CASES[cases[0]][0]
        results["scale2"] = {}
        for variant, (_, clip) in VARIANTS.items():
            ref = reference(blocks, torch.float64, clip)
            ref2 = reference(blocks, torch.float64, clip, lr=2 * LR)
            results["scale2"][variant] = {
                "grad_abs": max(g.abs().max().item() for g in ref[0].values()),
                "weight_abs": _diff(ref2[2], ref[2])[0],
            }
    if ctx.rank == 0:
        with open(os.path.join(out, "zero_bubble.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main()
