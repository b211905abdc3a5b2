"""A tiny transformers Mixtral (fused experts) under tensor parallelism against one process, float64.

Usage: fused_experts_worker.py OUT CASE ... (CASE: sgd, adamw). Rank 0 writes
OUT/fused_experts.json: {case: {"losses", "ref_losses", "grad_diff", "weight_diff", "norm_diff",
"placements"}}. Each rank computes the one-process reference with a plain torch loop on the whole
batch; the case trains the same model with kiln's Engine under ``TensorParallel()`` (no plan: the
model's own, whose fused experts kiln splits with its ``fused_experts`` style), with clipping below
every step's norm. Compared: every step's loss, the first step's gradients (DTensors gathered), every
step's global gradient norm and the weights after STEPS steps.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

import kiln
from kiln.models import HuggingFaceModel
from kiln.parallel import Hybrid, TensorParallel

STEPS, BATCH, SEQ, CLIP = 3, 4, 16, 0.05
CONFIG = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
              router_jitter_noise=0.0, tie_word_embeddings=False)  # fmt: skip


def make_model():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(**CONFIG)
    config._experts_implementation = "eager"  # transformers' grouped_mm takes no float64
    return HuggingFaceModel(MixtralForCausalLM(config).double())


def batches():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG["vocab_size"], (STEPS, BATCH, SEQ), generator=g)
    return [{"input_ids": t, "labels": t.clone()} for t in tokens]


def optimizer(kind, params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1) if kind == "adamw" else torch.optim.SGD(params, lr=0.5)


def full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def train(kind, engine_of=None):
    model = make_model()
    opt = optimizer(kind, model.parameters())
    engine = engine_of(model, opt) if engine_of else None
    losses, norms, grads = [], [], None
    for step, batch in enumerate(batches()):
        if engine is None:
            opt.zero_grad(set_to_none=True)
            loss = model.loss(model(batch), batch)
            loss.backward()
            norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
        else:
            engine.zero_grad()
            loss = engine.criterion(engine(batch), batch)
            engine.backward(loss)
            engine.step()  # clips first: last_grad_norm is the norm before clipping
            norms.append(float(engine.last_grad_norm))
        losses.append(loss.item())
        if step == 0:
            grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    weights = {n: full(p) for n, p in model.named_parameters()}
    return losses, norms, grads, weights, model


def diff(got, want):
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    return max((got[k] - want[k]).abs().max().item() for k in want)


def main():
    out, cases = sys.argv[1], sys.argv[2:]
    kiln.launch_from_torch(seed=0)
    results = {}
    for kind in cases:
        ref_losses, ref_norms, ref_grads, ref_weights, _ = train(kind)

        def engine_of(model, opt):
            # on 4 ranks, FSDP over 2 x TP 2 (every data-parallel rank reads the whole batch: the
            # mean of equal gradients is the one process's)
            strategy = TensorParallel() if dist.get_world_size() == 2 else Hybrid(dp_shard=2, tp=2)
            return kiln.Engine(model, opt, model.loss, strategy=strategy, clip_grad_norm=CLIP)

        losses, norms, grads, weights, model = train(kind, engine_of)
        experts = model.model.model.layers[0].mlp.experts
        results[kind] = {
            "losses": losses,
            "ref_losses": ref_losses,
            "norms": norms,
            "ref_norms": ref_norms,
            "grad_diff": diff(grads, ref_grads),
            "weight_diff": diff(weights, ref_weights),
            "placements": {
                n: [[type(p).__name__, p.dim, getattr(p, "split_factor", 1)] for p in getattr(experts, n).placements]
                for n in ("gate_up_proj", "down_proj")
            },
            "local_shapes": {n: list(getattr(experts, n).to_local().shape) for n in ("gate_up_proj", "down_proj")},
        }
    if dist.get_rank() == 0:
        with open(os.path.join(out, "fused_experts.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main()
