"""Expert parallelism against one process: a tiny MoELlama, float64, plain SGD, 2 steps.

Usage: moe_parity_worker.py OUT CASE:VARIANT ... [--reshard DIR save|load EP]. Rank 0 writes
OUT/moe_parity.json: {"CASE:VARIANT": {...}}. With ``--reshard``, the same process group then runs
moe_reshard_worker.py's save or load in DIR (one launch for both: each rank's torch import and
process group start are most of a small case's cost). Every rank computes the one-process reference itself with a plain torch
loop on the whole global batch (no Engine, no strategy: the MoE layers' local path), then trains
the case's strategy through the Engine on its data-parallel share and compares

* each step's loss (the mean over ranks of the ranks' losses; the aux loss included);
* the full gradients of the first step (DTensor shards gathered), before the optimizer step;
* every weight and buffer (the expert bias included) after 2 steps (the second on the first's weights and expert bias).

A case ending in ``_broken_combine`` runs with ExpertParallel.combine returning twice the experts'
outputs (as if the combine weights were doubled): the test expects that one to fail.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

import kiln
from kiln.models.moe import update_expert_bias
from kiln.parallel import Hybrid, full_model_state_dict
from kiln.parallel.transforms.expert_parallel import ExpertParallel

LR = 0.5
GLOBAL_BATCH, SEQ, STEPS, VOCAB = 8, 8, 2, 32
CLIP = 0.05

CASES = {
    "ep2": lambda: Hybrid(dp_shard=2, ep=2),
    "ep2_fsdp2": lambda: Hybrid(dp_shard=4, ep=2),
    "ep4": lambda: Hybrid(dp_shard=4, ep=4),
    "ep2_tp2": lambda: Hybrid(dp_shard=2, tp=2, ep=2),
    "ep2_hsdp": lambda: Hybrid(dp_replicate=2, dp_shard=2, ep=2),
}
VARIANTS = {
    # softmax routing and the sequence-wise aux loss (the defaults)
    "plain": {"model": {}, "clip": None},
    # DeepSeek-V3's: sigmoid scores, normalised and scaled, a shared expert, bias balancing
    "bias": {
        "model": {
            "score_func": "sigmoid",
            "route_norm": True,
            "route_scale": 2.5,
            "num_shared_experts": 1,
            "load_balance": "bias",
            "bias_update_rate": 0.01,
        },
        "clip": None,
    },
    # every step clips: the global norm must count the experts' shards once
    "clip": {"model": {}, "clip": CLIP},
}


def make_model(options):
    torch.manual_seed(0)
    model = kiln.models.MoELlama(
        vocab_size=VOCAB,
        dim=16,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_seq_len=SEQ,
        num_experts=4,
        top_k=2,
        moe_hidden_dim=16,
        **options,
    )
    return model.double()


def batches():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (STEPS, GLOBAL_BATCH, SEQ), generator=g)


def _clone(state):
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def reference(variant):
    model = make_model(variant["model"])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads, norms = [], None, []
    for step, tokens in enumerate(batches()):
        opt.zero_grad(set_to_none=True)
        loss = model.loss(model(tokens), tokens)
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        if variant["clip"] is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), variant["clip"])
        opt.step()
        update_expert_bias(model)
    return losses, grads, _clone(model.state_dict()), norms


def full_grads(model):
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out[name] = g.detach().cpu().clone()
    return out


def _diff(got, want):
    missing = sorted(set(want) - set(got))
    common = [k for k in want if k in got]
    if not common:
        return float("inf"), float("inf"), missing
    abs_diff = max((got[k].to(want[k].dtype) - want[k]).abs().max().item() for k in common)
    scale = max(want[k].abs().max().item() for k in common)
    return abs_diff, abs_diff / scale, missing


def run_case(spec, variant, ref):
    ref_losses, ref_grads, ref_weights, ref_norms = ref
    model = make_model(variant["model"])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    engine = kiln.Engine(model, opt, strategy=spec, clip_grad_norm=variant["clip"])
    dp_rank, dp_size = engine.data_parallel_rank, engine.data_parallel_size
    per_rank = GLOBAL_BATCH // dp_size
    losses, grads = [], None
    for step, tokens in enumerate(batches()):
        mine = tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        engine.zero_grad()
        loss = model.loss(engine(mine), mine)
        engine.backward(loss)
        if step == 0:
            grads = full_grads(engine.module)
        engine.step()
        update_expert_bias(engine.module)
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # tensor-parallel ranks repeat their group's loss: the mean is unchanged
        losses.append(mean.item() / dist.get_world_size())
    weights = _clone(full_model_state_dict(engine))
    result = {"loss_abs": max(abs(a - b) for a, b in zip(losses, ref_losses)), "losses": losses}
    for key, got, want in (("grad", grads, ref_grads), ("weight", weights, ref_weights)):
        result[f"{key}_abs"], result[f"{key}_rel"], result[f"{key}_missing"] = _diff(got, want)
    result["ref_losses"], result["ref_norms"] = ref_losses, ref_norms
    if variant["clip"] is not None:
        result["clip"] = variant["clip"]
    if variant["model"].get("load_balance") == "bias":  # the bias moved: the balancing ran
        result["bias_abs"] = max(v.abs().max().item() for k, v in weights.items() if k.endswith("expert_bias"))
    return result


def _break_combine():
    combine = ExpertParallel.combine

    def doubled(self, out, route):
        return 2 * combine(self, out, route)

    ExpertParallel.combine = doubled
    return combine


def main():
    out, cases, reshard = sys.argv[1], sys.argv[2:], None
    if "--reshard" in cases:
        at = cases.index("--reshard")
        cases, reshard = cases[:at], cases[at + 1 :]
    ctx = kiln.launch_from_torch(seed=0)
    results = {}
    refs = {}
    for item in cases:
        name, variant_name = item.split(":")
        variant = VARIANTS[variant_name]
        if variant_name not in refs:
            refs[variant_name] = reference(variant)
        broken = name.endswith("_broken_combine")
        original = _break_combine() if broken else None
        try:
            results[item] = run_case(CASES[name.removesuffix("_broken_combine")](), variant, refs[variant_name])
        finally:
            if original is not None:
                ExpertParallel.combine = original
    if ctx.rank == 0:
        with open(os.path.join(out, "moe_parity.json"), "w") as f:
            json.dump(results, f, indent=1)
    if reshard is not None:
        from moe_reshard_worker import run

        folder, mode, ep = reshard
        run(folder, mode, int(ep), ctx)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
