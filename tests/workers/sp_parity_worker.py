"""Tensor + sequence + loss parallelism against one process, under plain SGD (and AdamW) in float64.

Usage: sp_parity_worker.py OUT CASE ... Rank 0 writes OUT/sp_parity.json: {case: {variant: {...}}}.
Each rank computes the one-process reference itself with a plain torch loop (no Engine) on the whole
global batch; the case trains the same model with kiln's Engine (the model's own loss), each rank
reading its data-parallel share of each micro-step, and compares the per-step losses, the first
step's gradients (DTensor shards gathered), the weights after STEPS steps and, when clipping, each
step's global gradient norm. Every case runs gradient accumulation over 2 micro-steps and clipping
(CLIP is below every step's norm, so every step clips) at once, variant ``accum2_clip``
(SP_PARITY_VARIANTS=accum2,clip runs them apart instead). The one-process references are computed
by rank 0 once per (model, clipping) and saved in SP_PARITY_REFS (default OUT), which the test's
launches share, then sent to every rank.

``llama_tp2_adamw`` runs ``llama_tp2`` under AdamW (its reference too). The sequence-parallel Llama
cases (COUNTED) also count each step's tensor-parallel all-reduces, those DTensor runs inside its
ops included (count_all), in the backwards and in the optimizer step (clipping, the optimizer's ops),
and report the bytes of the replicated parameters (the norms' weights).

The first forward of every case also records what runs where (forward hooks and a dispatch mode):
the placements of the row-wise projections' outputs (a reduce-scatter leaves ``Shard(1)``), of the
norms' outputs, the logits' placements and local shape, and the largest tensor any op of one
training micro-step (forward, loss, backward) left on the rank whose last dimension is the whole
vocabulary: none under loss parallelism.
"""

import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.fx.config
from torch.utils._python_dispatch import TorchDispatchMode

import kiln
from kiln.parallel import Hybrid, Pipeline, TensorParallel, full_model_state_dict
from kiln.planning.comm_count import CollectiveCounter

# 2 steps: the second runs on the first's updated weights (and AdamW's state of it); a third proved
# nothing the second does not, at a third more of every case's training
LR, CLIP, STEPS, GLOBAL_BATCH = 0.5, 0.05, 2, 8
# (gradient_accumulation, clip_grad_norm)
VARIANTS = {"accum2": (2, None), "clip": (1, CLIP), "accum2_clip": (2, CLIP)}
# positions whose label is IGNORE_INDEX: the first IGNORED of every sequence, so every micro-batch
# counts as many tokens and the mean of the micro-batch means is the global token mean
IGNORED = 2

# layers of each Llama: 2 for tensor parallelism and 2 stages x TP x FSDP; the pipelines' a layer a
# stage (4 stages) and two stages a rank (8 stages, interleaved)
LAYERS = {"llama": 2, "llama4": 4, "llama8": 8}


def _split(layers):
    return [f"model.model.layers.{i}" for i in range(1, layers)]


MOE = dict(
    vocab_size=96,  # no other dimension of the model is 96 (nor 48)
    dim=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    max_seq_len=8,
    num_dense_layers=1,
    num_experts=4,
    top_k=2,
    moe_hidden_dim=16,
    num_shared_experts=1,
)

CASES = {
    "llama_tp2": ("llama", lambda: TensorParallel()),
    "llama_tp2_off": ("llama", lambda: TensorParallel(sequence_parallel=False)),
    # the same under AdamW (OPTIMIZERS): a stateful optimizer reads each gradient in several ops
    "llama_tp2_adamw": ("llama", lambda: TensorParallel()),
    "moe_tp2": ("moe", lambda: TensorParallel()),
    "llama_fsdp2_tp2": ("llama", lambda: Hybrid(dp_shard=2, tp=2)),
    "moe_fsdp2_tp2": ("moe", lambda: Hybrid(dp_shard=2, tp=2)),
    # a Hugging Face decoder cut into 4 and 8 stages (its rotary embeddings computed in every stage,
    # kiln.models.hf_stages); 4 microbatches of each micro-step
    "llama_pp4_1f1b": ("llama4", lambda: Pipeline(_split(4), schedule="1f1b", microbatches=4)),
    "llama_pp4_interleaved": ("llama8", lambda: Pipeline(_split(8), schedule="interleaved1f1b", microbatches=4)),
    # 8 ranks: 2 stages x tensor parallel 2 x FSDP 2 (tests/test_sequence_parallel.py's 8-rank launch),
    # of the 2-layer Llama, a layer a stage (each of the 8 ranks traces the whole model)
    "llama_pp2_tp2_fsdp2": (
        "llama",
        lambda: Hybrid(pp=2, tp=2, dp_shard=2, split_points=_split(2), microbatches=2),
    ),
}
PIPELINES = {"llama_pp4_1f1b", "llama_pp4_interleaved", "llama_pp2_tp2_fsdp2"}
# the optimizer of each case (SGD where not named) and its one-process reference
OPTIMIZERS = {"llama_tp2_adamw": "adamw"}
# the cases whose tensor-parallel all-reduces are counted (count_all), in each step's backwards and in
# its optimizer step: a sequence-parallel Llama, whose backward all-reduces nothing but its replicated
# parameters' gradients (the MoELlama's blocks also all-reduce activation gradients)
COUNTED = {"llama_tp2", "llama_tp2_adamw"}
ROWWISE = ("o_proj", "down_proj", "wo", "w2")
NORMS = ("input_layernorm", "post_attention_layernorm", "attention_norm", "ffn_norm")


def make_model(family):
    if family in LAYERS:
        from hf_common import make_model as make_llama

        return make_llama(num_hidden_layers=LAYERS[family])
    torch.manual_seed(0)
    return kiln.models.MoELlama(**MOE).double()


def vocab(family):
    return MOE["vocab_size"] if family == "moe" else 256


def make_batches(family):
    """STEPS global batches of {"input_ids", "labels"}, IGNORED positions of each label row masked."""
    if family in LAYERS:
        from hf_common import batches

        out = batches(STEPS, GLOBAL_BATCH)
    else:
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, MOE["vocab_size"], (STEPS, GLOBAL_BATCH, MOE["max_seq_len"]), generator=g)
        out = [{"input_ids": t, "labels": t.clone()} for t in tokens]
    for batch in out:
        batch["labels"][:, :IGNORED] = -100
    return out


def make_optimizer(kind, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=LR)


def count_all():
    """kiln's collective counter that also sees the collectives DTensor runs inside its ops (the
    redistributions an op's sharding needs: kiln.planning.comm_count, ``inside_dtensor``)."""
    return CollectiveCounter({"tp": 2}, inside_dtensor=True)


def _tp_all_reduce(counter):
    return counter.calls.get("all_reduce", {}).get("tp", 0), counter.bytes.get("all_reduce", {}).get("tp", 0)


def _clone(state):
    return {k: v.detach().cpu().clone() for k, v in state.items() if isinstance(v, torch.Tensor)}


def reference(family, clip, optimizer="sgd"):
    model = make_model(family)
    opt = make_optimizer(optimizer, model.parameters())
    losses, grads, norms = [], None, []
    for step, batch in enumerate(make_batches(family)):
        opt.zero_grad(set_to_none=True)
        loss = model.loss(model(batch), batch)
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return losses, grads, _clone(model.state_dict()), norms


def full_grads(model, pipeline=False):
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out[name] = g.detach().cpu().clone()
    if pipeline:  # each rank holds its stages' gradients: the whole model's, from every rank
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, out)
        out = {k: v for part in parts for k, v in part.items()}
    return out


def _diff(got, want):
    missing = sorted(set(want) - set(got))
    common = [k for k in want if k in got]
    if not common:
        return float("inf"), missing
    return max((got[k].to(want[k].dtype) - want[k]).abs().max().item() for k in common), missing


def _placements(t):
    from torch.distributed.tensor import DTensor

    return [str(p) for p in t.placements] if isinstance(t, DTensor) else "plain"


class Layout:
    """Forward hooks (registered after tensor parallelism's) recording, on the first forward, the placements of the row-wise projections'
    and the norms' outputs (a set per kind) and the norms' local sequence length."""

    def __init__(self, model):
        self.rowwise, self.norms, self.norm_seq, self.handles = set(), set(), set(), []
        for name, module in model.named_modules():
            leaf = name.rpartition(".")[2]
            if "shared_experts" in name:  # inside a MoE, which runs whole on the gathered sequence
                continue
            if leaf in ROWWISE or leaf in NORMS:
                self.handles.append(module.register_forward_hook(self._hook(leaf in ROWWISE)))

    def _hook(self, rowwise):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            (self.rowwise if rowwise else self.norms).add(str(_placements(out)))
            if not rowwise:
                local = out.to_local() if hasattr(out, "to_local") else out
                self.norm_seq.add(int(local.shape[1]))

        return hook

    def remove(self):
        for h in self.handles:
            h.remove()

    def result(self):
        return {"rowwise": sorted(self.rowwise), "norms": sorted(self.norms), "norm_seq": sorted(self.norm_seq)}


class LargestVocabTensor(TorchDispatchMode):
    """The largest number of elements of any op output (its local part, for a DTensor) whose last
    dimension is the whole vocabulary: a full-vocabulary logits tensor made anywhere shows here."""

    def __init__(self, vocab_size):
        super().__init__()
        self.vocab, self.largest = vocab_size, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                local = t.to_local() if hasattr(t, "to_local") else t
                if local.shape[-1] == self.vocab:
                    self.largest = max(self.largest, local.numel())
        return out


def run_case(name, accum, clip, ref):
    family, spec = CASES[name]
    ref_losses, ref_grads, ref_weights, ref_norms = ref
    model = make_model(family)
    opt = make_optimizer(OPTIMIZERS.get(name, "sgd"), model.parameters())
    engine = kiln.Engine(model, opt, model.loss, strategy=spec(), gradient_accumulation=accum, clip_grad_norm=clip)
    # after the styles' own hooks: what leaves each module (a pipeline traces its model: no hooks)
    layout = Layout(engine.module) if name not in PIPELINES else None
    rank, size = engine.data_parallel_rank, engine.data_parallel_size
    losses, norms, grads, seen = [], [], None, {}
    counted = name in COUNTED
    backward_counts, step_counts = [], []  # each step's tp all-reduces (calls, bytes)
    for step, batch in enumerate(make_batches(family)):
        backward_counter, step_counter = count_all(), count_all()
        step_loss = 0.0
        for m in range(accum):
            micro = {k: v.chunk(accum)[m].chunk(size)[rank] for k, v in batch.items()}
            engine.zero_grad()
            if step == 0 and m == 0 and name not in PIPELINES:
                with LargestVocabTensor(vocab(family)) as mode:
                    out = engine(micro)
                    loss = engine.criterion(out, micro)
                # the counter below the mode, which then sees DTensor's ops whole as before (above
                # it, the counter would hand it their local ops: a backward's full-vocabulary temporaries)
                with backward_counter if counted else contextlib.nullcontext(), mode:
                    engine.backward(loss)
                logits = out.logits if hasattr(out, "logits") else out
                local = logits.to_local() if hasattr(logits, "to_local") else logits
                seen = {
                    "logits_placements": _placements(logits),
                    "logits_local_shape": list(local.shape),
                    "logits_local_bytes": local.numel() * local.element_size(),
                    "logits_full_bytes": logits.numel() * logits.element_size(),
                    "largest_full_vocab_tensor": mode.largest,
                    "loss_type": type(loss).__name__,
                    **layout.result(),
                }
                layout.remove()
            else:
                loss = engine.criterion(engine(micro), micro)
                with backward_counter if counted else contextlib.nullcontext():
                    engine.backward(loss)
            step_loss += loss.item() / accum
            if step == 0 and m == accum - 1:
                grads = full_grads(engine.module, pipeline=name in PIPELINES)
            with step_counter if counted else contextlib.nullcontext():
                engine.step()
        backward_counts.append(_tp_all_reduce(backward_counter))
        step_counts.append(_tp_all_reduce(step_counter))
        t = torch.tensor([step_loss], dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
        if clip is not None:
            norms.append(float(engine.last_grad_norm))
    weights = _clone(full_model_state_dict(engine))
    result = {"seen": seen, "losses": losses, "ref_losses": ref_losses}
    if counted:
        from torch.distributed.tensor import DTensor

        params = list(engine.module.parameters())
        dtensors = [p for p in params if isinstance(p, DTensor)]
        result["replicated_grad_bytes"] = sum(
            p.numel() * p.element_size() for p in dtensors if all(q.is_replicate() for q in p.placements)
        )
        result["sharded_grads"] = sum(1 for p in dtensors if any(q.is_shard() for q in p.placements))
        result["backward_all_reduce"], result["step_all_reduce"] = backward_counts, step_counts
    result["loss_abs"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
    result["grad_abs"], result["grad_missing"] = _diff(grads, ref_grads)
    result["weight_abs"], result["weight_missing"] = _diff(weights, ref_weights)
    if clip is not None:
        result["norm_abs"] = max(abs(a - b) for a, b in zip(norms, ref_norms))
        result["ref_norms"] = ref_norms
    return result


def shared_reference(family, clip, refs_dir, optimizer="sgd"):
    """The one-process reference of (family, clip, optimizer): computed once, by rank 0 of the first
    launch that needs it (saved under ``refs_dir``, which the test's launches share), sent to every rank."""
    path = os.path.join(refs_dir, f"ref_{family}_{clip}_{optimizer}.pt")
    box = [None]
    if dist.get_rank() == 0:
        if os.path.exists(path):
            box[0] = torch.load(path, weights_only=True)
        else:
            box[0] = reference(family, clip, optimizer)
            torch.save(box[0], path)
    dist.broadcast_object_list(box, src=0)
    return box[0]


def main():
    out, cases = sys.argv[1], sys.argv[2:]
    ctx = kiln.launch_from_torch(seed=0)
    # A pipeline rank's CPU is mostly torch.export's trace of the whole model (every rank traces it):
    # the source stack fx records for each traced node, and prints into each stage's code, is for a
    # reader of the graph, which nothing here is; without it a pipeline case costs ~20% less.
    torch.fx.config.do_not_emit_stack_traces = True
    # every case runs accumulation over 2 micro-steps and clipping at once (tests/test_sequence_parallel.py)
    variants = os.environ.get("SP_PARITY_VARIANTS", "accum2_clip").split(",")
    refs_dir = os.environ.get("SP_PARITY_REFS", out)
    refs, results = {}, {}
    for name in cases:
        family, optimizer = CASES[name][0], OPTIMIZERS.get(name, "sgd")
        results[name] = {}
        for variant in variants:
            accum, clip = VARIANTS[variant]
            key = family, clip, optimizer
            if key not in refs:
                refs[key] = shared_reference(family, clip, refs_dir, optimizer)
            start = time.perf_counter()
            results[name][variant] = run_case(name, accum, clip, refs[key])
            results[name][variant]["seconds"] = time.perf_counter() - start
    if ctx.rank == 0:
        with open(os.path.join(out, "sp_parity.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
