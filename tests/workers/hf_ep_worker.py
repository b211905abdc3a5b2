"""Expert parallelism of a transformers MoE model against one process: float64, SGD, accumulation, clipping.

Usage: hf_ep_worker.py OUT CASE ... (CASE: ``mixtral``, ``qwen2_moe``, ``qwen3_moe``, or one of them
with ``_unscaled``). Rank 0 writes OUT/hf_ep.json: {case: {"losses", "ref_losses", "norms",
"ref_norms", "weight_diff", "local_experts", "mesh"}}.

Each rank computes the one-process reference itself with a plain torch loop on the whole global
batch (every microbatch's mean loss over ACCUM, then clipping at CLIP, below every step's norm,
and an SGD step). The case trains the same model (same seed) through kiln's Engine under
``Hybrid(dp_shard=2, ep=2)`` (on 4 ranks ``Hybrid(dp_shard=4, ep=2)``: efsdp 2) with
``gradient_accumulation=ACCUM`` and ``clip_grad_norm=CLIP``, each rank on its share of every microbatch (the two halves hold as many tokens: the mean of the ranks'
mean losses is the global one). Compared: every microbatch's loss (the mean over ranks), every
step's global gradient norm before clipping and every weight after STEPS steps (DTensors gathered).

A case ending in ``_unscaled`` puts the experts' gradient scale back to 1 after setup (the
``1 / ep`` of kiln.parallel.transforms.expert_parallel dropped): the test expects it to fail.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

import kiln
from kiln.models import HuggingFaceModel
from kiln.parallel import Hybrid

STEPS, ACCUM, BATCH, SEQ, CLIP, LR = 3, 2, 4, 8, 0.05, 0.5
COMMON = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)  # fmt: skip


def make_model(kind):
    import transformers

    torch.manual_seed(0)
    if kind == "mixtral":
        config = transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)
        cls = transformers.MixtralForCausalLM
    elif kind == "qwen2_moe":  # a shared expert with its sigmoid gate beside the routed ones; top-k not renormalised
        config = transformers.Qwen2MoeConfig(
            **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16
        )
        cls = transformers.Qwen2MoeForCausalLM
    else:  # qwen3_moe: top-k renormalised
        config = transformers.Qwen3MoeConfig(
            **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True
        )
        cls = transformers.Qwen3MoeForCausalLM
    config._experts_implementation = "eager"  # transformers' grouped_mm takes no float64
    return HuggingFaceModel(cls(config).double())


def batches():
    """STEPS x ACCUM global microbatches of BATCH sequences."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, COMMON["vocab_size"], (STEPS, ACCUM, BATCH, SEQ), generator=g)
    return [[{"input_ids": t} for t in step] for step in tokens]


def loss_of(outputs, batch):
    """The next-token cross-entropy in the logits' float64 (transformers' own loss casts the
    logits to float32, whose rounding of the mean differs between one batch and its two halves
    by ~5e-7)."""
    logits, ids = outputs.logits[:, :-1], batch["input_ids"][:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))


def full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def reference(kind):
    model = make_model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in batches():
        opt.zero_grad(set_to_none=True)
        for batch in step:
            loss = loss_of(model(batch), batch)
            (loss / ACCUM).backward()
            losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
    return losses, norms, {n: full(p) for n, p in model.named_parameters()}


def expert_modules(model):
    from kiln.parallel.transforms.hf_expert_parallel import fused_experts

    return [m for _, m in fused_experts(model)]


def run(kind, unscaled):
    model = make_model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    # on 4 ranks (by hand; the suite runs 2): the experts FSDP-sharded over the efsdp = 2 ranks that hold the same ones
    strategy = Hybrid(dp_shard=dist.get_world_size(), ep=2)
    engine = kiln.Engine(model, opt, loss_of, strategy=strategy, gradient_accumulation=ACCUM, clip_grad_norm=CLIP)
    experts = expert_modules(model)
    if unscaled:
        for module in experts:
            module.grad_scale = 1.0
    rank, size = engine.data_parallel_rank, engine.data_parallel_size
    share = BATCH // size
    losses, norms = [], []
    for step in batches():
        for batch in step:
            mine = {k: v[rank * share : (rank + 1) * share] for k, v in batch.items()}
            engine.zero_grad()
            loss = engine.criterion(engine(mine), mine)
            engine.backward(loss)
            stepped = engine.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / dist.get_world_size())
        assert stepped
        norms.append(float(engine.last_grad_norm))
    first = experts[0].gate_up_proj
    return {
        "losses": losses,
        "norms": norms,
        "weights": {n: full(p) for n, p in model.named_parameters()},
        "local_experts": first.to_local().shape[0],
        "mesh": list(first.device_mesh.mesh_dim_names),
        "layers": len(experts),
    }


def main():
    out, cases = sys.argv[1], sys.argv[2:]
    kiln.launch_from_torch(seed=0)
    results = {}
    refs = {}
    for case in cases:
        kind = case.removesuffix("_unscaled")
        if kind not in refs:
            refs[kind] = reference(kind)
        ref_losses, ref_norms, ref_weights = refs[kind]
        got = run(kind, unscaled=case.endswith("_unscaled"))
        weights = got.pop("weights")
        assert set(weights) == set(ref_weights), sorted(set(weights) ^ set(ref_weights))
        diffs = {n: (weights[n] - ref_weights[n]).abs().max().item() for n in ref_weights}
        worst = max(diffs, key=diffs.get)
        results[case] = {
            **got,
            "ref_losses": ref_losses,
            "ref_norms": ref_norms,
            "weight_diff": diffs[worst],
            "worst_weight": worst,
            "moved": max((weights[n] - make_ref_start(kind)[n]).abs().max().item() for n in weights),
        }
    if dist.get_rank() == 0:
        with open(os.path.join(out, "hf_ep.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()


_STARTS = {}


def make_ref_start(kind):
    """The initial weights (to check that training moved them)."""
    if kind not in _STARTS:
        _STARTS[kind] = {n: p.detach().clone() for n, p in make_model(kind).named_parameters()}
    return _STARTS[kind]


if __name__ == "__main__":
    main()
