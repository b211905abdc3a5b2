"""Tiny transformers MoE decoders (fused experts) under tensor parallelism against one process, float64.

Usage: fused_experts_worker.py OUT CASE ... Rank 0 writes OUT/fused_experts.json: {case: {"losses",
"ref_losses", "grad_diff", "weight_diff", "norms", "ref_norms", "placements", "local_shapes", ...}}.
Each rank computes the one-process reference with a plain torch loop on the whole batch; the case
trains the same model with kiln's Engine, with clipping below every step's norm. Compared: every
step's loss, the first step's gradients (DTensors gathered), every step's global gradient norm and
the weights after the steps. The cases:

* ``sgd``, ``adamw``: a Mixtral under ``TensorParallel(sequence_parallel=False)`` (the model's own
  plan, whose fused experts kiln splits with its ``fused_experts`` style, outputs all-reduced),
  STEPS steps, on 2 ranks; on 4, ``Hybrid(dp_shard=2, tp=2)``, every data-parallel rank reading the
  whole batch.
* ``sp_mixtral``, ``sp_qwen2_moe``, ``sp_qwen3_moe``: kiln's default with tp > 1, sequence and loss
  parallelism (:func:`kiln.models.tp_plan.huggingface_sequence_parallel_plan`), under SGD, SP_STEPS
  steps of gradient accumulation over 2 micro-steps and clipping; ``TensorParallel()`` on 2 ranks,
  ``Hybrid(dp_shard=2, tp=2)`` on 4 (each data-parallel rank reading its half of each micro-step).
  Qwen2-MoE has a shared expert with its sigmoid gate; the Qwen3-MoE's second layer is dense
  (``mlp_only_layers``) and its attention normalises q and k per head. Their RMSNorms and the
  reference's loss compute in float64 (tests/workers/hf_common.py's ``exact``: transformers rounds
  both to float32, kiln's loss-parallel cross-entropy does not). Also recorded (``seen``), on the
  first forward: the placements of the decoder norms' and the MoE blocks' outputs, the norms' local
  sequence length and the logits' placements: what shows sequence and loss parallelism ran.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

import kiln
from kiln.models import HuggingFaceModel
from kiln.parallel import Hybrid, TensorParallel

STEPS, SP_STEPS, BATCH, SEQ, CLIP, ACCUM = 3, 2, 4, 16, 0.05, 2
COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
CONFIGS = {
    "mixtral": dict(COMMON, intermediate_size=48, num_local_experts=4, router_jitter_noise=0.0),
    "qwen2_moe": dict(
        COMMON, intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=4
    ),  # fmt: skip
    "qwen3_moe": dict(
        COMMON,
        intermediate_size=48,
        moe_intermediate_size=24,
        num_experts=4,
        mlp_only_layers=[1],
        head_dim=8,
        norm_topk_prob=True,
    ),  # fmt: skip
}
CONFIG = CONFIGS["mixtral"]  # tests/test_fused_experts.py's shapes


def make_model(family="mixtral", exact=False):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **CONFIGS[family])
    config._experts_implementation = "eager"  # transformers' grouped_mm takes no float64
    hf = AutoModelForCausalLM.from_config(config).double()
    if exact:
        from hf_common import exact_causal_lm_loss

        norm = next(type(m) for m in hf.modules() if type(m).__name__.endswith("RMSNorm"))
        exact_class = type(f"Exact{norm.__name__}", (norm,), {"forward": exact_norm})
        for module in hf.modules():
            if type(module) is norm:
                module.__class__ = exact_class
        hf.loss_function = exact_causal_lm_loss
    return HuggingFaceModel(hf)


def exact_norm(self, hidden_states):
    """transformers' RMSNorm in the input's dtype (float64 here) instead of float32."""
    x = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x


def batches(steps=STEPS):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, COMMON["vocab_size"], (steps, BATCH, SEQ), generator=g)
    return [{"input_ids": t, "labels": t.clone()} for t in tokens]


def optimizer(kind, params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1) if kind == "adamw" else torch.optim.SGD(params, lr=0.5)


def full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def placements(t):
    from torch.distributed.tensor import DTensor

    return [str(p) for p in t.placements] if isinstance(t, DTensor) else "plain"


class Seen:
    """Forward hooks (after tensor parallelism's) recording, on the first forward, the placements of
    the decoder norms' and the MoE blocks' outputs, the norms' local sequence length and the logits'."""

    def __init__(self, model):
        self.seen = {"norms": set(), "norm_seq": set(), "moe": set()}
        self.handles = []
        for name, module in model.named_modules():
            leaf = name.rpartition(".")[2]
            if leaf in ("input_layernorm", "post_attention_layernorm"):
                self.handles.append(module.register_forward_hook(self._norm))
            elif leaf == "mlp" and hasattr(module, "experts"):
                self.handles.append(module.register_forward_hook(self._moe))

    def _norm(self, module, args, out):
        self.seen["norms"].add(str(placements(out)))
        self.seen["norm_seq"].add(int((out.to_local() if hasattr(out, "to_local") else out).shape[1]))

    def _moe(self, module, args, out):
        self.seen["moe"].add(str(placements(out)))

    def result(self, logits):
        for h in self.handles:
            h.remove()
        return {**{k: sorted(v) for k, v in self.seen.items()}, "logits": placements(logits)}


def train(kind, family="mixtral", engine_of=None):
    sp = kind.startswith("sp_")
    model = make_model(family, exact=sp)
    opt = optimizer(kind, model.parameters())
    engine = engine_of(model, opt) if engine_of else None
    accum = ACCUM if sp and engine is not None else 1
    rank, size = (engine.data_parallel_rank, engine.data_parallel_size) if sp and engine else (0, 1)
    seen = Seen(engine.module) if engine is not None else None
    losses, norms, grads = [], [], None
    for step, batch in enumerate(batches(SP_STEPS if sp else STEPS)):
        if engine is None:
            opt.zero_grad(set_to_none=True)
            loss = model.loss(model(batch), batch)
            loss.backward()
            norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            step_loss = loss.item()
        else:
            step_loss = 0.0
            for m in range(accum):
                # sequence-parallel cases: this data-parallel rank's share of the micro-step
                micro = {k: v.chunk(accum)[m].chunk(size)[rank] for k, v in batch.items()}
                engine.zero_grad()
                out = engine(micro)
                if isinstance(seen, Seen):  # the first forward's
                    seen = seen.result(out.logits)
                loss = engine.criterion(out, micro)
                engine.backward(loss)
                step_loss += loss.item() / accum
                engine.step()  # clips first (on the last micro-step): last_grad_norm is the norm before clipping
            norms.append(float(engine.last_grad_norm))
            if size > 1:  # the mean of the data-parallel ranks' losses (the tp ranks' are the same)
                t = torch.tensor([step_loss], dtype=torch.float64)
                dist.all_reduce(t)
                step_loss = t.item() / dist.get_world_size()
        losses.append(step_loss)
        if step == 0:
            grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    weights = {n: full(p) for n, p in model.named_parameters()}
    return losses, norms, grads, weights, model, seen


def diff(got, want):
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    return max((got[k] - want[k]).abs().max().item() for k in want)


def strategy(kind):
    # on 4 ranks, FSDP over 2 x TP 2 (a plain-TP case's data-parallel ranks read the whole batch:
    # the mean of equal gradients is the one process's)
    two = dist.get_world_size() == 2
    if kind.startswith("sp_"):  # kiln's default: sequence and loss parallelism
        return TensorParallel() if two else Hybrid(dp_shard=2, tp=2)
    return TensorParallel(sequence_parallel=False) if two else Hybrid(dp_shard=2, tp=2, sequence_parallel=False)


def main():
    out, cases = sys.argv[1], sys.argv[2:]
    kiln.launch_from_torch(seed=0)
    results = {}
    for kind in cases:
        family = kind.removeprefix("sp_") if kind.startswith("sp_") else "mixtral"
        ref_losses, ref_norms, ref_grads, ref_weights, _, _ = train(kind, family)

        def engine_of(model, opt, kind=kind):
            return kiln.Engine(model, opt, model.loss, strategy=strategy(kind), clip_grad_norm=CLIP,
                               gradient_accumulation=ACCUM if kind.startswith("sp_") else 1)  # fmt: skip

        losses, norms, grads, weights, model, seen = train(kind, family, engine_of)
        experts = model.model.model.layers[0].mlp.experts
        results[kind] = {
            "losses": losses,
            "ref_losses": ref_losses,
            "norms": norms,
            "ref_norms": ref_norms,
            "grad_diff": diff(grads, ref_grads),
            "weight_diff": diff(weights, ref_weights),
            "seen": seen,
            "placements": {
                n: [[type(p).__name__, p.dim, getattr(p, "split_factor", 1)] for p in getattr(experts, n).placements]
                for n in ("gate_up_proj", "down_proj")
            },
            "local_shapes": {n: list(getattr(experts, n).to_local().shape) for n in ("gate_up_proj", "down_proj")},
        }
        mlp = model.model.model.layers[0].mlp
        if hasattr(mlp, "shared_expert"):  # split as a Llama mlp; its sigmoid gate whole on every rank
            results[kind]["shared"] = {
                n: placements(getattr(mlp.shared_expert, n).weight) for n in ("gate_proj", "up_proj", "down_proj")
            }
            results[kind]["shared"]["shared_expert_gate"] = placements(mlp.shared_expert_gate.weight)
    if dist.get_rank() == 0:
        with open(os.path.join(out, "fused_experts.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main()
